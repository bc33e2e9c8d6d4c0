"""Changing k during fit: the stacks grow or shrink and SMA stays exact against an independent reference."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_crossbow import CrossbowStrategy
from tests.helpers import (
    BatchesSeen,
    Classifier,
    ReplicaSnapshot,
    ResumableLoader,
    loader,
    make_data,
    make_net,
    reference_sma_step,
    trainer,
)


class ChangeReplicas(L.Callback):
    """Asks for ``new_k`` once ``global_step`` reaches ``at_step``; records the group size of every step."""

    def __init__(self, at_step: int, new_k: int) -> None:
        self.at_step, self.new_k = at_step, new_k
        self.group_sizes: list[int] = []

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.group_sizes.append(len(batch))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at_step:
            trainer.strategy.set_replicas_per_device(self.new_k)


def reference_with_changing_k(
    net: nn.Module,
    batches: Sequence[tuple[Tensor, Tensor]],
    ks_per_epoch: Sequence[Sequence[int]],
    lr: float,
    mu: float,
) -> tuple[list[Tensor], list[list[Tensor]]]:
    """SMA with alpha = 1/k over a schedule of k per step; a new learner is a copy of z whose momentum
    is the mean of the learners' momenta; a shrink drops the last learners."""
    z = [p.detach().clone() for p in net.parameters()]
    z_prev = [t.clone() for t in z]
    learners: list[nn.Module] = []
    optimizers: list[torch.optim.SGD] = []
    for ks in ks_per_epoch:
        position = 0
        for k in ks:
            if k > len(learners):
                momenta = [
                    [opt.state[p]["momentum_buffer"] for p in m.parameters()] for m, opt in zip(learners, optimizers)
                ]
                for _ in range(k - len(learners)):
                    learner = copy.deepcopy(net)
                    with torch.no_grad():
                        for p, zc in zip(learner.parameters(), z):
                            p.copy_(zc)
                    optimizer = torch.optim.SGD(learner.parameters(), lr=lr, momentum=0.9)
                    if momenta:
                        for i, p in enumerate(learner.parameters()):
                            optimizer.state[p]["momentum_buffer"] = torch.stack([m[i] for m in momenta]).mean(0)
                    learners.append(learner)
                    optimizers.append(optimizer)
            del learners[k:], optimizers[k:]
            z, z_prev = reference_sma_step(
                learners, optimizers, batches[position : position + k], z, z_prev, 1.0 / k, mu
            )
            position += k
    return z, [[p.detach() for p in m.parameters()] for m in learners]


