"""averaging_period=H: H local optimizer steps between two averagings (local SGD), against plain loops."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset

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


class CenterAtTrainEnd(L.Callback):
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.center = [p.detach().clone() for p in pl_module.parameters()]


def test_fit_stopped_between_two_averagings_averages_the_steps_taken_since() -> None:
    """A callback stops fit mid-epoch, one step after an averaging (period 3): z holds that step too, already when
    the callbacks' ``on_train_end`` (which Lightning runs before the strategy's) reads it."""
    strategy = CrossbowStrategy(replicas_per_device=2, averaging_period=3, outer_lr=1.0)
    model, snapshot, at_end = Classifier(), ReplicaSnapshot(), CenterAtTrainEnd()
    trainer(strategy=strategy, max_epochs=2, callbacks=[StopAtStep(4), snapshot, at_end]).fit(
        model, loader(make_data())
    )
    z, _, averaged = reference_local_sgd(2, 2, 3, "scaled", stop_after=4)
    assert averaged == [False, False, True, True]
    for (name, param), read, expected in zip(model.named_parameters(), at_end.center, z):
        torch.testing.assert_close(param.detach(), expected, msg=f"z differs in {name}")
        assert torch.equal(read, param.detach())


class SamplesInOrder(IterableDataset):
    """``make_data()``'s samples in order, as an iterable: its loader has no length."""

    def __iter__(self) -> Any:
        data = make_data()
        return iter(data[i] for i in range(len(data)))


def test_an_epoch_of_a_loader_without_a_length_ends_with_an_averaging() -> None:
    """10 batches, k=2: 5 steps an epoch; period 3 averages at steps 3 and 5 of each epoch, the 5th found to be the
    epoch's last only by the batch Lightning fetched ahead."""
    strategy = CrossbowStrategy(replicas_per_device=2, averaging_period=3, outer_lr=1.5)
    model = Classifier()
    trainer(strategy=strategy, max_epochs=2).fit(model, DataLoader(SamplesInOrder(), batch_size=8))
    z, _, averaged = reference_local_sgd(2, 2, 3, "scaled", outer_lr=1.5)
    assert averaged == [False, False, True, False, True] * 2
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
    assert not period.due(ends_an_epoch=lambda: False)
    assert period.take_step(torch.tensor([True, False, True])).tolist() == [True, False, True]
    assert period.due(ends_an_epoch=lambda: True)
    assert not period.due(ends_an_epoch=lambda: False)
    assert period.take_step(torch.tensor([True, True, False])).tolist() == [True, False, False]
    assert period.due(ends_an_epoch=lambda: False)  # the third step
    assert period.take_step(None) is None  # one took this step: none skipped throughout
    period.averaged()
    assert period.steps_since == 0 and period.skipped_throughout is None
    assert copy.copy(period).period == 3


