"""averaging_period=H: H local optimizer steps between two averagings (local SGD), against plain loops."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import pytest
import torch
from torch import nn

from lightning_crossbow import CrossbowStrategy
from lightning_crossbow.period import AveragingPeriod
from tests.helpers import (
    Classifier,
    ReferenceScaledAveraging,
    ReplicaSnapshot,
    ResumableLoader,
    loader,
    make_data,
    make_net,
    make_optimizer,
    trainer,
)


def reference_local_sgd(
    k: int,
    epochs: int,
    period: int,
    rule: str,
    optimizer: str = "sgd",
    outer_lr: Union[str, float] = 1.0,
    alpha: float = 0.25,
    mu: float = 0.0,
    num_samples: int = 80,
    stop_after: Optional[int] = None,
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], list[bool]]:
    """k learners, each its own model and optimizer, on batches j, k + j, 2k + j, ... of each epoch.

    An averaging follows every ``period``-th step since the last one and every epoch's last step (and, with
    ``stop_after``, the last step taken: fit stopped there). ``"scaled"``: every learner starts from z after an
    averaging; there ``z <- z + eta mean_j (w_j - z) + mu (z - z_prev)``. ``"sma"``: at an averaging step,
    ``c_j = alpha (w_j - z)`` before the local step, then ``w_j <- w_j - c_j`` and ``z <- z + sum_j c_j + mu (z -
    z_prev)``; between, the learners step alone. Returns z, the learners, and whether each step averaged.
    """
    batches = list(loader(make_data(num_samples=num_samples)))
    learners = [make_net() for _ in range(k)]
    optimizers = [make_optimizer(optimizer, m.parameters(), 0.1) for m in learners]
    z = [p.detach().clone() for p in make_net().parameters()]
    z_prev = [t.clone() for t in z]
    gain = ReferenceScaledAveraging(outer_lr, mu)
    averaged, since, steps_per_epoch, taken = [], 0, len(batches) // k, 0
    for epoch in range(epochs):
        for index in range(steps_per_epoch):
            taken += 1
            last = index == steps_per_epoch - 1 or taken == stop_after
            due = since + 1 == period or last
            if rule == "scaled" and since == 0:
                with torch.no_grad():
                    for model in learners:
                        for w, zc in zip(model.parameters(), z):
                            w.copy_(zc)
            corrections = [[alpha * (w.detach() - zc) for w, zc in zip(m.parameters(), z)] for m in learners]
            for j, (model, opt) in enumerate(zip(learners, optimizers)):
                x, y = batches[index * k + j]
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            since += 1
            averaged.append(due)
            if not due:
                continue
            since = 0
            with torch.no_grad():
                if rule == "scaled":
                    moves = [[w - zc for w, zc in zip(m.parameters(), z)] for m in learners]
                    eta = gain.eta(moves, epoch + (index + 1) / steps_per_epoch)
                    step = [eta * sum(d[i] for d in moves) / k for i in range(len(z))]
                else:
                    for model, c in zip(learners, corrections):
                        for w, cw in zip(model.parameters(), c):
                            w -= cw
                    step = [sum(c[i] for c in corrections) for i in range(len(z))]
                z, z_prev = [zc + s + mu * (zc - zp) for zc, s, zp in zip(z, step, z_prev)], z
            if taken == stop_after:
                return z, [[p.detach() for p in m.parameters()] for m in learners], averaged
    return z, [[p.detach() for p in m.parameters()] for m in learners], averaged


class CenterAfterEachStep(L.Callback):
    """z (the module's parameters) after every optimizer step."""

    def __init__(self) -> None:
        self.centers: list[list[torch.Tensor]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.centers.append([p.detach().clone() for p in pl_module.parameters()])


def assert_learners_match(snapshot: ReplicaSnapshot, learners: list[list[torch.Tensor]]) -> None:
    for index, (name, stacked) in enumerate(snapshot.params.items()):
        for j, expected in enumerate(learners):
            torch.testing.assert_close(stacked[j], expected[index], msg=f"learner {j} differs in {name}")


CASES = [
    # k, period, rule, optimizer, outer_lr, mu, engine
    (3, 2, "scaled", "sgd", 1.5, 0.0, "fused"),
    (2, 3, "scaled", "adam", "adaptive", 0.0, "sequential"),
    (2, 4, "scaled", "sgd", "adaptive", 0.5, "fused"),
    (2, 3, "sma", "sgd", None, 0.5, "fused"),
    (4, 2, "sma", "adam", None, 0.9, "sequential"),
]


@pytest.mark.parametrize(("k", "period", "rule", "optimizer", "outer_lr", "mu", "engine"), CASES)
def test_local_steps_then_averaging_match_the_reference(
    k: int, period: int, rule: str, optimizer: str, outer_lr: Any, mu: float, engine: str
) -> None:
    algorithm = dict(algorithm="scaled_averaging", outer_lr=outer_lr) if rule == "scaled" else dict(algorithm="sma")
    strategy = CrossbowStrategy(
        replicas_per_device=k, averaging_period=period, central_momentum=mu, engine=engine, **algorithm
    )
    model, snapshot, centers = Classifier(optimizer=optimizer), ReplicaSnapshot(), CenterAfterEachStep()
    trainer(strategy=strategy, max_epochs=2, callbacks=[snapshot, centers]).fit(model, loader(make_data()))

    z, learners, averaged = reference_local_sgd(
        k, 2, period, rule, optimizer, outer_lr=outer_lr or 1.0, alpha=1.0 / k, mu=mu
    )
    assert len(centers.centers) == len(averaged)
    for (name, param), expected in zip(model.named_parameters(), z):
        torch.testing.assert_close(param.detach(), expected, msg=f"z differs in {name}")
    assert_learners_match(snapshot, learners)
    # z moves at the averaging steps only: between them, what callbacks read is z as the last averaging left it
    before = [p.detach().clone() for p in make_net().parameters()]
    for step, (center, did_average) in enumerate(zip(centers.centers, averaged)):
        unchanged = all(torch.equal(a, b) for a, b in zip(center, before))
        assert unchanged != did_average, f"step {step}: averaged={did_average}, z unchanged={unchanged}"
        before = center


def test_a_period_of_one_is_every_step() -> None:
    def run(**period: int) -> list[torch.Tensor]:
        model = Classifier()
        trainer(strategy=CrossbowStrategy(replicas_per_device=3, **period), max_epochs=2).fit(
            model, loader(make_data())
        )
        return [p.detach() for p in model.parameters()]

    for a, b in zip(run(), run(averaging_period=1)):
        assert torch.equal(a, b)


class StopAtStep(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


def test_fit_stopped_between_two_averagings_averages_the_steps_taken_since() -> None:
    """A callback stops fit mid-epoch, one step after an averaging (period 3): z holds that step too."""
    strategy = CrossbowStrategy(replicas_per_device=2, averaging_period=3, outer_lr=1.0)
    model, snapshot = Classifier(), ReplicaSnapshot()
    trainer(strategy=strategy, max_epochs=2, callbacks=[StopAtStep(4), snapshot]).fit(model, loader(make_data()))
    z, _, averaged = reference_local_sgd(2, 2, 3, "scaled", stop_after=4)
    assert averaged == [False, False, True, True]
    for (name, param), expected in zip(model.named_parameters(), z):
        torch.testing.assert_close(param.detach(), expected, msg=f"z differs in {name}")


class SaveAtStep(L.Callback):
    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("algorithm", ["scaled_averaging", "sma"])
def test_a_checkpoint_saved_between_two_averagings_resumes_the_same_trajectory(algorithm: str, tmp_path: Path) -> None:
    def run(ckpt_path: Optional[Path] = None, save_at: Optional[int] = None) -> tuple[nn.Module, ReplicaSnapshot]:
        model, snapshot = Classifier(optimizer="adam"), ReplicaSnapshot()
        callbacks: list[L.Callback] = [snapshot]
        if save_at is not None:
            callbacks.append(SaveAtStep(save_at, tmp_path / "mid.ckpt"))
        strategy = CrossbowStrategy(replicas_per_device=2, averaging_period=3, algorithm=algorithm)
        data = ResumableLoader(make_data(num_samples=96), batch_size=8)
        trainer(strategy=strategy, max_epochs=2, callbacks=callbacks).fit(model, data, ckpt_path=ckpt_path)
        return model, snapshot

    straight, straight_snapshot = run(save_at=7)  # 6 steps an epoch: step 7 is one step after the averaging at 6
    resumed, resumed_snapshot = run(ckpt_path=tmp_path / "mid.ckpt")
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    for name, stacked in straight_snapshot.params.items():
        assert torch.equal(stacked, resumed_snapshot.params[name])


class GrowAfterStep(L.Callback):
    """Asks for k=3 after the first step; records the learners then, and z and the learners in the next step."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 1:
            self.learners_then = [bucket.replicas.detach().clone() for bucket in trainer.strategy.stack.buckets]
            trainer.strategy.set_replicas_per_device(3)

    def on_before_backward(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 1:
            strategy = trainer.strategy
            self.steps_since = strategy.period.steps_since
            self.center_next = [bucket.center.detach().clone() for bucket in strategy.stack.buckets]
            self.learners_next = [bucket.replicas.detach().clone() for bucket in strategy.stack.buckets]


def test_a_change_of_k_between_two_averagings_first_averages_the_steps_taken_since() -> None:
    """k=2 -> 3 asked for after the first step of a period of 4: before the first step at k=3, z takes in that step
    (outer lr 1: z becomes the mean of the two learners), and all three learners start from it."""
    strategy = CrossbowStrategy(replicas_per_device=2, averaging_period=4, outer_lr=1.0)
    grow = GrowAfterStep()
    trainer(strategy=strategy, max_epochs=1, callbacks=[grow]).fit(Classifier(), loader(make_data(num_samples=160)))
    assert strategy.replicas_per_device == 3 and grow.steps_since == 0
    for learners, center, learners_next in zip(grow.learners_then, grow.center_next, grow.learners_next):
        torch.testing.assert_close(center, learners.mean(0))
        for row in learners_next:
            assert torch.equal(row, center)


@pytest.mark.parametrize("period", [0, -1, 2.0, "2", True])
def test_an_averaging_period_that_is_not_a_positive_int_is_refused(period: Any) -> None:
    with pytest.raises(ValueError, match="averaging_period must be a positive int"):
        CrossbowStrategy(averaging_period=period)


def test_the_period_counts_steps_and_learners_that_skipped_throughout() -> None:
    period = AveragingPeriod(3)
    assert not period.due(ends_an_epoch=False)
    assert period.take_step(torch.tensor([True, False, True])).tolist() == [True, False, True]
    assert period.due(ends_an_epoch=True)
    assert not period.due(ends_an_epoch=False)
    assert period.take_step(torch.tensor([True, True, False])).tolist() == [True, False, False]
    assert period.due(ends_an_epoch=False)  # the third step
    assert period.take_step(None) is None  # one took this step: none skipped throughout
    period.averaged()
    assert period.steps_since == 0 and period.skipped_throughout is None
    assert copy.copy(period).period == 3