@pytest.mark.parametrize(("old_k", "new_k"), [(2, 4), (4, 2), (2, 1)])
@pytest.mark.parametrize("engine", ["fused", "sequential"])
def test_changing_k_mid_epoch_keeps_sma_exact(old_k: int, new_k: int, engine: str) -> None:
    dataset = make_data(num_samples=96)  # 12 batches of 8 per epoch
    model = Classifier()
    change, snapshot = ChangeReplicas(at_step=1, new_k=new_k), ReplicaSnapshot()
    strategy = CrossbowStrategy(algorithm="sma", replicas_per_device=old_k, engine=engine)
    trainer(strategy=strategy, max_epochs=2, callbacks=[change, snapshot]).fit(model, loader(dataset))

    # The loader has a length, so Lightning prefetches nothing: the step after the change has the new k.
    first_epoch = [old_k] + [new_k] * ((12 - old_k) // new_k)
    assert change.group_sizes == first_epoch + [new_k] * (12 // new_k)
    assert model.trainer.global_step == len(change.group_sizes)
    assert strategy.replicas_per_device == new_k and strategy.alpha == 1.0 / new_k

    z, learners = reference_with_changing_k(
        make_net(), list(loader(dataset)), [first_epoch, [new_k] * (12 // new_k)], lr=0.1, mu=0.9
    )
    for (name, param), expected in zip(model.net.named_parameters(), z, strict=True):
        torch.testing.assert_close(param.detach(), expected, msg=f"z differs in {name}")
    for index, (name, stacked) in enumerate(snapshot.params.items()):
        assert stacked.shape[0] == new_k
        for j in range(new_k):
            torch.testing.assert_close(stacked[j], learners[j][index], msg=f"replica {j} differs in {name}")


class ChangeReplicasAtBatch(ChangeReplicas):
    """Asks for ``new_k`` at the end of batch ``at_step`` (of the first epoch)."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if batch_idx == self.at_step and trainer.current_epoch == 0:
            trainer.strategy.set_replicas_per_device(self.new_k)


def test_a_smaller_k_at_the_epochs_last_step_trains_the_batches_left_over_in_that_epoch() -> None:
    """14 batches at k=4 make 3 groups and leave 2 over; k=2 asked for after the third group makes them one
    more group of that epoch (Lightning had marked the third group the last)."""
    change = ChangeReplicasAtBatch(at_step=2, new_k=2)
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=4), callbacks=[change], max_epochs=2)
    fit.fit(Classifier(), loader(make_data(num_samples=8 * 14)))
    assert change.group_sizes == [4, 4, 4, 2] + [2] * 7
    assert fit.global_step == 4 + 7


class _EpochCounts(L.Callback):
    """Per epoch: [Lightning's count of its steps at its start (what a progress bar shows), its steps]."""

    def __init__(self) -> None:
        self.counts: list[list[Optional[int]]] = []

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.counts.append([trainer.num_training_batches, 0])

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if not self.counts:  # (an epoch resumed in its middle: Lightning does not start it again)
            self.counts.append([None, 0])
        self.counts[-1][1] += 1


@pytest.mark.parametrize("limit", [1.0, 0.5, 5])
def test_an_epoch_after_a_change_of_k_is_counted_before_the_callbacks_see_it(limit: float) -> None:
    """k 4 -> 2 after epoch 0's first step (14 batches: 1 step at 4, then 5 at 2): epoch 1 and later, at k=2, have 7
    steps (3 under limit_train_batches=0.5, 5 under 5), and the callbacks read that count at their start, not epoch
    0's (before: 6 in epoch 1, on a progress bar too; 2 under 0.5)."""
    change, counts = ChangeReplicasAtBatch(at_step=0, new_k=2), _EpochCounts()
    fit = trainer(
        strategy=CrossbowStrategy(replicas_per_device=4),
        callbacks=[change, counts],
        max_epochs=3,
        limit_train_batches=limit,
    )
    fit.fit(Classifier(), loader(make_data(num_samples=8 * 14)))
    steps = {1.0: 7, 0.5: 3, 5: 5}[limit]
    assert counts.counts[1:] == [[steps, steps], [steps, steps]]


def test_the_epoch_after_a_resume_in_an_epochs_middle_is_counted_at_its_start(tmp_path: Path) -> None:
    """Saved after step 1 at k=4 (14 batches an epoch) and resumed at k=2: the resumed epoch trains its rest, and the
    next one, 7 steps at k=2, shows 7 at its start (before: 6, the resumed epoch's count)."""

    class SaveAtStep1(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step == 1:
                trainer.save_checkpoint(tmp_path / "step1.ckpt")

    dataset = make_data(num_samples=8 * 14)
    trainer(strategy=CrossbowStrategy(replicas_per_device=4), callbacks=[SaveAtStep1()]).fit(
        Classifier(), loader(dataset)
    )
    counts = _EpochCounts()
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=2), callbacks=[counts], max_epochs=3)
    fit.fit(Classifier(), loader(dataset), ckpt_path=tmp_path / "step1.ckpt")
    assert counts.counts[1:] == [[7, 7], [7, 7]]


class _Streamed(torch.utils.data.IterableDataset):
    def __init__(self, num_samples: int) -> None:
        self.data = make_data(num_samples=num_samples)

    def __iter__(self) -> Any:
        return iter(self.data)


def test_a_new_k_with_a_loader_without_a_length_and_an_integer_limit_goes_on() -> None:
    """limit_train_batches=10 steps an epoch over a loader without a length (a stream): a change of k raised
    "the wrapped loader has no length" where the epoch's count of steps follows k; that count, the limit, does not
    depend on k."""
    change, counts = ChangeReplicasAtBatch(at_step=1, new_k=3), _EpochCounts()
    fit = trainer(
        strategy=CrossbowStrategy(replicas_per_device=2),
        callbacks=[change, counts],
        max_epochs=2,
        limit_train_batches=10,
    )
    fit.fit(Classifier(), torch.utils.data.DataLoader(_Streamed(8 * 80), batch_size=8))
    assert change.group_sizes == [2, 2] + [3] * 8 + [3] * 10
    assert counts.counts == [[10, 10], [10, 10]]


class _CountsItems(torch.utils.data.Dataset):
    def __init__(self, num_samples: int) -> None:
        self.data, self.fetched = make_data(num_samples=num_samples), 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Any:
        self.fetched += 1
        return self.data[index]


def test_batches_that_a_larger_k_leaves_over_at_a_pass_end_are_drawn_as_plain_lightning_draws_them() -> None:
    """10 batches at k=2; k=3 asked for after the fourth group leaves 2 batches that fill no group: drawn all the
    same (when the next pass starts), so both epochs fetch every item, as plain Lightning does."""
    fetched = []
    for strategy, callbacks in (("auto", []), (CrossbowStrategy(replicas_per_device=2), [ChangeReplicasAtBatch(3, 3)])):
        dataset = _CountsItems(num_samples=80)
        trainer(strategy=strategy, callbacks=callbacks, max_epochs=2).fit(Classifier(), loader(dataset))
        fetched.append(dataset.fetched)
    assert callbacks[0].group_sizes == [2, 2, 2, 2, 3, 3, 3]
    assert fetched[1] == fetched[0] == 160


class _RecordsValidation(L.Callback):
    def __init__(self) -> None:
        self.runs: list[tuple[int, int]] = []  # (epoch, global step) of each validation

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.runs.append((trainer.current_epoch, trainer.global_step))


@pytest.mark.parametrize(
    ("k", "new_k", "at", "sizes", "validated_at"),
    [
        (2, 3, 3, [2, 2, 2, 2, 3, 3, 3], [(0, 4), (1, 7)]),  # (2 batches left: no step of 3)
        (4, 2, 1, [4, 4, 2, 2, 2, 2, 2, 2], [(0, 3), (1, 8)]),  # (2 batches left: one step of 2)
    ],
    ids=["a larger k ends the epoch at the step in progress", "a smaller k makes one more step"],
)
def test_a_change_of_k_at_an_epochs_end_validates_once_at_its_last_step(k, new_k, at, sizes, validated_at) -> None:
    """10 batches: the step in progress was told at the old k whether it ends the epoch (and validates); the new k
    changes that, and it is told again: one validation per epoch, after its last step."""
    change, validations = ChangeReplicasAtBatch(at, new_k), _RecordsValidation()
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=k), callbacks=[change, validations], max_epochs=2)
    fit.fit(Classifier(), loader(make_data(num_samples=80)), loader(make_data(num_samples=16, seed=1)))
    assert change.group_sizes == sizes
    assert validations.runs == validated_at  # (epoch, global step)


@pytest.mark.parametrize(
    ("interval", "k", "changes", "validated_at"),
    [
        # A check every 5 of 10 batches: after step 3 of k=2 (6 batches) and the epoch's last step; each counts once,
        # also when k then changes (a larger k after the last step, or one whose step 4 of 3 batches ends the epoch).
        (0.5, 2, {}, [(0, 3), (0, 5)]),
        (0.5, 2, {4: 3}, [(0, 3), (0, 5)]),
        (0.5, 2, {2: 3}, [(0, 3), (0, 4)]),
        # A check every 2 of 10 batches, 5 an epoch: a step of 3 batches that reaches two of them validates once for
        # both, and the epoch's last step (batch 10 fills no step) does the fifth.
        (0.25, 3, {1: 1, 4: 4}, [(0, 1), (0, 2), (0, 4), (0, 5)]),
    ],
)
def test_a_fractional_validation_interval_counts_each_check_once_when_k_changes(interval, k, changes, validated_at):
    class ChangesAt(ChangeReplicas):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.current_epoch == 0 and trainer.fit_loop.epoch_loop.batch_idx in changes:
                trainer.strategy.set_replicas_per_device(changes[trainer.fit_loop.epoch_loop.batch_idx])

    validations = _RecordsValidation()
    strategy = CrossbowStrategy(replicas_per_device=k)
    fit = trainer(
        strategy=strategy, callbacks=[ChangesAt(-1, 0), validations], max_epochs=1, val_check_interval=interval
    )
    fit.fit(Classifier(), loader(make_data(num_samples=80)), loader(make_data(num_samples=16, seed=1)))
    assert validations.runs == validated_at  # (epoch, global step)


@pytest.mark.parametrize(
    ("batches", "interval", "k", "validated_after_batches"),
    [
        (10, 0.3, 2, [4, 6, 10]),  # plain Lightning: after 3, 6 and 9 (Lightning's count of 5 steps: every step)
        (12, 0.25, 2, [4, 6, 10, 12]),  # after 3, 6, 9, 12 (every step by Lightning's count of 6 steps)
        (12, 0.5, 3, [6, 12]),  # after 6 and 12: whole steps, as by Lightning's count
    ],
)
def test_a_fractional_validation_interval_at_a_fixed_k_validates_as_often_as_plain_lightning(
    batches: int, interval: float, k: int, validated_after_batches: list[int]
) -> None:
    validations = _RecordsValidation()
    fit = trainer(
        strategy=CrossbowStrategy(replicas_per_device=k), callbacks=[validations], val_check_interval=interval
    )
    fit.fit(Classifier(), loader(make_data(num_samples=8 * batches)), loader(make_data(num_samples=16, seed=1)))
    assert [k * step for _, step in validations.runs] == validated_after_batches


def test_a_mid_epoch_resume_goes_on_with_the_fractional_validation_checks_left(tmp_path: Path) -> None:
    """10 batches at k=2, val_check_interval=0.3: validations after steps 2, 3 and 5. A checkpoint saved at a step's
    end (before that step's validation) resumes at the next step, skipping that step's check as plain Lightning
    does, and does the checks left where the uninterrupted fit does them, not one more."""

    def fit(**kwargs: Any) -> list[int]:
        validations = _RecordsValidation()
        fit = trainer(
            strategy=CrossbowStrategy(replicas_per_device=2),
            val_check_interval=0.3,
            callbacks=[validations, *kwargs.pop("callbacks", [])],
            enable_checkpointing=True,
            default_root_dir=tmp_path,
        )
        data = ResumableLoader(make_data(num_samples=80), batch_size=8)
        fit.fit(Classifier(), data, loader(make_data(num_samples=16, seed=1)), **kwargs)
        return [step for _, step in validations.runs]

    every_step = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=1, filename="{step}")
    assert fit(callbacks=[every_step]) == [2, 3, 5]
    for step, left in ((1, [2, 3, 5]), (2, [3, 5]), (3, [5]), (4, [5])):
        assert fit(ckpt_path=tmp_path / f"step={step}.ckpt") == left, step


class _RaisesAtStep(Classifier):
    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if self.trainer.global_step == self.at:
            raise RuntimeError("a step that fails")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("at", [0, 3, 7])
def test_at_one_replica_a_resume_from_an_exception_validates_as_plain_lightning(tmp_path: Path, at: int) -> None:
    """val_check_interval=0.5 over 10 batches, a loader that saves its place, an exception checkpoint at step ``at``:
    at k=1 the resumed fit validates where plain Lightning's does (Lightning's own count of steps)."""
    validated = {}
    for name in ("plain", "crossbow"):
        path = tmp_path / name

        def fit(model: Classifier, **kwargs: Any) -> list[tuple[int, int]]:
            validations = _RecordsValidation()
            fit = trainer(
                strategy="auto" if name == "plain" else CrossbowStrategy(replicas_per_device=1),
                max_epochs=2,
                val_check_interval=0.5,
                callbacks=[validations, OnExceptionCheckpoint(dirpath=path, filename="exception")],
                enable_checkpointing=True,
                default_root_dir=path,
            )
            data = ResumableLoader(make_data(num_samples=80), batch_size=8)
            fit.fit(model, data, loader(make_data(num_samples=16, seed=1)), **kwargs)
            return validations.runs

        with pytest.raises(RuntimeError, match="a step that fails"):
            fit(_RaisesAtStep(at))
        validated[name] = fit(_RaisesAtStep(-1), ckpt_path=path / "exception.ckpt")
    assert validated["crossbow"] == validated["plain"]


class _RaisesAfterStep(L.Callback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            raise RuntimeError("stopped after a step")


def test_a_checkpoint_saved_after_a_fit_that_raised_resumes_the_same_trajectory(tmp_path: Path) -> None:
    """No OnExceptionCheckpoint: the user catches the error and calls trainer.save_checkpoint. The checkpoint holds
    the replicas and their optimizer state, as one saved after a fit that ended, and the resumed fit trains as the
    uninterrupted one, bitwise (a loader that saves its place; Adam, whose moments are per replica)."""

    def fit(callbacks: list[L.Callback], **kwargs: Any) -> L.Trainer:
        run = trainer(strategy=CrossbowStrategy(replicas_per_device=3), max_epochs=2, callbacks=callbacks)
        run.fit(Classifier(optimizer="adam"), ResumableLoader(make_data(num_samples=96), batch_size=8), **kwargs)
        return run

    uninterrupted = fit([])
    with pytest.raises(RuntimeError, match="stopped after a step"):
        interrupted = trainer(
            strategy=CrossbowStrategy(replicas_per_device=3), max_epochs=2, callbacks=[_RaisesAfterStep(6)]
        )
        interrupted.fit(Classifier(optimizer="adam"), ResumableLoader(make_data(num_samples=96), batch_size=8))
    interrupted.save_checkpoint(tmp_path / "after_the_error.ckpt")
    assert "crossbow" in torch.load(tmp_path / "after_the_error.ckpt", weights_only=False)
    resumed = fit([], ckpt_path=tmp_path / "after_the_error.ckpt")
    for p, q in zip(uninterrupted.lightning_module.parameters(), resumed.lightning_module.parameters()):
        assert torch.equal(p, q)


class _NoOptimizerYet(Classifier):
    def configure_optimizers(self) -> Any:
        raise RuntimeError("no optimizer yet")


def test_a_checkpoint_saved_before_the_optimizer_was_made_resumes_as_a_fresh_fit(tmp_path: Path) -> None:
    """A fit that failed in configure_optimizers, saved by the user: no optimizer state, no crossbow state. Resumed,
    it trains as a fresh fit does, as plain Lightning's."""
    failed = trainer(strategy=CrossbowStrategy(replicas_per_device=3), max_epochs=1)
    with pytest.raises(RuntimeError, match="no optimizer yet"):
        failed.fit(_NoOptimizerYet(), loader(make_data(num_samples=96)))
    failed.save_checkpoint(tmp_path / "no_optimizer.ckpt")
    runs = []
    for ckpt_path in (None, tmp_path / "no_optimizer.ckpt"):
        runs.append(trainer(strategy=CrossbowStrategy(replicas_per_device=3), max_epochs=1))
        runs[-1].fit(Classifier(), loader(make_data(num_samples=96)), ckpt_path=ckpt_path)
    for p, q in zip(runs[0].lightning_module.parameters(), runs[1].lightning_module.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(("resumed_k", "carries_on"), [(3, True), (4, False)])
def test_a_k_changed_by_hand_carries_on_in_a_resume_made_alike(
    tmp_path: Path, resumed_k: int, carries_on: bool
) -> None:
    """k=3 changed to 2 at batch 2 by a callback; a checkpoint at step 4. Resumed with the strategy made as before
    (replicas_per_device=3), the fit goes on at k=2, bitwise as the run that went on; made with another k, it
    re-seeds the replicas at that k, with a warning."""

    def fit(k: int, saves: list[ModelCheckpoint], ckpt_path: Any = None) -> tuple[L.Trainer, ChangeReplicasAtBatch]:
        change = ChangeReplicasAtBatch(at_step=2, new_k=2)
        run = trainer(
            strategy=CrossbowStrategy(replicas_per_device=k),
            max_epochs=1,
            callbacks=[change, *saves],
            enable_checkpointing=bool(saves),
        )
        run.fit(
            Classifier(optimizer="adam"), ResumableLoader(make_data(num_samples=192), batch_size=8), ckpt_path=ckpt_path
        )
        return run, change

    saves = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=4, save_top_k=-1)
    uninterrupted, _ = fit(3, [saves])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed, change = fit(resumed_k, [], ckpt_path=tmp_path / "step=4.ckpt")
    reseeded = [w for w in caught if "the replicas were re-seeded" in str(w.message)]
    assert change.group_sizes and set(change.group_sizes) == ({2} if carries_on else {resumed_k})
    assert bool(reseeded) is not carries_on
    same = [
        torch.equal(p, q)
        for p, q in zip(uninterrupted.lightning_module.parameters(), resumed.lightning_module.parameters())
    ]
    assert all(same) is carries_on


def test_changing_k_between_two_accumulated_batches_is_refused() -> None:
    change = ChangeReplicasAtBatch(at_step=2, new_k=4)  # batch 2 opens an accumulation window of 2
    fit = trainer(
        strategy=CrossbowStrategy(algorithm="sma", replicas_per_device=2), accumulate_grad_batches=2, callbacks=[change]
    )
    with pytest.raises(RuntimeError, match="cannot change replicas_per_device while gradients are being accumulated"):
        fit.fit(Classifier(), loader(make_data(num_samples=96)))


def test_k_changes_with_accumulated_gradients_right_after_an_optimizer_step() -> None:
    change = ChangeReplicasAtBatch(at_step=1, new_k=4)  # batch 1 closes a window: the optimizer has stepped
    fit = trainer(
        strategy=CrossbowStrategy(algorithm="sma", replicas_per_device=2),
        accumulate_grad_batches=2,
        callbacks=[change],
        max_epochs=1,
    )
    fit.fit(Classifier(), loader(make_data(num_samples=96)))  # 12 batches: 2 groups of 2, then 2 groups of 4
    assert change.group_sizes == [2, 2, 4, 4]
    assert fit.global_step == 2


class _SkipsTheStepOfBatch1(Classifier):
    """Its ``optimizer_step`` runs the closure alone at batch 1, skipping the step, as Lightning's docs show."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any) -> None:
        if batch_idx == 1:
            optimizer_closure()
        else:
            optimizer.step(closure=optimizer_closure)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_k_changes_right_after_a_step_that_the_module_skipped(accumulate: int) -> None:
    """Batch 1 ends a step (also a window of 2), whose optimizer step the module skips: no gradients are left to
    accumulate on (Lightning zeroes them before the next batch), so k may change there."""
    change = ChangeReplicasAtBatch(at_step=1, new_k=3)
    fit = trainer(
        strategy=CrossbowStrategy(replicas_per_device=2), accumulate_grad_batches=accumulate, callbacks=[change]
    )
    fit.fit(_SkipsTheStepOfBatch1(), loader(make_data(num_samples=80)))  # 10 batches: 2 groups of 2, 2 of 3
    assert change.group_sizes == [2, 2, 3, 3]


@pytest.mark.parametrize("bad", [0, -1, 2.5, "4"])
def test_set_replicas_per_device_rejects_bad_values(bad: Any) -> None:
    with pytest.raises(ValueError, match="replicas_per_device must be a positive int"):
        CrossbowStrategy(algorithm="sma", replicas_per_device=2).set_replicas_per_device(bad)


@pytest.mark.parametrize("heterogeneous", [False, True])
def test_a_new_k_whose_step_takes_more_batches_than_an_epoch_has_is_refused_during_fit(heterogeneous: bool) -> None:
    """10 batches an epoch; set_replicas_per_device(11) after step 1 would leave every later epoch without a step (it
    trained nothing more, with a warning): refused, naming the most that fits; 10 is accepted."""
    change = ChangeReplicasAtBatch(at_step=1, new_k=11)
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=2, heterogeneous=heterogeneous), callbacks=[change])
    message = r"set_replicas_per_device\(11\) during fit: an epoch has 10 training batches, fewer than the 11 that"
    with pytest.raises(ValueError, match=message + ".*Use at most replicas_per_device=10"):
        fit.fit(Classifier(), loader(make_data(num_samples=80)))
    assert fit.global_step == 2
    change = ChangeReplicasAtBatch(at_step=1, new_k=10)
    fit = trainer(
        strategy=CrossbowStrategy(replicas_per_device=2, heterogeneous=heterogeneous), callbacks=[change], max_epochs=2
    )
    fit.fit(Classifier(), loader(make_data(num_samples=80)))
    assert change.group_sizes[-1] == 10  # (epoch 1's one step)


class RunsOutOfMemoryAbove(Classifier):
    """Raises CUDA's out-of-memory error whenever more than ``fits`` replicas run at once (simulated on CPU)."""

    def __init__(self, fits: int) -> None:
        super().__init__()
        self.fits = fits

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if self.trainer.strategy.stack.num_replicas > self.fits:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("engine", ["fused", "sequential", "auto"])
def test_out_of_memory_backs_off_and_retries_the_step_losing_no_batch(engine: str) -> None:
    """From k=4 on a device where 2 fit: two back-offs in the first step, then exactly a k=2 run from the start."""
    dataset = make_data(num_samples=96)
    model, change, snapshot = RunsOutOfMemoryAbove(fits=2), ChangeReplicas(at_step=-1, new_k=0), ReplicaSnapshot()
    strategy = CrossbowStrategy(algorithm="sma", replicas_per_device=4, engine=engine)
    with pytest.warns(UserWarning, match="out of memory with replicas_per_device=4") as caught:
        trainer(strategy=strategy, max_epochs=2, callbacks=[change, snapshot]).fit(model, loader(dataset))
    assert sum("out of memory" in str(w.message) for w in caught) == 2  # 4 -> 3 -> 2, then it fits
    assert strategy.replicas_per_device == strategy.replica_ceiling == 2
    assert not any("cannot run fused" in str(w.message) for w in caught)  # out of memory is not a failure to fuse
    assert change.group_sizes == [4] + [2] * 5 + [2] * 6  # the first group ran as 2; its other 2 batches ran next

    z, learners = reference_with_changing_k(make_net(), list(loader(dataset)), [[2] * 6, [2] * 6], lr=0.1, mu=0.9)
    for (name, param), expected in zip(model.net.named_parameters(), z, strict=True):
        torch.testing.assert_close(param.detach(), expected, msg=f"z differs in {name}")
    for index, stacked in enumerate(snapshot.params.values()):
        for j in range(2):
            torch.testing.assert_close(stacked[j], learners[j][index])


class NormalizedClassifier(Classifier):
    """With BatchNorm (running statistics per replica, updated by every forward) and an epoch-mean log."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("epoch_loss", loss, on_step=False, on_epoch=True)
        return loss


class EpochLosses(L.Callback):
    """The epoch-mean ``epoch_loss`` of every epoch."""

    def __init__(self) -> None:
        self.means: list[Tensor] = []

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.means.append(trainer.callback_metrics["epoch_loss"].clone())


class RunsOutOfMemoryInBackwardAbove(NormalizedClassifier):
    """Raises CUDA's out-of-memory error at the end of the backward whenever more than ``fits`` replicas ran
    (simulated on CPU): the forward has updated the buffers and logged, the backward has written gradients."""

    def __init__(self, fits: int) -> None:
        super().__init__()
        self.fits = fits

    def on_after_backward(self) -> None:
        if self.trainer.strategy.stack.num_replicas > self.fits:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")


@pytest.mark.parametrize("engine", ["fused", "sequential", "auto"])
def test_out_of_memory_in_the_backward_undoes_the_attempt_and_runs_it_again_with_fewer_replicas(engine: str) -> None:
    """From k=4 where 2 fit, failing after the backward: the run equals a k=2 run from the start, in z, the
    replicas, their BatchNorm statistics and each epoch's mean log (the failed attempts count for nothing)."""
    dataset = make_data(num_samples=96)
    snapshots, logged, group_sizes = [], [], []
    for model, k in ((RunsOutOfMemoryInBackwardAbove(fits=2), 4), (NormalizedClassifier(), 2)):
        change, snapshot, losses = ChangeReplicas(at_step=-1, new_k=0), ReplicaSnapshot(), EpochLosses()
        strategy = CrossbowStrategy(algorithm="sma", replicas_per_device=k, engine=engine)
        fit = trainer(strategy=strategy, max_epochs=2, callbacks=[change, snapshot, losses])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit.fit(model, loader(dataset))
        backed_off = [str(w.message) for w in caught if "out of memory" in str(w.message)]
        assert len(backed_off) == (2 if k == 4 else 0), backed_off  # 4 -> 3 -> 2
        assert strategy.replicas_per_device == 2
        snapshots.append((dict(model.named_parameters()), dict(model.named_buffers()), snapshot))
        logged.append(losses.means)
        group_sizes.append(change.group_sizes)
    assert group_sizes[0] == [4] + [2] * 11 and group_sizes[1] == [2] * 12  # the first group ran as 2
    (z, buffers, replicas), (z_reference, buffers_reference, replicas_reference) = snapshots
    for name, value in z_reference.items():
        torch.testing.assert_close(z[name], value, rtol=0, atol=0, msg=f"z differs in {name}")
    for name, value in buffers_reference.items():
        torch.testing.assert_close(buffers[name], value, rtol=0, atol=0, msg=f"z's buffer {name} differs")
    assert replicas.state.pop("names") == replicas_reference.state.pop("names")  # (the flat buffers' layout)
    torch.testing.assert_close(replicas.state, replicas_reference.state, rtol=0, atol=0)  # params, buffers, k
    torch.testing.assert_close(logged[0], logged[1], rtol=0, atol=0)


class RecordsTrainedBatches(Classifier):
    """Runs out of memory (simulated) in the backward when more than ``fits`` replicas run from ``global_step``
    ``from_step`` on, and records the index of every batch whose step went through (its first sample's label)."""

    def __init__(self, fits: int, from_step: int) -> None:
        super().__init__()
        self.fits, self.from_step = fits, from_step
        self.attempt: list[int] = []
        self.trained: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.attempt.append(int(batch[1][0]))
        return super().training_step((batch[0], batch[1] % 3), batch_idx)

    def on_after_backward(self) -> None:
        attempt, self.attempt = self.attempt, []
        if self.trainer.global_step >= self.from_step and self.trainer.strategy.stack.num_replicas > self.fits:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        self.trained += attempt


class LogsWhetherItFits(RecordsTrainedBatches):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.log("fits", float(self.fits > 0))
        return super().training_step(batch, batch_idx)


def numbered_batches(batches: int) -> TensorDataset:
    """``batches`` batches of 8 samples for ``loader``; every label of batch i is 3 i (mod 3: class 0)."""
    x, _ = make_data(num_samples=8 * batches)[:]
    return TensorDataset(x, torch.arange(batches).repeat_interleave(8) * 3)


@pytest.mark.parametrize(
    ("k", "fits", "batches", "steps"),
    [
        (2, 1, 12, 5 + 2),  # groups 0-1 .. 8-9; 10-11 backs off to 10, then 11
        (4, 3, 14, 2 + 2),  # groups 0-3, 4-7; 8-11 backs off to 8-10, then 11-13 (with the 2 left over at k=4)
    ],
)
def test_a_back_off_in_the_epochs_last_group_trains_the_batches_it_gave_back(
    k: int, fits: int, batches: int, steps: int
) -> None:
    """The epoch's last group runs out of memory: the batches it gives back open one more group in the epoch."""
    model = RecordsTrainedBatches(fits=fits, from_step=batches // k - 1)
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=k, engine="sequential"))
    with pytest.warns(UserWarning, match="out of memory"):
        fit.fit(model, loader(numbered_batches(batches)))
    assert [index // 3 for index in model.trained] == list(range(batches))  # each batch once, in order
    assert fit.global_step == steps


def test_an_error_at_one_replica_is_raised_and_the_next_fit_starts_clean() -> None:
    """Out of memory at k=1 cannot back off: it is raised, and nothing of the failed step (its logs, its group,
    its buffers' copy) is left for the next fit of the same strategy."""
    model = LogsWhetherItFits(fits=0, from_step=0)
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=1), limit_train_batches=1)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        fit.fit(model, loader(make_data()))
    model.fits = 1
    fit.fit(model, loader(make_data()))
    assert fit.global_step == 1 and model.trained == [0]
    assert float(fit.callback_metrics["fits"]) == 1.0  # the failed step's 0 is not in the mean