class RunsOutOfMemoryAtStepWithThree(Classifier):
    """Raises CUDA's out-of-memory error (simulated on CPU) in the step after ``step`` while 3 replicas run; keeps the
    learners as they were then (in a list the step's attribute checks leave alone)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step, self.before = step, []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        strategy = self.trainer.strategy
        if self.trainer.global_step == self.step and strategy.stack.num_replicas == 3:
            self.before.extend(bucket.replicas.detach().clone() for bucket in strategy.stack.buckets)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return super().training_step(batch, batch_idx)


class CenterAtStep(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_backward(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and not hasattr(self, "center"):
            self.steps_since = trainer.strategy.period.steps_since
            self.center = [bucket.center.detach().clone() for bucket in trainer.strategy.stack.buckets]


def test_an_out_of_memory_back_off_between_two_averagings_first_averages_the_steps_taken_since() -> None:
    """k=3, period 6, out of memory in the third step: the learner that goes had two steps not in z. They are
    averaged first (outer lr 1: z is the three learners' mean), and the step runs again at k=2 from there."""
    model, probe = RunsOutOfMemoryAtStepWithThree(step=2), CenterAtStep(step=2)
    strategy = CrossbowStrategy(replicas_per_device=3, averaging_period=6, outer_lr=1.0)
    with pytest.warns(UserWarning, match="out of memory with replicas_per_device=3"):
        trainer(strategy=strategy, max_epochs=1, callbacks=[probe]).fit(model, loader(make_data(num_samples=160)))
    assert strategy.replicas_per_device == 2 and probe.steps_since == 0
    for learners, center in zip(model.before, probe.center):
        torch.testing.assert_close(center, learners.mean(0))


class GrowWhileAccumulating(L.Callback):
    """Asks for k=3 after the first optimizer step; records the count of steps since the last averaging after the
    second."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        strategy = trainer.strategy
        if trainer.global_step == 1 and strategy.replicas_per_device == 2 and not strategy.accumulating:
            strategy.set_replicas_per_device(3)
        if trainer.global_step == 2 and not hasattr(self, "steps_since"):
            self.steps_since = strategy.period.steps_since


def test_a_k_that_changes_within_an_accumulation_window_averages_at_the_windows_end() -> None:
    """A loader without a length: Lightning fetched the next batch, of the old k, ahead, so the first group of k=3
    comes within an accumulation window. The learners cannot restart from z there; the step's end averages, and all
    three learners start the next step from z."""
    strategy = CrossbowStrategy(replicas_per_device=2, averaging_period=4, outer_lr=2.0)
    grow = GrowWhileAccumulating()
    data = DataLoader(SamplesInOrder(), batch_size=8)
    trainer(strategy=strategy, max_steps=3, accumulate_grad_batches=2, callbacks=[grow]).fit(Classifier(), data)
    assert strategy.replicas_per_device == 3
    assert grow.steps_since == 0


class HalvesTheLrEveryTwoSteps(Classifier):
    def configure_optimizers(self) -> Any:
        optimizer = make_optimizer("sgd", self.parameters(), 0.1)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class LearnersAtZ(L.Callback):
    """Per optimizer step, whether every learner starts it at z (read in its backward, before the step)."""

    def __init__(self) -> None:
        self.at_z: list[bool] = []

    def on_before_backward(self, trainer: L.Trainer, *args: Any) -> None:
        buckets = trainer.strategy.stack.buckets
        self.at_z.append(all(bool((bucket.replicas == bucket.center).all()) for bucket in buckets))


def test_a_drop_of_the_lr_between_two_averagings_resets_the_learners_after_the_next() -> None:
    """SMA (learners kept apart), period 3, the lr halved after steps 2 and 4: the first drop is seen as step 3
    starts, with two steps not yet in z, so the learners restart from z only after step 3's averaging, at step 4; the
    second drop is seen as step 5 starts, one step after an averaging, and waits for the epoch's end."""
    strategy = CrossbowStrategy(replicas_per_device=2, algorithm="sma", averaging_period=3)
    at_z = LearnersAtZ()
    trainer(strategy=strategy, max_epochs=1, callbacks=[at_z]).fit(HalvesTheLrEveryTwoSteps(), loader(make_data()))
    assert at_z.at_z == [True, False, False, True, False]


def test_a_reset_waiting_for_the_next_averaging_survives_a_resume(tmp_path: Path) -> None:
    """As above; a checkpoint saved after step 3 (its averaging done, the reset due as step 4 starts) resumes with
    the reset still due: the same learners and z as the run that went on."""

    def run(ckpt_path: Optional[Path] = None, save_at: Optional[int] = None) -> tuple[nn.Module, LearnersAtZ]:
        model, at_z = HalvesTheLrEveryTwoSteps(), LearnersAtZ()
        callbacks: list[L.Callback] = [at_z] + ([SaveAtStep(save_at, tmp_path / "mid.ckpt")] if save_at else [])
        strategy = CrossbowStrategy(replicas_per_device=2, algorithm="sma", averaging_period=3)
        data = ResumableLoader(make_data(), batch_size=8)
        trainer(strategy=strategy, max_epochs=1, callbacks=callbacks).fit(model, data, ckpt_path=ckpt_path)
        return model, at_z

    straight, straight_at_z = run(save_at=3)
    resumed, resumed_at_z = run(ckpt_path=tmp_path / "mid.ckpt")
    assert straight_at_z.at_z[3:] == resumed_at_z.at_z == [True, False]
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


class GrowToFiveAfterStep3(L.Callback):
    """k=2 -> 5 after step 3 of 5: too few batches are left for a step of 5, so step 3 becomes the epoch's last;
    records the steps not yet averaged when the epoch's validation starts."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 3:
            trainer.strategy.set_replicas_per_device(5)

    def on_validation_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.pending_at_validation = trainer.strategy.period.steps_since


def test_a_change_of_k_that_ends_the_epoch_is_averaged_before_the_epochs_validation() -> None:
    strategy = CrossbowStrategy(replicas_per_device=2, averaging_period=4)
    grow = GrowToFiveAfterStep3()
    t = trainer(strategy=strategy, max_epochs=1, callbacks=[grow])
    t.fit(Classifier(), loader(make_data()), loader(make_data(num_samples=16)))
    assert t.global_step == 3 and grow.pending_at_validation == 0


class StopAtStepOne(L.Callback):
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 1:
            trainer.should_stop = True


class PendingAtValidation(L.Callback):
    def __init__(self) -> None:
        self.pending: list[int] = []

    def on_validation_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.pending.append(trainer.strategy.period.steps_since)


def test_a_stop_that_waits_for_min_epochs_does_not_make_validations_average() -> None:
    """should_stop set at step 1 while min_epochs=2 holds fit on: Lightning validates every 2 steps as planned, and
    those validations read z between averagings (period 4, 5 steps an epoch), as without the stop."""
    pending = PendingAtValidation()
    strategy = CrossbowStrategy(replicas_per_device=2, averaging_period=4)
    callbacks = [StopAtStepOne(), pending]
    t = trainer(strategy=strategy, min_epochs=2, max_epochs=2, val_check_interval=2, callbacks=callbacks)
    t.fit(Classifier(), loader(make_data()), loader(make_data(num_samples=16)))
    assert t.global_step == 10
    assert pending.pending == [2, 0, 2, 0]  # after steps 2, 4 (its averaging), 7 and 9 (averaging at 9)


class AveragingSteps(L.Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.strategy.period.steps_since == 0:
            self.steps.append(trainer.global_step)


def test_the_tuners_windows_hold_whole_averaging_periods() -> None:
    """Steps that average take longer: with averaging_period=4 every window starts right after an averaging and ends
    at one, so windows compare like with like."""
    from lightning_crossbow import ReplicaAutoTuner

    tuner, averaging = ReplicaAutoTuner(window=5, warmup=1, plot=False), AveragingSteps()
    strategy = CrossbowStrategy(replicas_per_device=1, averaging_period=4)
    trainer(strategy=strategy, max_epochs=2, callbacks=[tuner, averaging]).fit(
        Classifier(), loader(make_data(num_samples=480))
    )
    ends = [record.step for record in tuner.history]
    assert len(ends) >= 3 and set(ends) <= set(averaging.steps)
    assert all(later - earlier >= 5 for earlier, later in zip(ends, ends[1:]))


@pytest.mark.parametrize("log_every_n_steps", [1, 50])
def test_on_one_process_gossips_z_is_the_learners_mean_after_every_step_between_averagings(
    log_every_n_steps: int,
) -> None:
    """Gossip keeps no z while training; on one process it forms z, the learners' mean, after every step, also
    between averagings (averaging_period=3), whatever the logging: before, a callback saw the mean at logging steps
    only (which form it for the logged spread), and the last averaging's z otherwise."""
    seen: list[tuple[Tensor, Tensor]] = []

    class ReadsZ(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
            stack = trainer.strategy.stack
            seen.append((pl_module.net[0].weight.detach().clone(), stack.params["net.0.weight"].detach().mean(0)))

    strategy = CrossbowStrategy(replicas_per_device=3, algorithm="gossip", averaging_period=3)
    fit = trainer(strategy=strategy, callbacks=[ReadsZ()], log_every_n_steps=log_every_n_steps, max_steps=5)
    fit.fit(Classifier(), loader(make_data(num_samples=8 * 15)))
    assert len(seen) == 5
    for z, mean in seen:
        torch.testing.assert_close(z, mean)


class _HalvesTheFirstLayerAfterStep(L.Callback):
    """Halves the first layer's weights (z) after optimizer step ``step`` (a shrink-and-perturb, a re-initialisation
    between two averagings)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.net[0].weight.mul_(0.5)


def test_a_change_a_callback_makes_to_z_between_two_averagings_moves_every_learner() -> None:
    """Scaled averaging, k=1, H=2, plain SGD: after step 1 (no averaging) a callback halves z's first layer, by
    ``delta = z' - z``; the learner, still at its own weights, moves by ``delta`` and steps from there, and the
    averaging at step 2 sets z to it. (The averaging measured ``d = w - z'`` from the halved z, so the halving was
    undone: by the outer learning rate 1 here, reversed and amplified at 4.)"""
    data = make_data(num_samples=16)
    model = Classifier(optimizer="plain_sgd", lr=0.01)
    net = copy.deepcopy(model.net)
    strategy = CrossbowStrategy(replicas_per_device=1, averaging_period=2)
    trainer(strategy=strategy, max_steps=2, callbacks=[_HalvesTheFirstLayerAfterStep(1)]).fit(model, loader(data))
    batches = list(loader(data))
    z_before = net[0].weight.detach().clone()
    for index, (x, y) in enumerate(batches):  # the learner's two steps, the shift between them
        net.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        with torch.no_grad():
            for param in net.parameters():
                param -= 0.01 * param.grad
            if index == 0:
                net[0].weight += 0.5 * z_before - z_before  # (z, where the learner started, halved)
    for (name, param), expected in zip(model.net.named_parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(param, expected, msg=name)


class _ShiftsTheBias(L.Callback):
    """Adds ``shift`` to z's bias of the last layer after optimizer step ``step``; stops fit there if ``stop``."""

    def __init__(self, shift: float, step: int, stop: bool = False) -> None:
        self.shift, self.step, self.stop = shift, step, stop

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.net[2].bias.add_(self.shift)
            trainer.should_stop = trainer.should_stop or self.stop


def test_a_change_to_z_before_fit_stops_between_two_averagings_is_kept_by_the_averaging_of_the_steps_pending() -> None:
    """k=2, H=4: the bias moved by 1 after step 3, where a callback stops fit; the steps pending are averaged with
    every learner moved by it, so z ends 1 apart from the run without the change (it kept -0.007 of it)."""
    ends = []
    for shift in (0.0, 1.0):
        model = Classifier()
        strategy = CrossbowStrategy(replicas_per_device=2, averaging_period=4)
        trainer(strategy=strategy, callbacks=[_ShiftsTheBias(shift, 3, stop=True)]).fit(model, loader(make_data(64)))
        ends.append(model.net[2].bias.detach().clone())
    torch.testing.assert_close(ends[1] - ends[0], torch.ones(3))


def test_a_checkpoint_saved_after_a_change_to_z_between_two_averagings_resumes_the_same_trajectory(
    tmp_path: Path,
) -> None:
    """k=2, H=4: the bias moved by 1 after step 2, where a checkpoint is saved; the resume ends bitwise as the run that
    went on (the learners saved had not taken the change, which the resume's next averaging undid)."""

    def run(ckpt_path: Optional[Path] = None) -> nn.Module:
        model = Classifier(optimizer="plain_sgd")
        callbacks: list[L.Callback] = [_ShiftsTheBias(1.0, 2)]
        if ckpt_path is None:
            callbacks.append(SaveAtStep(2, tmp_path / "shifted.ckpt"))
        strategy = CrossbowStrategy(replicas_per_device=2, averaging_period=4)
        data = ResumableLoader(make_data(num_samples=64), batch_size=4)
        trainer(strategy=strategy, max_steps=4, callbacks=callbacks).fit(model, data, ckpt_path=ckpt_path)
        return model

    went_on, resumed = run(), run(ckpt_path=tmp_path / "shifted.ckpt")
    for a, b in zip(went_on.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