def test_a_run_resumed_after_a_back_off_carries_on_with_the_k_that_fits(tmp_path) -> None:
    """The checkpoint keeps the k the strategy backed off to and its ceiling: resumed with the user's k=4 (and
    no tuner), the run goes on at k=2 and equals the uninterrupted run."""

    def run(epochs: int, ckpt_path: Any = None) -> tuple[CrossbowStrategy, L.Trainer, nn.Module]:
        strategy, model = CrossbowStrategy(algorithm="sma", replicas_per_device=4), RunsOutOfMemoryInBackwardAbove(2)
        fit = trainer(strategy=strategy, max_epochs=epochs, default_root_dir=tmp_path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit.fit(model, loader(make_data(num_samples=96)), ckpt_path=ckpt_path)
        return strategy, fit, model

    _, _, uninterrupted = run(2)
    _, first, _ = run(1)
    first.save_checkpoint(tmp_path / "backed_off.ckpt")
    strategy, _, resumed = run(2, ckpt_path=tmp_path / "backed_off.ckpt")
    assert strategy.replicas_per_device == strategy.replica_ceiling == 2
    for (name, value), expected in zip(resumed.state_dict().items(), uninterrupted.state_dict().values(), strict=True):
        torch.testing.assert_close(value, expected, rtol=0, atol=0, msg=f"{name} differs")


class _Validations(L.Callback):
    def __init__(self) -> None:
        self.at: list[tuple[int, int]] = []  # (epoch, global_step) of every validation

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.at.append((trainer.current_epoch, trainer.global_step))


def test_a_fraction_of_the_epoch_and_of_its_validation_interval_follow_a_change_of_k() -> None:
    """limit_train_batches=0.5 of 64 batches is 32 batches whatever k. val_check_interval=0.5 validates after every
    16 of them: in the epoch whose k changed, after the step that reaches 16 (17 batches, the fifth step) and after
    its last step (29 batches: the 3 that fill no step would have reached 32); later, every half of the steps."""
    change, validations = ChangeReplicas(at_step=1, new_k=4), _Validations()
    fit = trainer(
        strategy=CrossbowStrategy(replicas_per_device=1),
        callbacks=[change, validations],
        max_epochs=3,
        limit_train_batches=0.5,
        val_check_interval=0.5,
    )
    data = loader(make_data(num_samples=512))  # 64 batches
    fit.fit(Classifier(), data, loader(make_data(num_samples=16)))
    # epoch 0: 1 group at k=1, then 31 batches make 7 groups of 4; epochs 1 and 2: 8 groups of 4
    assert change.group_sizes == [1] + [4] * 7 + [4] * 8 * 2
    assert fit.global_step == 8 + 8 + 8
    assert validations.at == [(0, 5), (0, 8), (1, 12), (1, 16), (2, 20), (2, 24)]


class _BatchesAtValidation(L.Callback):
    """The batches of the epoch trained when each validation starts, per epoch."""

    def __init__(self) -> None:
        self.trained: dict[int, int] = {}
        self.at: dict[int, list[int]] = {}

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.trained[trainer.current_epoch] = self.trained.get(trainer.current_epoch, 0) + len(batch)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.at.setdefault(trainer.current_epoch, []).append(self.trained.get(trainer.current_epoch, 0))


class _ChangesReplicasAt(L.Callback):
    def __init__(self, changes: dict[int, int]) -> None:
        self.changes = changes

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step in self.changes:
            trainer.strategy.set_replicas_per_device(self.changes[trainer.global_step])


def test_a_fractional_validation_interval_validates_at_its_fractions_of_the_batches_while_k_changes() -> None:
    """80 batches, val_check_interval=0.25: plain Lightning validates after 20, 40, 60 and 80 of them. With k changed
    four times in the first epoch, crossbow validates after the first step to reach each of them (and after the
    epoch's last step, whose 79 batches leave one that fills no step); the next epoch, at one k, the same way."""
    validations = _BatchesAtValidation()
    fit = trainer(
        strategy=CrossbowStrategy(replicas_per_device=1),
        callbacks=[_ChangesReplicasAt({3: 2, 8: 3, 12: 4, 17: 3}), validations],
        max_epochs=2,
        val_check_interval=0.25,
        limit_val_batches=1,
    )
    fit.fit(Classifier(), loader(make_data(num_samples=640)), loader(make_data(num_samples=16)))
    # epoch 0: 3 steps at k=1, 5 at k=2, 4 at k=3, 5 at k=4, 11 at k=3; its batches after each step run
    # 1, 2, 3, 5, ..., 19, 22, ..., 37, 41, ..., 57, 60, ..., 75, 78
    assert validations.at[0] == [22, 41, 60, 78]
    assert validations.at[1] == [21, 42, 60, 78]  # (at k=3 throughout, as well: the first steps to reach 20, 40, ...)


@pytest.mark.parametrize(("limit", "overfit"), [(0.8, False), (0.99, False), (0.3, True)])
def test_a_fraction_of_the_epoch_is_a_fraction_of_the_loaders_batches_at_a_fixed_k(limit: float, overfit: bool) -> None:
    """20 batches at k=3: ``limit_train_batches`` (or ``overfit_batches``) f takes int(20 f) batches, the groups
    they fill (Lightning alone would take f of the 6 groups)."""
    change = ChangeReplicas(at_step=-1, new_k=3)  # (never changes k: records the group sizes)
    fit = trainer(
        strategy=CrossbowStrategy(replicas_per_device=3),
        callbacks=[change],
        max_epochs=2,
        **({"overfit_batches": limit} if overfit else {"limit_train_batches": limit}),
    )
    fit.fit(Classifier(), loader(make_data(num_samples=160)))
    assert change.group_sizes == [3] * (int(20 * limit) // 3) * 2


class _OneCycle(Classifier):
    """Sizes OneCycleLR by ``trainer.estimated_stepping_batches``, as users do: one step more than that raises."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        total = self.trainer.estimated_stepping_batches
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class _EpochStart(L.Callback):
    def __init__(self) -> None:
        self.steps: list[float] = []

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.steps.append(trainer.num_training_batches)


def test_lightning_counts_a_fraction_of_the_loaders_batches_from_the_start() -> None:
    """20 batches at k=3 with limit_train_batches=0.99: 19 batches, 6 steps per epoch. Lightning's own counts say so
    before the first step (estimated_stepping_batches, which sizes OneCycleLR; num_training_batches at the epoch's
    start; an integer val_check_interval of 6 steps), and the user's fraction is back after fit."""
    epoch_start, validations = _EpochStart(), _Validations()
    fit = trainer(
        strategy=CrossbowStrategy(replicas_per_device=3),
        callbacks=[epoch_start, validations],
        max_epochs=2,
        limit_train_batches=0.99,
        val_check_interval=6,
    )
    fit.fit(_OneCycle(), loader(make_data(num_samples=160)), loader(make_data(num_samples=16)))
    assert fit.global_step == 12
    assert epoch_start.steps == [6, 6]
    assert validations.at == [(0, 6), (1, 12)]
    assert fit.limit_train_batches == 0.99


@pytest.mark.parametrize("name", ["limit_train_batches", "overfit_batches"])
def test_a_fraction_of_the_batches_too_small_for_one_step_is_refused_naming_the_users_argument(name: str) -> None:
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=8), **{name: 0.3})
    message = rf"{name}=0.3 of the training DataLoader's 20 batches is 6 batches, fewer than the 8 .* Use {name} >="
    with pytest.raises(ValueError, match=message):
        fit.fit(Classifier(), loader(make_data(num_samples=160)))


def _fit_from_a_resumable_loader(
    tmp_path: Path, k: int | None, callbacks: list, ckpt_path: Any = None, batches: int = 20
) -> tuple[L.Trainer, Classifier, dict[int, Tensor]]:
    """Two epochs over ``batches`` batches of a loader that saves its place (crossbow at k, or plain Lightning at
    None); a checkpoint every 3 steps."""
    samples = BatchesSeen()
    saves = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=3, save_top_k=-1)
    fit = trainer(
        strategy="auto" if k is None else CrossbowStrategy(replicas_per_device=k),
        callbacks=[samples, saves, *callbacks],
        max_epochs=2,
        enable_checkpointing=True,
    )
    model = Classifier()
    fit.fit(model, ResumableLoader(make_data(num_samples=8 * batches), batch_size=8), ckpt_path=ckpt_path)
    return fit, model, {epoch: torch.cat(rows) for epoch, rows in samples.epochs.items()}


class _TunedChange(ChangeReplicas):
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        trainer.strategy.restore_replicas_per_device = True  # (as the tuner sets it: a resume keeps the tuned k)


def test_a_change_of_k_after_a_mid_epoch_resume_trains_the_rest_of_the_epoch(tmp_path) -> None:
    """Resumed at step 3 of 20 batches at k=1, k changes to 4 after step 8: the epoch goes on to its end (16 steps in
    all, as without the resume) and the run is the uninterrupted one, bitwise."""
    straight, straight_model, straight_samples = _fit_from_a_resumable_loader(tmp_path, 1, [_TunedChange(8, 4)])
    resumed, resumed_model, resumed_samples = _fit_from_a_resumable_loader(
        tmp_path / "resumed", 1, [_TunedChange(8, 4)], ckpt_path=tmp_path / "step=3.ckpt"
    )
    assert straight.global_step == resumed.global_step == 8 + 3 + 5  # epoch 0: 8 at k=1, 3 at k=4; epoch 1: 5
    torch.testing.assert_close(resumed_samples[0], straight_samples[0][3 * 8 :], rtol=0, atol=0)
    torch.testing.assert_close(resumed_samples[1], straight_samples[1], rtol=0, atol=0)
    for a, b in zip(straight_model.parameters(), resumed_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_mid_epoch_resume_with_another_k_trains_the_rest_of_the_epoch_at_that_k(tmp_path) -> None:
    """Saved at step 3 of 20 batches at k=2 (6 batches trained), resumed at k=4: the 14 batches left make 3 steps
    (the 2 that do not fill a fourth are skipped, as in any epoch), then the next epoch starts."""
    _fit_from_a_resumable_loader(tmp_path, 2, [])
    with pytest.warns(UserWarning, match="re-seeded"):
        resumed, _, samples = _fit_from_a_resumable_loader(
            tmp_path / "resumed", 4, [], ckpt_path=tmp_path / "step=3.ckpt"
        )
    data = make_data(num_samples=160).tensors[0]
    torch.testing.assert_close(samples[0], data[6 * 8 : 18 * 8], rtol=0, atol=0)
    torch.testing.assert_close(samples[1], data[: 20 * 8], rtol=0, atol=0)
    assert resumed.global_step == 3 + 3 + 5


@pytest.mark.parametrize(("saved_by", "resumed_by"), [(None, 2), (2, None)], ids=["plain to k=2", "k=2 to plain"])
def test_a_mid_epoch_checkpoint_crosses_between_crossbow_and_plain_lightning(
    tmp_path, saved_by: int | None, resumed_by: int | None
) -> None:
    """The loader's own state is in the checkpoint as plain Lightning saves it: a plain mid-epoch checkpoint resumes
    in crossbow (the 17 batches left make 8 steps at k=2) and a crossbow one in plain Lightning (14 batches left)."""
    _fit_from_a_resumable_loader(tmp_path, saved_by, [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (crossbow re-seeds its replicas from a plain checkpoint, and says so)
        resumed, _, samples = _fit_from_a_resumable_loader(
            tmp_path / "resumed", resumed_by, [], ckpt_path=tmp_path / "step=3.ckpt"
        )
    data = make_data(num_samples=160).tensors[0]
    done = 3 * (saved_by or 1)  # batches trained before the checkpoint
    left = 20 - done if resumed_by is None else (20 - done) // resumed_by * resumed_by
    torch.testing.assert_close(samples[0], data[done * 8 : (done + left) * 8], rtol=0, atol=0)
    torch.testing.assert_close(samples[1], data[: 20 // (resumed_by or 1) * (resumed_by or 1) * 8], rtol=0, atol=0)
    assert resumed.global_step == 3 + left // (resumed_by or 1) + 20 // (resumed_by or 1)


def test_the_epochs_after_a_mid_epoch_resume_with_another_k_are_whole(tmp_path) -> None:
    """Saved at step 3 of 24 batches at k=3 (9 batches trained), resumed at k=2: 7 more steps end that epoch, and the
    next epoch has all of its 12 steps (Lightning would keep the resumed epoch's count of 10)."""
    _fit_from_a_resumable_loader(tmp_path, 3, [], batches=24)
    with pytest.warns(UserWarning, match="re-seeded"):
        resumed, _, samples = _fit_from_a_resumable_loader(
            tmp_path / "resumed", 2, [], ckpt_path=tmp_path / "step=3.ckpt", batches=24
        )
    assert [len(samples[epoch]) for epoch in (0, 1)] == [14 * 8, 24 * 8]
    assert resumed.global_step == 3 + 7 + 12


class _EstimatingStepsFirst(Classifier):
    def configure_optimizers(self) -> Any:
        self.trainer.estimated_stepping_batches  # (as for OneCycleLR: Lightning makes the loader before restoring)
        return super().configure_optimizers()


@pytest.mark.parametrize(
    ("saved_by", "saved_at", "resumed_by", "how"),
    [
        (None, 4, 3, "after a step"),
        (2, 2, 4, "after a step"),
        (2, 4, 3, "after a step"),
        (3, 2, 2, "after a step"),
        (2, 2, 3, "estimated_stepping_batches"),
        (None, 3, 3, "at a validation"),
        (2, 3, 3, "at a validation"),
    ],
    ids=str,
)
def test_a_mid_epoch_resume_from_a_loader_that_does_not_save_its_place_trains_the_batches_left_at_k_now(
    tmp_path, saved_by: int | None, saved_at: int, resumed_by: int, how: str
) -> None:
    """10 batches an epoch; a checkpoint after ``saved_at`` steps of ``saved_by`` batches (plain Lightning: one),
    saved by ``every_n_train_steps`` or at a validation within the epoch. A plain DataLoader starts its pass again on
    resuming, as in plain Lightning, which trains the batches left of the epoch from the pass's start: so does
    crossbow, at k now (those that fill no step are skipped, as in any epoch), and validates after the epoch's last
    step. Lightning, counting steps, would train a whole epoch again where the steps done reach an epoch's at k now,
    too few steps otherwise, and would not see the epoch's last step. Also when ``configure_optimizers`` has
    Lightning make the training loader before it restores the checkpoint."""
    validation = how == "at a validation"
    saves = ModelCheckpoint(
        dirpath=tmp_path,
        filename="{step}",
        **({"monitor": "val_loss"} if validation else {"every_n_train_steps": saved_at}),
    )
    saved = trainer(
        strategy="auto" if saved_by is None else CrossbowStrategy(saved_by),
        callbacks=[saves],
        max_steps=saved_at,
        enable_checkpointing=True,
        **({"val_check_interval": saved_at} if validation else {}),
    )
    validation_data = loader(make_data(num_samples=16))
    saved.fit(Classifier(), loader(make_data(num_samples=80)), validation_data if validation else None)
    samples, validations = BatchesSeen(), _Validations()
    resumed = trainer(strategy=CrossbowStrategy(resumed_by), callbacks=[samples, validations], max_epochs=2)
    module = _EstimatingStepsFirst() if how == "estimated_stepping_batches" else Classifier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (re-seeded at another k; Lightning's warning of a loader that cannot resume)
        resumed.fit(
            module, loader(make_data(num_samples=80)), validation_data, ckpt_path=tmp_path / f"step={saved_at}.ckpt"
        )
    data = make_data(num_samples=80).tensors[0]
    left = (10 - saved_at * (saved_by or 1)) // resumed_by * resumed_by  # batches
    whole = 10 // resumed_by * resumed_by
    epochs = {1: whole} if left == 0 else {0: left, 1: whole}  # (no step left: crossbow trains none of that epoch)
    assert {epoch: len(batches) for epoch, batches in samples.epochs.items()} == epochs
    for epoch, batches in epochs.items():
        torch.testing.assert_close(torch.cat(samples.epochs[epoch]), data[: batches * 8], rtol=0, atol=0)
    assert resumed.global_step == saved_at + (left + whole) // resumed_by
    # (an epoch without a step left is not validated: plain Lightning validates after its batches left)
    ends = [(0, saved_at + left // resumed_by)] if left else []
    assert validations.at == [*ends, (1, resumed.global_step)]


class _FailsAtAStep(Classifier):
    """Raises at ``global_step == fail_at``, in ``training_step`` or, before Lightning counts the step's batch ready,
    in ``on_after_batch_transfer``."""

    def __init__(self, fail_at: int, where: str) -> None:
        super().__init__()
        self.fail_at, self.where = fail_at, where

    def _fail_here(self, where: str) -> None:
        if self.where == where and self.trainer.training and self.global_step == self.fail_at:
            raise RuntimeError("a step failed")

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self._fail_here("on_after_batch_transfer")
        return batch

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self._fail_here("training_step")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    ("saved_by", "fail_at", "where", "resumed_by"),
    [
        (None, 3, "training_step", 1),
        (None, 3, "training_step", 2),
        (1, 3, "training_step", 1),
        (2, 3, "training_step", 2),
        (2, 3, "training_step", 3),
        (2, 3, "on_after_batch_transfer", 2),
        (2, 0, "on_after_batch_transfer", 3),
        (2, 4, "training_step", 3),
        (3, 2, "training_step", 2),
    ],
    ids=str,
)
def test_a_checkpoint_saved_from_an_exception_in_a_step_resumes_with_that_steps_batches_untrained(
    tmp_path, saved_by: int | None, fail_at: int, where: str, resumed_by: int
) -> None:
    """10 batches an epoch; ``OnExceptionCheckpoint`` saves while the step that raised is under way (also from a
    hook before Lightning counts it ready, at a fit's first step, and at an epoch's last step): its group is drawn,
    not trained. Resumed with a plain DataLoader, the epoch trains its batches left from a new pass, that step's
    batches among them, as plain Lightning does (7 of 10 after three steps of one batch), at k now."""
    failing = trainer(
        strategy="auto" if saved_by is None else CrossbowStrategy(saved_by),
        callbacks=[OnExceptionCheckpoint(tmp_path)],
        max_epochs=2,
        enable_checkpointing=True,
    )
    with pytest.raises(RuntimeError, match="a step failed"):
        failing.fit(_FailsAtAStep(fail_at, where), loader(make_data(num_samples=80)))
    samples = BatchesSeen()
    resumed = trainer(strategy=CrossbowStrategy(resumed_by), callbacks=[samples], max_epochs=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (re-seeded at another k; Lightning's warning of a loader that cannot resume)
        resumed.fit(Classifier(), loader(make_data(num_samples=80)), ckpt_path=tmp_path / "on_exception.ckpt")
    left = (10 - fail_at * (saved_by or 1)) // resumed_by * resumed_by  # batches
    whole = 10 // resumed_by * resumed_by
    assert {epoch: len(batches) for epoch, batches in samples.epochs.items()} == ({0: left} if left else {}) | {
        1: whole
    }
    data = make_data(num_samples=80).tensors[0]
    if left:
        torch.testing.assert_close(torch.cat(samples.epochs[0]), data[: left * 8], rtol=0, atol=0)
    assert resumed.global_step == fail_at + (left + whole) // resumed_by


class _RunsOutOfMemoryThenFails(Classifier):
    """At step 2 runs out of memory once (simulated), then, with the smaller group, raises before the optimizer step."""

    def __init__(self) -> None:
        super().__init__()
        self.ran_out = False

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if self.global_step == 2 and not self.ran_out:
            self.ran_out = True
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.global_step == 2:
            raise RuntimeError("a step failed")


def test_an_exception_after_an_out_of_memory_back_off_leaves_the_batches_given_back_untrained(tmp_path) -> None:
    """12 batches at k=3: step 2 backs off to k=2 (its third batch goes back to the loader), then raises. The
    checkpoint has 6 batches trained; resumed at k=1 with a plain DataLoader, that epoch trains the other 6."""
    failing = trainer(
        strategy=CrossbowStrategy(3, engine="sequential"),  # (a fused attempt that fails puts `ran_out` back)
        callbacks=[OnExceptionCheckpoint(tmp_path)],
        enable_checkpointing=True,
    )
    with pytest.raises(RuntimeError, match="a step failed"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the back-off's warning)
        failing.fit(_RunsOutOfMemoryThenFails(), loader(make_data(num_samples=96)))
    samples = BatchesSeen()
    resumed = trainer(strategy=CrossbowStrategy(1), callbacks=[samples])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (re-seeded at another k; Lightning's warning of a loader that cannot resume)
        resumed.fit(Classifier(), loader(make_data(num_samples=96)), ckpt_path=tmp_path / "on_exception.ckpt")
    torch.testing.assert_close(torch.cat(samples.epochs[0]), make_data(num_samples=96).tensors[0][:48], rtol=0, atol=0)
    assert resumed.global_step == 2 + 6


def test_a_mid_epoch_resume_under_a_smaller_fraction_of_the_batches_than_were_trained_trains_that_epoch_again(
    tmp_path,
) -> None:
    """Plain Lightning saved after 6 of 10 batches; resumed with limit_train_batches=0.5 (5 batches an epoch), past
    which 6 batches are: plain Lightning then trains the epoch's 5 batches again, and crossbow at k=2 its 2 steps."""
    saves = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=6)
    trainer(callbacks=[saves], max_steps=6, enable_checkpointing=True).fit(
        Classifier(), loader(make_data(num_samples=80))
    )
    samples = BatchesSeen()
    resumed = trainer(strategy=CrossbowStrategy(2), callbacks=[samples], max_epochs=2, limit_train_batches=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (Lightning's warning of a loader that cannot resume)
        resumed.fit(Classifier(), loader(make_data(num_samples=80)), ckpt_path=tmp_path / "step=6.ckpt")
    assert {epoch: len(batches) for epoch, batches in samples.epochs.items()} == {0: 4, 1: 4}
    assert resumed.global_step == 6 + 2 + 2


@pytest.mark.parametrize(("saved_by", "resumed_by"), [(2, 2), (2, 3), (None, 2)], ids=str)
def test_a_checkpoint_at_the_end_of_an_epoch_that_max_steps_cut_short_resumes_at_the_next_epochs_start(
    tmp_path, saved_by: int | None, resumed_by: int
) -> None:
    """The default ModelCheckpoint saves at an epoch's end, also of an epoch that max_steps=3 ended early: plain
    Lightning resumes at the next epoch's start and trains it whole, and so does crossbow (reviewer P: it had counted
    the next epoch on from the cut epoch's steps)."""
    saves = ModelCheckpoint(dirpath=tmp_path, filename="saved")
    strategy = "auto" if saved_by is None else CrossbowStrategy(saved_by)
    trainer(strategy=strategy, callbacks=[saves], max_steps=3, enable_checkpointing=True).fit(
        Classifier(), loader(make_data(num_samples=80))
    )
    samples, validations = BatchesSeen(), _Validations()
    resumed = trainer(strategy=CrossbowStrategy(resumed_by), callbacks=[samples, validations], max_epochs=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (re-seeded at another k)
        resumed.fit(
            Classifier(),
            loader(make_data(num_samples=80)),
            loader(make_data(num_samples=16)),
            ckpt_path=tmp_path / "saved.ckpt",
        )
    whole = 10 // resumed_by * resumed_by
    assert {epoch: len(batches) for epoch, batches in samples.epochs.items()} == {1: whole}
    assert resumed.global_step == 3 + whole // resumed_by
    assert validations.at == [(1, resumed.global_step)]


def test_a_resumed_epoch_whose_loader_is_made_before_the_restore_and_again_when_it_starts_counts_on(
    tmp_path,
) -> None:
    """configure_optimizers reads estimated_stepping_batches (Lightning makes the training loader before restoring)
    and the loader is made again every epoch: a checkpoint after 4 of epoch 1's 10 batches at k=2, resumed at k=3,
    trains the 6 left as 2 steps and validates after them (reviewer P: one step, when the loader made first took
    the checkpoint's counts)."""
    saves = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=7)
    kwargs = {"reload_dataloaders_every_n_epochs": 1, "max_epochs": 2}
    saved = trainer(strategy=CrossbowStrategy(2), callbacks=[saves], max_steps=7, enable_checkpointing=True, **kwargs)
    saved.fit(Classifier(), loader(make_data(num_samples=80)))
    samples, validations = BatchesSeen(), _Validations()
    resumed = trainer(strategy=CrossbowStrategy(3), callbacks=[samples, validations], **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (re-seeded at another k; Lightning's warning of a loader that cannot resume)
        resumed.fit(
            _EstimatingStepsFirst(),
            loader(make_data(num_samples=80)),
            loader(make_data(num_samples=16)),
            ckpt_path=tmp_path / "step=7.ckpt",
        )
    data = make_data(num_samples=80).tensors[0]
    torch.testing.assert_close(torch.cat(samples.epochs[1]), data[: 6 * 8], rtol=0, atol=0)
    assert resumed.global_step == 7 + 2
    assert validations.at == [(1, 9)]


@pytest.mark.parametrize("resumed_alike", [True, False])
def test_a_checkpoint_of_the_step_that_a_larger_k_made_the_epochs_last_resumes_at_the_next_epochs_start(
    tmp_path, resumed_alike: bool
) -> None:
    """10 batches at k=2; k=3 asked for after step 4 leaves 2 batches, which fill no step: step 4 ends the epoch, and
    a checkpoint is saved there. Resumed with the strategy made alike, the next epoch goes on at k=3, a whole pass
    of batches (3 steps). Resumed at k=2 from the epoch-end checkpoint of a run at k=3 (3 steps), the next epoch has
    all of its 5 steps and a whole pass of batches, as plain Lightning resumes from an epoch's last step (Lightning
    alone, seeing 3 steps done of the 5 an epoch has at k=2, began the next epoch at its fourth)."""
    saves = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=4 if resumed_alike else 3)
    change = ChangeReplicasAtBatch(at_step=3 if resumed_alike else -1, new_k=3)
    saved = trainer(
        strategy=CrossbowStrategy(2 if resumed_alike else 3),
        callbacks=[change, saves],
        max_epochs=1,
        enable_checkpointing=True,
    )
    saved.fit(Classifier(), loader(make_data(num_samples=80)))
    steps_saved = 4 if resumed_alike else 3
    assert change.group_sizes == ([2] * 4 if resumed_alike else [3] * 3)
    group_sizes, samples = ChangeReplicas(at_step=-1, new_k=0), BatchesSeen()
    resumed = trainer(strategy=CrossbowStrategy(2), callbacks=[group_sizes, samples], max_epochs=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*the replicas were re-seeded")  # (at another k)
        resumed.fit(Classifier(), loader(make_data(num_samples=80)), ckpt_path=tmp_path / f"step={steps_saved}.ckpt")
    k = 3 if resumed_alike else 2
    assert group_sizes.group_sizes == [k] * (10 // k)
    assert list(samples.epochs) == [1] and len(samples.epochs[1]) == 10 // k * k
    assert resumed.global_step == steps_saved + 10 // k


def test_a_change_of_k_at_an_epochs_last_step_holds_when_the_loader_is_reloaded() -> None:
    """k changes from 2 to 3 after the last step of the first epoch (24 batches), and Lightning makes the training
    loader again for every epoch: the later epochs are at k=3, as without the reload."""
    change = ChangeReplicas(at_step=12, new_k=3)
    fit = trainer(
        strategy=CrossbowStrategy(replicas_per_device=2),
        callbacks=[change],
        max_epochs=3,
        reload_dataloaders_every_n_epochs=1,
    )
    fit.fit(Classifier(), loader(make_data(num_samples=192)))
    assert change.group_sizes == [2] * 12 + [3] * 8 * 2
    assert fit.strategy.replicas_per_device == 3


def test_the_smallest_fraction_a_refusal_names_takes_one_step() -> None:
    """81 batches at k=10: 10/81 = 0.12346 rounded to nearest, 0.123, makes int(81 x 0.123) = 9 batches and is refused
    again; the message names 0.1235, which takes 10, and is accepted."""
    from lightning_crossbow.epoch_counts import smallest_fraction_taking

    assert smallest_fraction_taking(10, 81) == 0.1235 and int(81 * 0.1235) == 10
    assert smallest_fraction_taking(7, 25) == 0.28  # (not 0.2801: 7/25 x 1e4 is 2800.0000000000005)
    assert all(int(length * smallest_fraction_taking(k, length)) >= k for length in range(1, 200) for k in (1, 3, 10))
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=10), limit_train_batches=0.1)
    with pytest.raises(ValueError, match=r"Use limit_train_batches >= 0.1235, or fewer replicas"):
        fit.fit(Classifier(), loader(make_data(num_samples=8 * 81)))
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=10), limit_train_batches=0.1235)
    fit.fit(Classifier(), loader(make_data(num_samples=8 * 81)))
    assert fit.global_step == 1


@pytest.mark.parametrize("bar", ["tqdm", "rich"])
def test_the_progress_bar_shows_the_epochs_steps_after_a_change_of_k_within_it(bar: str) -> None:
    """k 1 -> 4 after epoch 0's second step (20 batches: 2 steps at 1, then 4 at 4): the bar read 20 steps as the
    epoch began and ended at 6 of 20; its total follows the change (the steps Lightning counts), and it ends full."""
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    class Shown(L.Callback):
        def on_train_epoch_end(self, trainer: L.Trainer, pl_module: Any) -> None:
            shown = trainer.progress_bar_callback
            if isinstance(shown, TQDMProgressBar):
                self.at_end = (shown.train_progress_bar.n, shown.train_progress_bar.total)
            else:
                task = shown.train_progress_bar
                self.at_end = (int(task.completed), int(task.total))

    progress, shown = TQDMProgressBar() if bar == "tqdm" else RichProgressBar(), Shown()
    change = ChangeReplicasAtBatch(at_step=1, new_k=4)
    fit = trainer(
        strategy=CrossbowStrategy(replicas_per_device=1), callbacks=[progress, change, shown], enable_progress_bar=True
    )
    fit.fit(Classifier(), loader(make_data(num_samples=8 * 20)))
    assert change.group_sizes == [1, 1, 4, 4, 4, 4]
    assert shown.at_end == (6, 6)


def test_a_checkpoint_saved_after_an_epochs_last_validation_at_a_changed_k_resumes_at_the_next_epoch(
    tmp_path: Path,
) -> None:
    """24 batches, k=4 changed to 2 after step 2 (10 steps in epoch 0); validating twice an epoch, ModelCheckpoint
    saves in on_validation_end, the epoch's last at step 10. Resumed from it with the strategy made alike, epoch 1
    is whole (12 steps at k=2) and z ends bitwise as the run that went on (Lightning, counting 10 steps done of the
    12 an epoch has at k=2, trained epoch 0's first batches again: 2 more steps, an LR step more)."""

    def run(ckpt_path: Optional[Path] = None) -> tuple[L.Trainer, BatchesSeen]:
        seen = BatchesSeen()
        callbacks: list[L.Callback] = [seen]
        if ckpt_path is None:
            saves = ModelCheckpoint(dirpath=tmp_path, filename="{step}", save_top_k=-1)
            callbacks += [ChangeReplicasAtBatch(at_step=1, new_k=2), saves]
        fit = trainer(
            strategy=CrossbowStrategy(replicas_per_device=4),
            callbacks=callbacks,
            max_epochs=2,
            val_check_interval=0.5,
            limit_val_batches=1,
            enable_checkpointing=ckpt_path is None,
        )
        data = make_data(num_samples=96)
        fit.fit(Classifier(scheduler="step"), loader(data, batch_size=4), loader(data), ckpt_path=ckpt_path)
        return fit, seen

    went_on, _ = run()
    assert (tmp_path / "step=10.ckpt").exists()
    resumed, seen = run(ckpt_path=tmp_path / "step=10.ckpt")
    assert list(seen.epochs) == [1] and len(seen.epochs[1]) == 24
    assert resumed.global_step == went_on.global_step == 22
    for a, b in zip(went_on.lightning_module.parameters(), resumed.lightning_module.parameters(), strict=True):
        assert torch.equal(a, b)


class _SixBatches(IterableDataset):
    """6 batches of 4 samples without a length; each target holds its batch's index."""

    def __iter__(self) -> Any:
        for index in range(6):
            yield torch.randn(4, 6), torch.full((4,), index)


class _OneReplicaFitsFromStep2(Classifier):
    """Runs out of memory (simulated) in the backward from step 2 on with more than one replica; keeps the batches
    trained."""

    def __init__(self) -> None:
        super().__init__()
        self.trained: list[int] = []
        self.attempt: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        self.attempt.append(int(y[0]))
        return nn.functional.cross_entropy(self(x), y % 3)

    def on_after_backward(self) -> None:
        attempt, self.attempt = self.attempt, []
        if self.trainer.global_step >= 2 and self.trainer.strategy.stack.num_replicas > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        self.trained += attempt


def test_a_back_off_at_the_last_step_of_a_loader_without_a_length_says_that_the_batch_given_back_is_skipped() -> None:
    """6 batches at k=2: the last step (batches 4, 5) runs out of memory and runs again with batch 4 alone. Lightning
    has fetched past the pass's end already, so batch 5 opens no other step: a warning says it is skipped (it was
    skipped without a word)."""
    model = _OneReplicaFitsFromStep2()
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=2, engine="sequential"), max_epochs=1)
    with pytest.warns(UserWarning, match=r"1 batch\(es\) of the pass's last step, given back by the out-of-memory"):
        fit.fit(model, DataLoader(_SixBatches(), batch_size=None))
    assert model.trained == [0, 1, 2, 3, 4]
