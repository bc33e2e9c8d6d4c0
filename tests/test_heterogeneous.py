"""Heterogeneous mode (Adaptive SGD): learners split by speed, data routed from one common order, normalized merge."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Collection
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from torch import Tensor, nn
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset, WeightedRandomSampler

from lightning_crossbow import CrossbowStrategy, SpeedBalancer
from lightning_crossbow.balancing import StepTime, fill_batches, split_learners, step_seconds
from lightning_crossbow.data import RoutedBatchLoader
from lightning_crossbow.heterogeneous import LearnerLayouts
from lightning_crossbow.optim import learning_rates_scaled
from lightning_crossbow.routing import Layout, RoutedBatchSampler, RoutingPlan, why_unroutable
from tests.helpers import BatchesSeen, Classifier, loader, make_data, make_net, trainer
from tests.test_multiprocess import ANY_LAUNCHER, _run

BATCH = 8


def reference_weighted_averaging(
    net: nn.Module,
    dataset: torch.utils.data.Dataset,
    num_learners: int,
    epochs: int,
    lr: float,
    eta: float,
    period: int = 1,
    learners_change_at: Collection[int] = (),
) -> list[Tensor]:
    """Scaled averaging with a fixed outer learning rate and plain SGD, written out over one common order.

    Each step the next ``K`` batches go to ``K`` learners, learner ``i`` the ``i``-th; each takes one SGD step.
    The learners start at z after every averaging, which follows every ``period``-th step since the last one and an
    epoch's last step, and comes before the steps (counted over epochs, from 0) in ``learners_change_at``:
    ``z <- z + eta * sum_i p_i (w_i - z)`` with ``p_i = b_i / sum_j b_j``, ``b_i`` the samples learner ``i``
    trained on since the last averaging. A last group of fewer than ``K`` batches is skipped. Which rank holds
    which learner does not matter here.
    """
    z = copy.deepcopy(net)
    learners: list[nn.Module] = []
    samples: list[int] = []
    steps_since = 0

    def average() -> None:
        nonlocal steps_since
        steps_since = 0
        with torch.no_grad():
            for index, p in enumerate(z.parameters()):
                moves = [list(learner.parameters())[index] - p for learner in learners]
                p += eta * sum(b / sum(samples) * move for b, move in zip(samples, moves))
        learners.clear()

    taken = 0
    for _ in range(epochs):
        batches = list(DataLoader(dataset, batch_size=BATCH, shuffle=False))
        firsts = range(0, len(batches) - num_learners + 1, num_learners)
        for step, first in enumerate(firsts):
            if taken in learners_change_at and learners:
                average()
            taken, steps_since = taken + 1, steps_since + 1
            if not learners:
                learners[:], samples[:] = [copy.deepcopy(z) for _ in range(num_learners)], [0] * num_learners
            for i, (x, y) in enumerate(batches[first : first + num_learners]):
                learners[i].zero_grad()
                nn.functional.cross_entropy(learners[i](x), y).backward()
                with torch.no_grad():
                    for p in learners[i].parameters():
                        p -= lr * p.grad
                samples[i] += len(y)
            if steps_since == period or step == len(firsts) - 1:
                average()
    return [p.detach() for p in z.parameters()]


# ----------------------------------------------------------------------------- pure pieces
def test_split_learners_minimises_the_slowest_ranks_step() -> None:
    proportional = [StepTime(0.0, 1.0), StepTime(0.0, 3.0)]
    assert split_learners(proportional, 8) == (6, 2)  # learners in proportion to speed: 3 to 1
    assert split_learners([StepTime(0.0, 1.0)] * 2, 8) == (4, 4)
    assert split_learners([StepTime(0.0, 1.0)] * 2, 5) == (3, 2)  # ties go to the lower rank
    assert split_learners([StepTime(0.0, 1.0), StepTime(0.0, 100.0)], 4) == (3, 1)  # every rank keeps one
    # A fixed cost per step: the slow rank's fixed part (8) is most of its step, so it gets far fewer than 1/3.
    assert split_learners([StepTime(4.0, 1.0), StepTime(8.0, 2.0)], 12) == (10, 2)  # steps of 14 and 12
    for models in (
        [StepTime(0.0, 1.0), StepTime(0.0, 2.0), StepTime(0.0, 5.0)],
        [StepTime(3.0, 1.0), StepTime(1.0, 2.0), StepTime(0.5, 0.7)],
    ):  # brute force over every split of 9 learners with one or more per rank
        every_split = [(a, b, 9 - a - b) for a in range(1, 8) for b in range(1, 9 - a)]
        assert step_seconds(split_learners(models, 9), models) == min(step_seconds(s, models) for s in every_split)
    with pytest.raises(ValueError, match="3 learners cannot be split over 4 ranks"):
        split_learners(proportional * 2, 3)
    # Memory: rank 0 holds at most 5, so the rest go to the slow rank.
    assert split_learners(proportional, 8, most=[5, 8]) == (5, 3)
    with pytest.raises(ValueError, match=r"at most \[3, 3\]"):
        split_learners(proportional, 8, most=[3, 3])


def test_the_balancer_keeps_within_each_ranks_memory() -> None:
    """Rank 0 is 3x faster but has room for one more learner only: the split stops at (5, 3), not (6, 2)."""
    balancer = SpeedBalancer(every=1, min_gain=0.0)
    balancer._window = [0.0]
    gathered = torch.tensor([[4.0, 0.0, 1.0], [12.0, 0.0, 100.0]])  # T = 1 x 4 and 3 x 4 at (4, 4)
    new, _ = balancer.rebalance(Layout((4, 4), (BATCH, BATCH)), BATCH, lambda row: gathered, groups_drawn=0, room=1)
    assert new == ((5, 3), (BATCH, BATCH)) and balancer.most == [5, 104]


def test_step_time_fits_the_fixed_and_the_per_learner_cost() -> None:
    assert StepTime.fit({4: 6.0, 6: 8.0}) == StepTime(2.0, 1.0)
    assert StepTime.fit({2: 4.0, 4: 6.0, 6: 8.0}) == StepTime(2.0, 1.0)
    assert StepTime.fit({4: 6.0}) == StepTime(0.0, 1.5)  # one point: proportional
    assert StepTime.fit({4: 6.0, 6: 5.0}) == StepTime(
        0.0, 5.0 / 6.0
    )  # falling with k (noise): the largest k's, proportional


def test_the_balancer_corrects_a_proportional_first_guess_with_a_second_window() -> None:
    """Rank 0: T(k) = 4 + k; rank 1: 8 + 2.5 k. The first window (6, 6) suggests proportional models;
    the second, at the new split, reveals the fixed cost and moves to the optimum."""
    truth = [StepTime(4.0, 1.0), StepTime(8.0, 2.5)]
    balancer = SpeedBalancer(every=1, min_gain=0.0)
    split: tuple[int, ...] = (6, 6)
    for _ in range(3):
        times = [truth[rank](k) for rank, k in enumerate(split)]
        balancer._window = [0.0]  # (replaced by the gathered times below)
        gathered = torch.tensor([[t, 0.0, 100.0] for t in times])  # (busy seconds, groups drawn, room)
        layout = Layout(split, (BATCH, BATCH))
        new, _ = balancer.rebalance(layout, BATCH, lambda row: gathered, groups_drawn=0, room=100)
        split = new.split if new is not None else split
    best = min(((a, 12 - a) for a in range(1, 12)), key=lambda s: step_seconds(s, truth))
    assert split == best == (10, 2)


def _draw_together(
    plans: list[RoutingPlan], order: range, groups: int, changes: dict, drop_last: bool = False
) -> list[list[list[list[int]]]]:
    """Every rank's batches of each group, the ranks stepping through the groups together as training does;
    ``changes[g] = (split, batch sizes)`` is scheduled on every rank before group ``g``."""
    samplers = [RoutedBatchSampler(order, BATCH, drop_last, plan) for plan in plans]  # type: ignore[arg-type]
    iterators = [iter(sampler) for sampler in samplers]
    drawn: list[list[list[list[int]]]] = [[] for _ in plans]
    for group in range(groups):
        for plan in plans:
            if group in changes:
                split, batch_sizes = changes[group]
                plan.schedule(split, group, batch_sizes)
        for rank, iterator in enumerate(iterators):
            drawn[rank].append(list(islice(iterator, plans[rank].share(group)[1])))
    assert all(next(iterator, None) is None for iterator in iterators)
    return drawn


def test_routed_samplers_of_all_ranks_cover_the_order_once_however_the_split_changes() -> None:
    """Two ranks draw one order of 92 indices (12 batches of 8, the last of 4); the split changes at group 2."""
    plans = [RoutingPlan((2, 2), rank) for rank in range(2)]
    drawn = _draw_together(plans, range(92), 3, {2: ((3, 1), None)})
    flat = [[sum(group, []) for group in rank] for rank in drawn]
    assert flat[0] == [list(range(0, 16)), list(range(32, 48)), list(range(64, 88))]
    assert flat[1] == [list(range(16, 32)), list(range(48, 64)), list(range(88, 92))]
    assert [len(batch) for batch in drawn[0][2]] == [8, 8, 8]  # one batch per learner
    assert plans[0].uneven_groups == {2: (8, 8, 8, 4)}  # the order's short last batch falls in group 2
    assert plans[0].learner_weights(2) == [4 * 8 / 28] * 3 and plans[1].learner_weights(2) == [4 * 4 / 28]
    assert plans[0].learner_weights(1) is None  # full batches: equal weights


def test_larger_batches_on_one_rank_still_cover_the_order_once_and_weigh_by_samples() -> None:
    """From group 1 rank 0's 3 learners take 12 samples each and rank 1's one learner 8 (44 a group): 116 indices
    are 32 (group 0), 44, 40 (group 2, where rank 1's learner gets the last 4). With ``drop_last`` group 2 is
    skipped."""
    plans = [RoutingPlan((2, 2), rank) for rank in range(2)]
    drawn = _draw_together(plans, range(116), 3, {1: ((3, 1), (12, 8))})
    cut = [list(range(a, b)) for a, b in zip([0, 8, 16, 24, 32, 44, 56, 68, 76, 88, 100, 112], [8, 16, 24, 32, 44,
                                              56, 68, 76, 88, 100, 112, 116])]  # fmt: skip
    assert drawn[0] == [cut[0:2], cut[4:7], cut[8:11]]
    assert drawn[1] == [cut[2:4], cut[7:8], cut[11:12]]
    assert plans[1].uneven_groups == {2: (12, 12, 12, 4)}
    assert plans[0].learner_weights(0) is None  # equal full batches
    assert plans[0].learner_weights(1) == [4 * 12 / 44] * 3 and plans[1].learner_weights(1) == [4 * 8 / 44]
    assert plans[0].learner_weights(2) == [4 * 12 / 40] * 3 and plans[1].learner_weights(2) == [4 * 4 / 40]
    # group 2 closing a period of three steps at this layout: 2 x 12 + 12 and 2 x 8 + 4 samples since the averaging
    assert plans[1].learner_weights(2, full_groups_before=2) == [4 * 20 / (3 * 36 + 20)]
    kept = [RoutingPlan((2, 2), rank) for rank in range(2)]
    drawn = _draw_together(kept, range(116), 2, {1: ((3, 1), (12, 8))}, drop_last=True)
    assert drawn[0] == [cut[0:2], cut[4:7]] and not kept[0].uneven_groups
    with pytest.raises(ValueError, match=r"positive int per-replica batch size, got \(12, 0\)"):
        kept[0].schedule((3, 1), 5, (12, 0))


def test_the_loader_length_follows_the_batch_sizes() -> None:
    """116 samples at (3, 1) learners of (12, 8): 2 groups of 44 and 28 left, short of 3 x 12 + 1: an epoch of 2."""
    plan = RoutingPlan((3, 1), rank=0)
    sampler = RoutedBatchSampler(range(116), BATCH, False, plan)  # type: ignore[arg-type]
    assert sampler.groups_per_epoch() == 116 // 32 == 3 and len(sampler) == 9
    plan.schedule((3, 1), 0, (12, 8))
    assert sampler.groups_per_epoch() == 2 and len(sampler) == 6
    assert sum(1 for _ in sampler) == 6 and plan.groups_drawn == 3  # (the third found not to fit)


def test_fill_batches_lets_the_faster_ranks_fill_the_slowest_ranks_step() -> None:
    """The slowest rank keeps the DataLoader's batch and sets the pace; the others grow theirs up to it."""
    proportional = [StepTime(0.0, 1.0), StepTime(0.0, 5.0)]
    # split (3, 1): steps of 3 and 5; rank 0 may take 5/3 of its batch: floor(8 x 5/3) = 13
    assert fill_batches((3, 1), proportional, BATCH, max_scale=2.0) == (13, 8)
    assert fill_batches((3, 1), proportional, BATCH, max_scale=1.5) == (12, 8)
    assert fill_batches((3, 1), proportional, BATCH, max_scale=1.0) == (8, 8)
    fixed = [StepTime(4.0, 1.0), StepTime(8.0, 2.0)]  # split (10, 2): 14 and 12; rank 1 takes (14 - 8) / 4 = 1.5x
    assert fill_batches((10, 2), fixed, BATCH, max_scale=2.0) == (8, 12)


def test_the_balancer_gives_the_faster_rank_larger_batches_where_the_split_cannot_balance() -> None:
    """Rank 1 takes 5x as long per learner-batch; K = 4. The best split, (3, 1), leaves rank 0 idle 2 of every 5
    time units: with max_batch_scale=2 its learners take 13 samples instead. A window at that layout confirms it."""
    truth = [StepTime(0.0, 1.0), StepTime(0.0, 5.0)]
    for max_scale, expected in ((2.0, ((3, 1), (13, 8))), (1.0, ((3, 1), (8, 8)))):
        balancer = SpeedBalancer(every=1, min_gain=0.05, max_batch_scale=max_scale)
        layout, changes = Layout((2, 2), (BATCH, BATCH)), []
        for _ in range(3):
            units = [k * b / BATCH for k, b in zip(*layout)]
            gathered = torch.tensor([[truth[rank](u), 0.0, 100.0] for rank, u in enumerate(units)])
            balancer._window = [0.0]  # (replaced by the gathered times)
            new, _ = balancer.rebalance(layout, BATCH, lambda row: gathered, groups_drawn=0, room=100)
            if new is not None:
                layout = new
                changes.append(new)
        assert changes == [expected]
    with pytest.raises(ValueError, match=r"max_batch_scale must be a number >= 1 .*, got 0.5"):
        SpeedBalancer(max_batch_scale=0.5)


def test_a_split_cannot_start_at_a_group_already_drawn() -> None:
    plan = RoutingPlan((2, 2), 0)
    plan.groups_drawn = 3
    with pytest.raises(ValueError, match="group 2 is already drawn"):
        plan.schedule((3, 1), from_group=2)
    with pytest.raises(ValueError, match="one entry per rank"):
        plan.schedule((3, 1, 1), from_group=3)
    plan.schedule((3, 1), from_group=6)
    plan.schedule((1, 3), from_group=4)  # supersedes the change at 6, which no rank has reached
    assert [plan.split_at(g) for g in (3, 4, 6)] == [(2, 2), (1, 3), (1, 3)]


def test_a_group_found_not_to_fit_counts_as_drawn() -> None:
    """Rank 1 of a (3, 1) split runs out of the order before group 2 (10 batches: 8 used, 2 left < K = 4);
    a new split must not start at group 2, or rank 0 could find room for it that rank 1 did not."""
    plan = RoutingPlan((3, 1), rank=1)
    assert len(list(RoutedBatchSampler(range(80), BATCH, False, plan))) == 2  # type: ignore[arg-type]
    assert plan.groups_drawn == 3
    with pytest.raises(ValueError, match="group 2 is already drawn"):
        plan.schedule((1, 1), from_group=2)


# -------------------------------------------------------------------------- one process
def test_one_process_heterogeneous_mode_gives_the_uniform_paths_values() -> None:
    """With one rank the routing is the user's order, and full batches merge with equal weights: bitwise equal."""
    results = []
    for heterogeneous in (False, True):
        model = Classifier(lr=0.1)
        strategy = CrossbowStrategy(replicas_per_device=4, heterogeneous=heterogeneous)
        trainer(strategy=strategy, max_epochs=2).fit(model, loader(make_data(num_samples=96)))
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_the_strategy_tells_the_layout_in_force_during_a_fit_only() -> None:
    class ReadsTheLayout(Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            self.layout = trainer.strategy.layout

    reads, strategy = ReadsTheLayout(), CrossbowStrategy(replicas_per_device=4, heterogeneous=True)
    trainer(strategy=strategy, max_epochs=1, callbacks=[reads]).fit(Classifier(), loader(make_data(num_samples=96)))
    assert reads.layout == Layout(split=(4,), batch_sizes=(8,))
    assert strategy.layout is None and CrossbowStrategy(replicas_per_device=4).layout is None


def test_a_loader_with_workers_is_routed_as_one_without() -> None:
    """The routed batch sampler draws in the training process and hands each worker a batch's indices: a loader
    with a worker process trains on the same batches as one without, bitwise."""
    results = []
    for workers in (0, 1):
        model = Classifier(lr=0.1)
        strategy = CrossbowStrategy(replicas_per_device=3, heterogeneous=True)
        trainer(strategy=strategy, max_epochs=2).fit(model, loader(make_data(num_samples=92), num_workers=workers))
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_a_short_last_batch_weighs_by_its_samples() -> None:
    """92 samples: the last batch has 4 of 8. z's update weighs it by 4/28 of the last step's samples."""
    dataset = make_data(num_samples=92)
    model = Classifier(optimizer="plain_sgd", lr=0.1)
    strategy = CrossbowStrategy(replicas_per_device=4, outer_lr=2.0, heterogeneous=True)
    trainer(strategy=strategy, max_epochs=2).fit(model, loader(dataset))
    expected = reference_weighted_averaging(make_net(), dataset, num_learners=4, epochs=2, lr=0.1, eta=2.0)
    for actual, wanted in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(actual.detach(), wanted)


def test_resuming_an_uneven_split_elsewhere_names_the_split_in_the_re_seed_warning(tmp_path: Path) -> None:
    """A heterogeneous checkpoint's ``replicas_per_device`` is rank 0's own k: the warning of a resume that re-seeds
    names the learners per rank instead (a checkpoint of two ranks at (5, 1), resumed on one process at k=3)."""
    first = trainer(strategy=CrossbowStrategy(replicas_per_device=5), max_steps=2)
    first.fit(Classifier(), loader(make_data(num_samples=80)))
    first.save_checkpoint(tmp_path / "one.ckpt")
    checkpoint = torch.load(tmp_path / "one.ckpt", weights_only=False)
    checkpoint["crossbow"].update(split=[5, 1], world_size=2)  # (as rank 0 of such a run saves it)
    torch.save(checkpoint, tmp_path / "uneven.ckpt")
    with pytest.warns(UserWarning, match=r"from a checkpoint of 6 learners split \(5, 1\) over world_size=2 with"):
        trainer(strategy=CrossbowStrategy(replicas_per_device=3), max_steps=3).fit(
            Classifier(), loader(make_data(num_samples=80)), ckpt_path=tmp_path / "uneven.ckpt"
        )


class SaveAtStep(Callback):
    """Saves a checkpoint once ``global_step`` reaches ``step`` (in ``on_train_batch_end``, as ModelCheckpoint's)."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _shuffled_heterogeneous_fit(k: int, *callbacks: Callback, ckpt_path: Any = None) -> tuple[Classifier, BatchesSeen]:
    """One process, heterogeneous mode, 96 samples shuffled in batches of 8, 2 epochs (3 steps an epoch at k=4)."""
    seen, model = BatchesSeen(), Classifier(lr=0.1)
    strategy = CrossbowStrategy(replicas_per_device=k, heterogeneous=True)
    checkpoints = any(isinstance(callback, OnExceptionCheckpoint) for callback in callbacks)
    fit = trainer(strategy=strategy, max_epochs=2, callbacks=[seen, *callbacks], enable_checkpointing=checkpoints)
    fit.fit(model, loader(make_data(num_samples=96), shuffle=True), ckpt_path=ckpt_path)
    return model, seen


def test_a_resume_in_an_epochs_middle_goes_on_at_its_place_in_the_common_order(tmp_path: Path) -> None:
    """Saved after step 4 (the first of epoch 1's three) and resumed: the epoch's last two steps train the order's
    samples after the first step's, so the resumed fit ends bitwise where the one that went on did."""
    straight, straight_seen = _shuffled_heterogeneous_fit(4, SaveAtStep(4, tmp_path / "step4.ckpt"))
    resumed, resumed_seen = _shuffled_heterogeneous_fit(4, ckpt_path=tmp_path / "step4.ckpt")
    assert len(resumed_seen.epochs[1]) == 8 and torch.equal(
        torch.cat(resumed_seen.epochs[1]), torch.cat(straight_seen.epochs[1][4:])
    )
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_resume_with_other_learners_in_an_epochs_middle_trains_the_rest_of_its_order_once(tmp_path: Path) -> None:
    """Saved after step 4 (k=4: 32 of epoch 1's 96 samples trained) and resumed with k=3: the epoch's rest, 64
    samples, makes two steps of 24 (the last 16 fill none): no sample of the epoch trained twice (before, the
    resumed epoch drew its order from the start again)."""
    _, straight_seen = _shuffled_heterogeneous_fit(4, SaveAtStep(4, tmp_path / "step4.ckpt"))
    _, resumed_seen = _shuffled_heterogeneous_fit(3, ckpt_path=tmp_path / "step4.ckpt")
    epoch = torch.cat(straight_seen.epochs[1][:4] + resumed_seen.epochs[1])
    assert len(resumed_seen.epochs[1]) == 2 * 3 and len(epoch) == 32 + 48
    assert len(torch.unique(epoch, dim=0)) == len(epoch)
    assert 0 not in resumed_seen.epochs  # (epoch 0 was done before the checkpoint)


class StepsAndValidations(Callback):
    """Each step's (epoch, batch_idx, whether Lightning marks it the epoch's last) and each validation's (epoch,
    global step)."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int, bool]] = []
        self.validations: list[tuple[int, int]] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.steps.append((trainer.current_epoch, batch_idx, trainer.fit_loop.epoch_loop.batch_progress.is_last_batch))

    def on_validation_start(self, trainer: Any, *args: Any) -> None:
        self.validations.append((trainer.current_epoch, trainer.global_step))


def _validated_fit(k: int, samples: int, *callbacks: Callback, ckpt_path: Any = None, **kwargs: Any) -> dict:
    """One process, heterogeneous mode, shuffled batches of 8, 2 epochs, validation on 2 batches."""
    seen, steps = BatchesSeen(), StepsAndValidations()
    fit = trainer(
        strategy=CrossbowStrategy(replicas_per_device=k, heterogeneous=True),
        max_epochs=2,
        callbacks=[seen, steps, *callbacks],
        enable_checkpointing=any(isinstance(callback, ModelCheckpoint) for callback in callbacks),
        **kwargs,
    )
    validation = loader(make_data(num_samples=16, seed=1))
    fit.fit(Classifier(lr=0.1), loader(make_data(num_samples=samples), shuffle=True), validation, ckpt_path=ckpt_path)
    return {"seen": seen.epochs, "steps": steps.steps, "validations": steps.validations, "global_step": fit.global_step}


def test_a_resume_at_fewer_steps_an_epoch_than_were_done_finishes_that_epoch_and_marks_its_last_step(
    tmp_path: Path,
) -> None:
    """Saved at k=2 after 4 of epoch 0's 6 steps (64 of 96 samples), resumed at k=4 (3 steps an epoch): the rest of
    epoch 0, 32 samples, is one step, Lightning's 5th of that epoch, marked its last, then epoch 0 validates (before,
    Lightning's count, 3, fell below the steps done: it began the epoch's count again, marked no step last and
    skipped epoch 0's validation). A checkpoint saved after that step holds epoch 0's whole order as trained: resumed
    from it, epoch 0 trains nothing again."""
    _validated_fit(2, 96, SaveAtStep(4, tmp_path / "a.ckpt"))
    resumed = _validated_fit(4, 96, SaveAtStep(5, tmp_path / "b.ckpt"), ckpt_path=tmp_path / "a.ckpt")
    assert resumed["steps"] == [(0, 4, True), (1, 0, False), (1, 1, False), (1, 2, True)]
    assert resumed["validations"] == [(0, 5), (1, 8)]
    assert len(resumed["seen"][0]) == 4 and len(resumed["seen"][1]) == 3 * 4
    again = _validated_fit(4, 96, ckpt_path=tmp_path / "b.ckpt")
    assert again["steps"] == [(1, 0, False), (1, 1, False), (1, 2, True)] and 0 not in again["seen"]


def test_a_checkpoint_of_a_validation_in_an_epochs_middle_resumed_at_another_k_trains_the_rest_of_that_epoch(
    tmp_path: Path,
) -> None:
    """k=2, 128 samples (8 steps an epoch), val_check_interval=0.5: ModelCheckpoint saves after the validation at step
    4, and the fit resumes at k=4 (Lightning counts 4 steps an epoch, as many as were done): the other 64 samples of
    epoch 0 make 2 steps, then epoch 1 trains its 4 (before, epoch 0 ended at once, and epoch 1 went on from epoch
    0's place in the order: 64 of its samples never trained)."""
    saves = ModelCheckpoint(tmp_path, filename="{step}", save_top_k=-1, every_n_train_steps=None)
    straight = _validated_fit(2, 128, saves, val_check_interval=0.5)
    assert (0, 4) in straight["validations"]
    resumed = _validated_fit(4, 128, ckpt_path=tmp_path / "step=4.ckpt", val_check_interval=0.5)
    assert resumed["global_step"] == 4 + 2 + 4
    first_half = torch.cat(straight["seen"][0][:8])
    rest_of_epoch_0 = torch.cat(resumed["seen"][0])
    assert len(rest_of_epoch_0) == 64 and len(torch.unique(torch.cat([first_half, rest_of_epoch_0]), dim=0)) == 128
    assert len(torch.unique(torch.cat(resumed["seen"][1]), dim=0)) == 128


class FailAtStep(Callback):
    """Raises in ``on_train_batch_start`` of the step after ``step``: its group is handed out and not trained."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("a failure in the middle of an epoch")


def test_a_checkpoint_saved_from_a_failed_step_resumes_at_that_steps_group(tmp_path: Path) -> None:
    """OnExceptionCheckpoint saves while step 5's group is handed out and not trained: the resumed epoch trains it,
    as the fit that did not fail did (bitwise the same z)."""
    straight, _ = _shuffled_heterogeneous_fit(4)
    with pytest.raises(RuntimeError, match="a failure in the middle"):
        _shuffled_heterogeneous_fit(4, FailAtStep(4), OnExceptionCheckpoint(tmp_path, filename="failed"))
    resumed, resumed_seen = _shuffled_heterogeneous_fit(4, ckpt_path=tmp_path / "failed.ckpt")
    assert len(resumed_seen.epochs[1]) == 8
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


class ChangeKAtStep(Callback):
    def __init__(self, step: int, k: int) -> None:
        self.step, self.k = step, k

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.strategy.set_replicas_per_device(self.k)


def test_a_failed_step_whose_group_starts_a_scheduled_change_resumes_with_that_change_at_its_group(
    tmp_path: Path,
) -> None:
    """k=4 -> 2 is asked for after step 4, from the next group; step 5 fails before the new k is in force, and
    OnExceptionCheckpoint saves. The change is counted from the first group not trained, the failed one, which the
    resumed fit trains first (counted from the group handed out, it was due one group before the first: a crash,
    'group -1 is already drawn'): the resumed fit ends as the one that did not fail, bitwise."""
    straight, _ = _shuffled_heterogeneous_fit(4, ChangeKAtStep(4, 2))
    with pytest.raises(RuntimeError, match="a failure in the middle"):
        _shuffled_heterogeneous_fit(
            4, ChangeKAtStep(4, 2), FailAtStep(4), OnExceptionCheckpoint(tmp_path, filename="failed")
        )
    resumed, resumed_seen = _shuffled_heterogeneous_fit(4, ckpt_path=tmp_path / "failed.ckpt")
    assert [len(group) for group in resumed_seen.epochs[1]] == [8] * 8  # (4 steps of 2 batches)
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_loader_made_before_the_restore_and_made_again_for_the_resumed_epoch_gets_its_place(tmp_path: Path) -> None:
    """configure_optimizers reads estimated_stepping_batches (the loader is made before the restore) and
    reload_dataloaders_every_n_epochs=1 makes it again when the resumed epoch starts: the new loader goes on at the
    checkpoint's place (before, the place went to the first loader, which never trained: the epoch drew its order
    from the start again)."""

    class ReadsEstimatedSteps(Classifier):
        def configure_optimizers(self) -> Any:
            self.estimate = self.trainer.estimated_stepping_batches
            return super().configure_optimizers()

    def fit(*callbacks: Callback, ckpt_path: Any = None) -> tuple[Classifier, BatchesSeen]:
        seen, model = BatchesSeen(), ReadsEstimatedSteps(lr=0.1)
        strategy = CrossbowStrategy(replicas_per_device=4, heterogeneous=True)
        fit = trainer(
            strategy=strategy, max_epochs=2, callbacks=[seen, *callbacks], reload_dataloaders_every_n_epochs=1
        )
        fit.fit(model, loader(make_data(num_samples=96), shuffle=True), ckpt_path=ckpt_path)
        return model, seen

    straight, straight_seen = fit(SaveAtStep(4, tmp_path / "step4.ckpt"))
    resumed, resumed_seen = fit(ckpt_path=tmp_path / "step4.ckpt")
    assert torch.equal(torch.cat(resumed_seen.epochs[1]), torch.cat(straight_seen.epochs[1][4:]))
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_place_beyond_a_smaller_training_sets_order_starts_the_order_again_saying_so(tmp_path: Path) -> None:
    """Saved after 64 of epoch 1's 96 samples (step 5), resumed over 40 samples: the place is not taken."""
    _shuffled_heterogeneous_fit(4, SaveAtStep(5, tmp_path / "step5.ckpt"))
    strategy = CrossbowStrategy(replicas_per_device=4, heterogeneous=True)
    with pytest.warns(UserWarning, match=r"place in the common order \(after 64 samples\) lies beyond the 40 samples"):
        trainer(strategy=strategy, max_epochs=2).fit(
            Classifier(lr=0.1), loader(make_data(num_samples=40), shuffle=True), ckpt_path=tmp_path / "step5.ckpt"
        )


def test_a_uniform_checkpoint_from_an_epochs_middle_resumes_heterogeneous_mode_at_the_orders_start_saying_so(
    tmp_path: Path,
) -> None:
    """The uniform path's order is not the common one, so its place cannot carry over: a warning says so."""
    uniform = trainer(strategy=CrossbowStrategy(4), max_epochs=1, callbacks=[SaveAtStep(1, tmp_path / "u.ckpt")])
    uniform.fit(Classifier(lr=0.1), loader(make_data(num_samples=96), shuffle=True))
    with pytest.warns(UserWarning, match="holds no place in heterogeneous mode's common order .* the order's start"):
        _shuffled_heterogeneous_fit(4, ckpt_path=tmp_path / "u.ckpt")


def test_heterogeneous_mode_refuses_a_sampler_it_cannot_reproduce_on_every_rank() -> None:
    dataset = make_data(num_samples=32)
    weighted = DataLoader(dataset, batch_size=8, sampler=WeightedRandomSampler([1.0] * 32, 32))
    strategy = CrossbowStrategy(replicas_per_device=2, heterogeneous=True)
    with pytest.raises(ValueError, match="needs shuffle=True or False .* got a WeightedRandomSampler"):
        trainer(strategy=strategy).fit(Classifier(), weighted)
    # Across processes Lightning wraps the user's sampler for them: the one named is still the user's.
    wrapped = DataLoader(dataset, batch_size=8, sampler=DistributedSamplerWrapper(weighted.sampler, 2, 0))
    assert why_unroutable(wrapped) == (
        "shuffle=True or False (a RandomSampler or SequentialSampler), got a WeightedRandomSampler"
    )


def test_heterogeneous_mode_refuses_a_batch_sampler_given_to_the_loader_saying_so() -> None:
    batches = DataLoader(make_data(num_samples=32), batch_sampler=BatchSampler(SequentialSampler(range(32)), 8, False))
    strategy = CrossbowStrategy(replicas_per_device=2, heterogeneous=True)
    with pytest.raises(ValueError, match=r"its batch_size \(not a batch_sampler given to it\), got batch_sampler="):
        trainer(strategy=strategy).fit(Classifier(), batches)


# ------------------------------------------------------------------------ two processes
def _heterogeneous_run(out: Path, *extra: str, k: int = 4, costs: str = "1,3", samples: int = 188) -> list[dict]:
    out.mkdir(exist_ok=True)
    result = _run(
        out, ANY_LAUNCHER, str(k), "--heterogeneous", costs, "--samples", str(samples),
        "--algorithm", "scaled_averaging", "--outer-lr", "2.0", "--optimizer", "plain_sgd", *extra,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


@pytest.fixture(scope="module")
def four_epochs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """What each rank of a 4-epoch run with a 3x slower rank 1 (K = 8) ended with."""
    return _heterogeneous_run(tmp_path_factory.mktemp("four_epochs"), "--epochs", "4")


def test_a_three_times_slower_rank_gets_a_quarter_of_the_learners_and_the_values_stay_exact(
    four_epochs: list[dict],
) -> None:
    """K = 8 learners; rank 1's device takes 3x as long per learner-step (a virtual clock). After one window
    the split is (6, 2), every sample is still trained on once per epoch, and z is the reference's."""
    epochs, ranks = 4, four_epochs
    assert [split for _, split, _ in ranks[0]["splits"]] == [(4, 4), (6, 2)]
    assert ranks[0]["replicas_per_device"] == 6 and ranks[1]["replicas_per_device"] == 2
    assert ranks[0]["global_step"] == epochs * 3  # 24 batches of the common order per epoch, 8 per step
    dataset_inputs = make_data(num_samples=188).tensors[0]
    for epoch in range(epochs):
        seen = torch.cat([ranks[0]["seen"][epoch], ranks[1]["seen"][epoch]])
        assert seen.shape == dataset_inputs.shape
        matches = (seen.unsqueeze(1) == dataset_inputs.unsqueeze(0)).all(-1)  # (seen, dataset) sample pairs
        assert torch.equal(matches.sum(0), torch.ones(188, dtype=torch.long))  # each sample once
    for a, b in zip(ranks[0]["z"], ranks[1]["z"], strict=True):
        assert torch.equal(a, b)
    expected = reference_weighted_averaging(make_net(), make_data(num_samples=188), 8, epochs, lr=0.1, eta=2.0)
    for actual, wanted in zip(ranks[0]["z"], expected, strict=True):
        torch.testing.assert_close(actual, wanted)


def test_local_steps_on_devices_of_different_speed_keep_every_sample_once_and_the_exact_weighted_merge(
    tmp_path: Path,
) -> None:
    """averaging_period=3 with 3 steps per epoch: one averaging per epoch, after two groups of full batches and the
    last group, whose last batch is short; each learner weighs by its samples over the three steps. The balancer's
    window (2 steps) ends between two averagings and its new split waits for the epoch's averaging; it starts at a
    group no rank has drawn (epoch 2's first or second, as far as the loader has run ahead), and if that is within
    a period, the steps before it are averaged first."""
    epochs = 4
    ranks = _heterogeneous_run(tmp_path / "run", "--epochs", str(epochs), "--averaging-period", "3")
    assert [split for _, split, _ in ranks[0]["splits"]] == [(4, 4), (6, 2)]
    sizes = ranks[0]["group_sizes"]
    change = sizes.index(6)
    assert change in (3, 4) and set(sizes[:change]) == {4} and set(sizes[change:]) == {6}
    dataset_inputs = make_data(num_samples=188).tensors[0]
    for epoch in range(epochs):
        seen = torch.cat([ranks[0]["seen"][epoch], ranks[1]["seen"][epoch]])
        matches = (seen.unsqueeze(1) == dataset_inputs.unsqueeze(0)).all(-1)
        assert torch.equal(matches.sum(0), torch.ones(188, dtype=torch.long))  # each sample once
    for a, b in zip(ranks[0]["z"], ranks[1]["z"], strict=True):
        assert torch.equal(a, b)
    expected = reference_weighted_averaging(
        make_net(), make_data(num_samples=188), 8, epochs, lr=0.1, eta=2.0, period=3, learners_change_at={change}
    )
    for actual, wanted in zip(ranks[0]["z"], expected, strict=True):
        torch.testing.assert_close(actual, wanted)
    every_step = reference_weighted_averaging(make_net(), make_data(num_samples=188), 8, epochs, lr=0.1, eta=2.0)
    assert not all(torch.allclose(a, b) for a, b in zip(ranks[0]["z"], every_step))  # (the period made a difference)


def reference_by_batch_sizes(
    net: nn.Module,
    dataset: TensorDataset,
    steps: list[list[list[int]]],
    lr: float,
    eta: float,
    period: int = 1,
    lr_follows_batch: bool = False,
) -> list[Tensor]:
    """Scaled averaging with plain SGD, written out over one common order (``shuffle=False``): ``steps[e][s]`` holds
    the batch sizes of epoch ``e``'s step ``s``'s learners, which take the next samples of the order in turn; each
    takes one SGD step. The learners start at z after every averaging, which follows every ``period``-th step since
    the last one and an epoch's last step, and comes before a step whose learners' full batch sizes differ from the
    last step's: ``z <- z + eta * sum_i p_i (w_i - z)`` with ``p_i = b_i / sum_j b_j``, ``b_i`` learner ``i``'s
    samples since the last averaging. ``lr_follows_batch``: a learner whose full batch is ``B`` steps at
    ``lr * B / 8``."""
    z = copy.deepcopy(net)
    x_all, y_all = dataset.tensors
    learners: list[nn.Module] = []
    samples: list[int] = []
    last_sizes: list[int] = []

    def average() -> None:
        with torch.no_grad():
            for index, p in enumerate(z.parameters()):
                moves = [list(learner.parameters())[index] - p for learner in learners]
                p += eta * sum(b / sum(samples) * move for b, move in zip(samples, moves))
        learners.clear()

    for epoch_steps in steps:
        offset = 0
        for step, sizes in enumerate(epoch_steps):
            full = [max(size, 8) for size in sizes]  # (only the epoch's last batch may be short, below 8)
            if learners and full != last_sizes:
                average()
            if not learners:
                learners[:], samples[:], taken = [copy.deepcopy(z) for _ in sizes], [0] * len(sizes), 0
            last_sizes = full
            for i, size in enumerate(sizes):
                learners[i].zero_grad()
                x, y = x_all[offset : offset + size], y_all[offset : offset + size]
                offset += size
                nn.functional.cross_entropy(learners[i](x), y).backward()
                with torch.no_grad():
                    for p in learners[i].parameters():
                        p -= (lr * full[i] / 8 if lr_follows_batch else lr) * p.grad
                samples[i] += size
            taken += 1
            if taken == period or step == len(epoch_steps) - 1:
                average()
    return [p.detach() for p in z.parameters()]


def _steps_by_epoch(ranks: list[dict], per_step: list[list[int]], samples: int, epochs: int) -> list[list[list[int]]]:
    """Each epoch's steps' learner batch sizes, having checked that the epoch trained on the first samples of the
    order once each and that what is left fills no group of (13, 13, 13, 8), not even with a short last batch."""
    dataset_inputs = make_data(num_samples=samples).tensors[0]
    steps: list[list[list[int]]] = []
    for epoch in range(epochs):
        seen = torch.cat([ranks[0]["seen"][epoch], ranks[1]["seen"][epoch]])
        matches = (seen.unsqueeze(1) == dataset_inputs.unsqueeze(0)).all(-1).sum(0)  # per sample of the order
        trained = len(seen)
        assert torch.equal(matches[:trained], torch.ones(trained, dtype=torch.long)) and not matches[trained:].any()
        assert samples - trained < 3 * 13 + 1
        steps.append([])
        while sum(map(sum, steps[-1])) < trained:
            steps[-1].append(per_step[sum(map(len, steps))])
        assert sum(map(sum, steps[-1])) == trained
    assert sum(map(len, steps)) == len(per_step)
    return steps


def _larger_batches_run(out: Path, *extra: str) -> list[dict]:
    """K = 4, rank 1 5x slower per batch of 8, max_batch_scale=2."""
    return _heterogeneous_run(out, "--max-batch-scale", "2", *extra, k=2, costs="1,5")


@pytest.fixture(scope="module")
def larger_batches(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _larger_batches_run(tmp_path_factory.mktemp("larger_batches"), "--epochs", "4")


def test_a_rank_too_slow_to_balance_by_learners_hands_larger_batches_to_the_fast_one(
    larger_batches: list[dict],
) -> None:
    """K = 4 learners, rank 1 5x slower per batch of 8: the best split, (3, 1), would leave rank 0 idle 2/5 of each
    step, so with max_batch_scale=2 its learners take floor(8 x 5/3) = 13 samples. Every epoch still trains on
    the order's samples once each (its tail that fills no group skipped), z weighs each learner by its samples
    exactly as the reference does, and the next windows keep that layout."""
    epochs, samples, ranks = 4, 188, larger_batches
    assert [(split, sizes) for _, split, sizes in ranks[0]["splits"]] == [((2, 2), None), ((3, 1), (13, 8))]
    per_step = [a + b for a, b in zip(ranks[0]["batch_sizes"], ranks[1]["batch_sizes"], strict=True)]
    assert {tuple(sizes) for sizes in per_step} >= {(8, 8, 8, 8), (13, 13, 13, 8)}
    dataset = make_data(num_samples=samples)
    steps = _steps_by_epoch(ranks, per_step, samples, epochs)
    for a, b in zip(ranks[0]["z"], ranks[1]["z"], strict=True):
        assert torch.equal(a, b)
    expected = reference_by_batch_sizes(make_net(), dataset, steps, lr=0.1, eta=2.0)
    for actual, wanted in zip(ranks[0]["z"], expected, strict=True):
        torch.testing.assert_close(actual, wanted)


def test_each_epoch_after_a_change_of_batch_sizes_is_counted_before_the_callbacks_see_it(
    larger_batches: list[dict],
) -> None:
    """Epoch 0 changes from 6 steps an epoch at (8, 8, 8, 8) to 4 at (13, 13, 13, 8): from epoch 1 on, Lightning's
    count of the epoch's steps that the callbacks read at its start (a progress bar's total) is its steps (before:
    epoch 1 showed epoch 0's count)."""
    for rank in larger_batches:
        counts = rank["epoch_counts"]
        assert len(counts) == 4 and counts[1][1] == 4
        assert all(at_start == steps for at_start, steps in counts[1:])


def test_larger_batches_keep_lightnings_epoch_length_validation_and_the_local_steps_weights(tmp_path: Path) -> None:
    """Validation after every epoch while the epochs' steps change with the batch sizes (6 a step at (8, 8, 8, 8),
    4 at (13, 13, 13, 8)): Lightning's count of each epoch's steps follows, so each epoch ends and validates.
    With averaging_period=2, the steps since the last averaging are averaged where the layout changes (the balancer's
    larger batches; k=3 per device asked for after step 8, which the balancer then splits and sizes anew), each
    learner weighed by its samples (13 or 8 a step), and the values are the reference's."""
    epochs, samples = 4, 188
    ranks = _larger_batches_run(
        tmp_path / "run", "--epochs", str(epochs), "--validate", "--averaging-period", "2", "--change-k-at", "8:3"
    )
    assert ranks[0]["validation_batches"] == ranks[1]["validation_batches"] == epochs * 8  # (8 batches on each rank)
    per_step = [a + b for a, b in zip(ranks[0]["batch_sizes"], ranks[1]["batch_sizes"], strict=True)]
    steps = _steps_by_epoch(ranks, per_step, samples, epochs)
    # the change of k came an odd number of steps into a run of larger batches: steps were pending at it
    epoch, change = next(
        (e, i) for e, epoch_steps in enumerate(steps) for i, s in enumerate(epoch_steps) if len(s) == 6
    )
    before = list(itertools.takewhile(lambda sizes: sizes == [13, 13, 13, 8], reversed(steps[epoch][:change])))
    assert len(before) % 2 == 1
    for a, b in zip(ranks[0]["z"], ranks[1]["z"], strict=True):
        assert torch.equal(a, b)
    expected = reference_by_batch_sizes(make_net(), make_data(num_samples=samples), steps, lr=0.1, eta=2.0, period=2)
    for actual, wanted in zip(ranks[0]["z"], expected, strict=True):
        torch.testing.assert_close(actual, wanted)


def test_ranks_whose_loaders_batch_differently_fail_before_training(tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    result = _run(tmp_path, ANY_LAUNCHER, "2", "--heterogeneous", "1,1", "--samples", "96", "--uneven-batch-sizes")
    assert result.returncode != 0
    assert "needs the same batch_size, drop_last and shuffle" in result.stderr
    assert "(batch_size, drop_last, shuffle) = [(8, False, False), (4, False, False)]" in result.stderr
    assert not list(tmp_path.glob("rank*.pt"))  # no rank trained


def test_a_loader_whose_batch_size_is_given_by_position_is_routed() -> None:
    """``DataLoader(dataset, 8)`` made in ``train_dataloader``: re-made over the routed batches all the same."""

    class PositionalLoader(Classifier):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(make_data(num_samples=64), 8)

    model = PositionalLoader(lr=0.1)
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=2, heterogeneous=True), max_epochs=1)
    fit.fit(model)
    assert isinstance(fit.train_dataloader, RoutedBatchLoader)
    assert fit.global_step == 4 and fit.train_dataloader.batch_size == 8


def test_with_lr_follows_batch_a_larger_batch_steps_at_a_larger_learning_rate(tmp_path: Path) -> None:
    """Adaptive SGD's lr_i = lr b_i / b: rank 0's learners at 13 samples step at 13/8 of the learning rate, rank 1's
    at 8 at the learning rate; z is the reference's, and not the one at the user's learning rate everywhere."""
    epochs, samples = 4, 188
    ranks = _larger_batches_run(tmp_path / "run", "--epochs", str(epochs), "--lr-follows-batch")
    per_step = [a + b for a, b in zip(ranks[0]["batch_sizes"], ranks[1]["batch_sizes"], strict=True)]
    steps = _steps_by_epoch(ranks, per_step, samples, epochs)
    dataset = make_data(num_samples=samples)
    expected = reference_by_batch_sizes(make_net(), dataset, steps, lr=0.1, eta=2.0, lr_follows_batch=True)
    for actual, wanted in zip(ranks[0]["z"], expected, strict=True):
        torch.testing.assert_close(actual, wanted)
    at_the_users_lr = reference_by_batch_sizes(make_net(), dataset, steps, lr=0.1, eta=2.0)
    assert not all(torch.allclose(a, b) for a, b in zip(ranks[0]["z"], at_the_users_lr))


def test_learning_rates_scaled_inside_the_block_only() -> None:
    """Each param group's own lr times the factor inside, the values from before after (also after an error)."""
    optimizer = torch.optim.SGD([{"params": [nn.Parameter(torch.zeros(1))], "lr": 0.25}, {"params": [], "lr": 0.5}])
    with learning_rates_scaled(optimizer, 1.5):
        assert [group["lr"] for group in optimizer.param_groups] == [0.375, 0.75]
    assert [group["lr"] for group in optimizer.param_groups] == [0.25, 0.5]
    with pytest.raises(RuntimeError, match="inside"), learning_rates_scaled(optimizer, 2.0):
        raise RuntimeError("inside")
    assert [group["lr"] for group in optimizer.param_groups] == [0.25, 0.5]
    with pytest.raises(ValueError, match="lr_follows_batch must be True or False, got 'yes'"):
        SpeedBalancer(lr_follows_batch="yes")  # type: ignore[arg-type]


def test_a_checkpoint_saved_inside_a_step_at_scaled_learning_rates_holds_the_param_groups_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With lr_follows_batch, hooks inside the optimizer step see the step's learning rate (here 1.5 times the user's),
    but a checkpoint saved there holds the param groups' own, centrally and per rank: a resume scales it once, not
    twice. The next step's hooks see 1.5 times the user's again."""
    monkeypatch.setattr(LearnerLayouts, "learning_rate_scale", lambda self: 1.5)

    class SaveInsideTheStep(Callback):
        def __init__(self) -> None:
            self.seen: list[float] = []

        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            self.seen.append(optimizer.param_groups[0]["lr"])
            trainer.save_checkpoint(tmp_path / f"inside{trainer.global_step}.ckpt")

    saving = SaveInsideTheStep()
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=2, heterogeneous=True), max_steps=2, callbacks=[saving])
    fit.fit(Classifier(lr=0.1), loader(make_data(num_samples=64), batch_size=8))
    assert saving.seen == [0.1 * 1.5, 0.1 * 1.5]
    for step in (0, 1):
        checkpoint = torch.load(tmp_path / f"inside{step}.ckpt", weights_only=False)
        assert [group["lr"] for group in checkpoint["optimizer_states"][0]["param_groups"]] == [0.1]
        (rank,) = checkpoint["crossbow"]["ranks"]
        assert [group["lr"] for group in rank["optimizer"]["param_groups"]] == [0.1]
    assert [group["lr"] for group in fit.optimizers[0].param_groups] == [0.1]


def test_a_new_layout_that_leaves_much_of_the_epoch_in_progress_out_says_so(tmp_path: Path) -> None:
    """drop_last: epoch 0 makes groups of 32 samples at (8, 8, 8, 8) until the balancer's change, then of 47 at
    (13, 13, 13, 8) (3 and 1 here: 45 samples left, short of a group): a warning says how many this epoch skips
    where that is over a tenth (and that later epochs, 4 groups of 47 = 188, skip none)."""
    ranks = _larger_batches_run(tmp_path / "run", "--epochs", "2", "--drop-last")
    warned = torch.load(tmp_path / "run" / "rank0_warnings.pt")
    skipped = [w for w in warned if "with the new learners per rank (3, 1) and per-replica batch sizes (13, 8)" in w]
    assert len(skipped) == 1 and "of this epoch's 188 samples fill no step" in skipped[0]
    left_out = 188 - len(ranks[0]["seen"][0]) - len(ranks[1]["seen"][0])
    assert f"the last {left_out} of this epoch's" in skipped[0] and "(in later epochs 0)" in skipped[0]
    assert len(ranks[0]["seen"][1]) + len(ranks[1]["seen"][1]) == 188


def test_a_resume_carries_on_the_larger_batches_exactly(tmp_path: Path, larger_batches: list[dict]) -> None:
    """Saved after epoch 2 and resumed to epoch 4: the same learners and batch sizes, bitwise the same z."""
    checkpoint = str(tmp_path / "half.ckpt")
    _larger_batches_run(tmp_path / "half", "--epochs", "2", "--save", checkpoint)
    resumed = _larger_batches_run(tmp_path / "resumed", "--epochs", "4", "--resume", checkpoint)
    assert resumed[0]["splits"] == larger_batches[0]["splits"]  # (the layouts' history carries on too)
    assert resumed[0]["splits"][-1] == (2, (3, 1), (13, 8))
    steps = len(resumed[0]["batch_sizes"])
    for rank in range(2):
        assert resumed[rank]["batch_sizes"] == larger_batches[rank]["batch_sizes"][-steps:]
        for x, y in zip(larger_batches[rank]["z"], resumed[rank]["z"], strict=True):
            assert torch.equal(x, y)
    # Resumed with the training loader made in configure_optimizers (estimated_stepping_batches), before the
    # restore: Lightning's count of each epoch's steps follows the restored batch sizes, so every epoch validates.
    counted = _larger_batches_run(
        tmp_path / "counted", "--epochs", "4", "--resume", checkpoint, "--reads-estimated-steps", "--validate"
    )
    assert counted[0]["validation_batches"] == 2 * 8 and counted[0]["batch_sizes"] == resumed[0]["batch_sizes"]
    # Resumed where larger batches are not allowed (max_batch_scale=1): the learners start at the DataLoader's batch.
    out = tmp_path / "not_allowed"
    out.mkdir()
    result = _run(
        out, ANY_LAUNCHER, "2", "--heterogeneous", "1,5", "--samples", "188", "--epochs", "4", "--resume", checkpoint,
        "--max-batch-scale", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    warned = torch.load(out / "rank0_warnings.pt")
    assert any("per-replica batch sizes (13, 8) were sized for a DataLoader batch size of 8" in w for w in warned)
    assert torch.load(out / "rank0.pt")["batch_sizes"][0] == [8, 8, 8]


def test_a_mid_epoch_resume_goes_on_at_its_place_and_counts_the_epoch_at_the_restored_batch_sizes(
    tmp_path: Path,
) -> None:
    """Saved at step 7, within epoch 1 (4 steps an epoch at (13, 13, 13, 8)) and resumed: the epoch goes on at its
    place in the common order, its steps left counted at the restored layout, also where the loader was made in
    configure_optimizers, before the restore (Lightning had counted 6 steps, at the DataLoader's batch size): both
    resumed fits end at the step, the batches and the z of the fit that went on, bitwise."""
    checkpoint = str(tmp_path / "step7.ckpt")
    straight = _larger_batches_run(tmp_path / "straight", "--epochs", "3", "--save-at", f"7:{checkpoint}")
    resumed = _larger_batches_run(tmp_path / "resumed", "--epochs", "3", "--resume", checkpoint)
    counted = _larger_batches_run(
        tmp_path / "counted", "--epochs", "3", "--resume", checkpoint, "--reads-estimated-steps"
    )
    assert resumed[0]["global_step"] == counted[0]["global_step"] == straight[0]["global_step"] == 7 + 2 + 4
    for rank in range(2):
        rest_of_epoch_1 = resumed[rank]["seen"][1]  # (the samples of epoch 1's steps 8 and 9)
        assert len(rest_of_epoch_1) > 0
        assert torch.equal(rest_of_epoch_1, straight[rank]["seen"][1][-len(rest_of_epoch_1) :])
        for run in (resumed, counted):
            for x, y in zip(run[rank]["z"], straight[rank]["z"], strict=True):
                assert torch.equal(x, y)


def test_a_loader_made_in_configure_optimizers_is_routed_too(tmp_path: Path, four_epochs: list[dict]) -> None:
    """``configure_optimizers`` reading ``trainer.estimated_stepping_batches`` (a OneCycleLR set-up) makes the training
    loader during the strategy's set-up, and Lightning keeps it: it is routed as any other (before, it was the
    uniform path's, and every rank trained every sample), and the estimate counts the steps of the common order."""
    ranks = _heterogeneous_run(tmp_path / "run", "--epochs", "4", "--reads-estimated-steps")
    assert ranks[0]["estimated_steps"] == 4 * 3  # 24 batches of the common order per epoch, 8 per step
    for rank in range(2):
        assert ranks[rank]["splits"] == four_epochs[rank]["splits"]
        assert ranks[rank]["group_sizes"] == four_epochs[rank]["group_sizes"]
        for x, y in zip(ranks[rank]["z"], four_epochs[rank]["z"], strict=True):
            assert torch.equal(x, y)


def test_equal_devices_keep_the_even_split_and_the_uniform_rule(tmp_path: Path) -> None:
    ranks = _heterogeneous_run(tmp_path / "run", "--epochs", "2", costs="1,1")
    assert [split for _, split, _ in ranks[0]["splits"]] == [(4, 4)]
    assert ranks[0]["group_sizes"] == ranks[1]["group_sizes"] == [4] * 6
    expected = reference_weighted_averaging(make_net(), make_data(num_samples=188), 8, 2, lr=0.1, eta=2.0)
    for actual, wanted in zip(ranks[1]["z"], expected, strict=True):
        torch.testing.assert_close(actual, wanted)


def test_with_lightnings_distributed_sampler_validation_is_shared_and_training_routed(tmp_path: Path) -> None:
    """With the Trainer's default use_distributed_sampler=True, the validation batches are split between the
    ranks as in uniform mode (8 per epoch: 4 each), and the training data is still routed from one order that
    shuffles as Lightning's DistributedSampler does (the injected sampler's shuffle and seed): each sample once
    per epoch, in another order every epoch."""
    epochs = 2
    ranks = _heterogeneous_run(tmp_path / "run", "--epochs", str(epochs), "--distributed-sampler", "--validate")
    assert ranks[0]["validation_batches"] == ranks[1]["validation_batches"] == epochs * 4
    dataset_inputs = make_data(num_samples=188).tensors[0]
    orders = []
    for epoch in range(epochs):
        seen = torch.cat([ranks[0]["seen"][epoch], ranks[1]["seen"][epoch]])
        matches = (seen.unsqueeze(1) == dataset_inputs.unsqueeze(0)).all(-1)
        assert torch.equal(matches.sum(0), torch.ones(188, dtype=torch.long))  # each sample once
        orders.append(matches.float().argmax(1))
    assert not torch.equal(orders[0], orders[1])  # shuffled anew each epoch
    for a, b in zip(ranks[0]["z"], ranks[1]["z"], strict=True):
        assert torch.equal(a, b)


def test_heterogeneous_resume_carries_on_with_the_measured_split_exactly(
    tmp_path: Path, four_epochs: list[dict]
) -> None:
    straight = four_epochs
    checkpoint = str(tmp_path / "half.ckpt")
    _heterogeneous_run(tmp_path / "half", "--epochs", "2", "--save", checkpoint)
    resumed = _heterogeneous_run(tmp_path / "half", "--epochs", "4", "--resume", checkpoint)
    assert resumed[0]["splits"] == straight[0]["splits"] and resumed[0]["splits"][-1][1] == (6, 2)  # not an even one
    for rank in range(2):
        assert resumed[rank]["replicas_per_device"] == straight[rank]["replicas_per_device"]
        for x, y in zip(straight[rank]["z"], resumed[rank]["z"], strict=True):
            assert torch.equal(x, y)


def test_a_resume_in_the_balancers_window_goes_on_with_its_measurements_and_schedules_as_the_run_that_went_on(
    tmp_path: Path, four_epochs: list[dict]
) -> None:
    """Saved after the first step of the balancer's first window (2 steps; rank 1 3x slower, a virtual clock) and
    resumed: the window goes on with the step measured before the save, so the split changes at the same step as in
    the run that went on, and the resumed fit is that run bitwise, its history of layouts too. (Before, the window
    started afresh and the change came two steps later.) A resume saved after the next window carries on its
    measurements: the balancer ends with the models the run that went on fitted, its first window's (at the even
    split, u = 4 learner-batches on each rank) included, which the resumed fit never measured."""
    straight = four_epochs
    assert [step for step, _, _ in straight[0]["splits"]] == [0, 2]
    early, late = str(tmp_path / "step1.ckpt"), str(tmp_path / "step8.ckpt")
    _heterogeneous_run(tmp_path / "saving", "--epochs", "4", "--save-at", f"1:{early}", "--save-at", f"8:{late}")
    for checkpoint in (early, late):
        resumed = _heterogeneous_run(tmp_path / "resumed", "--epochs", "4", "--resume", checkpoint)
        for rank in range(2):
            assert resumed[rank]["splits"] == straight[rank]["splits"]
            assert resumed[rank]["group_sizes"][-3:] == straight[rank]["group_sizes"][-3:]
            for x, y in zip(straight[rank]["z"], resumed[rank]["z"], strict=True):
                assert torch.equal(x, y)
            assert resumed[rank]["measured"] == straight[rank]["measured"]
            assert 4.0 in resumed[rank]["measured"][0]
    saved = torch.load(late, weights_only=False)["crossbow"]["ranks"]
    measured = [[[4.0, 4.0], [6.0, 6.0]], [[4.0, 12.0], [2.0, 6.0]]]  # (per rank: learner-batches u, seconds)
    assert [rank["balancer"]["measured"] for rank in saved] == [measured, measured]


def _save_while_a_change_is_scheduled_and_resume(out: Path, *extra: str) -> tuple[list[dict], list[dict]]:
    """A 4-epoch run (K = 8, rank 1 3x slower) that asks for k=3 (K = 6) once global step 4 ends and saves a
    checkpoint right then, before the new split is in force; and a run resumed from that checkpoint."""
    checkpoint = str(out / "change.ckpt")
    straight = _heterogeneous_run(
        out / "straight", "--epochs", "4", "--change-k-at", "4:3", "--save", checkpoint, *extra
    )
    resumed = _heterogeneous_run(out / "resumed", "--epochs", "4", "--resume", checkpoint, *extra)
    return straight, resumed


@pytest.fixture(scope="module")
def change_scheduled(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[dict]]:
    return _save_while_a_change_is_scheduled_and_resume(tmp_path_factory.mktemp("change_scheduled"))


def test_a_resume_carries_on_a_change_of_split_scheduled_at_the_checkpoint(
    change_scheduled: tuple[list[dict], list[dict]],
) -> None:
    """The resumed fit trains at the split the checkpointed run had scheduled (K = 6, split by the speeds measured),
    from its first step, as the run that went on did from the step after the save; not at the split in force."""
    straight, resumed = change_scheduled
    step, scheduled, _ = straight[0]["splits"][-1]
    assert step == 4 and sum(scheduled) == 6 and scheduled != straight[0]["splits"][-2][1]
    assert resumed[0]["splits"][-1] == (4, scheduled, None)
    for rank in range(2):
        assert straight[rank]["group_sizes"][4:] == [scheduled[rank]] * (len(straight[rank]["group_sizes"]) - 4)
        assert resumed[rank]["group_sizes"] == [scheduled[rank]] * len(resumed[rank]["group_sizes"])
        assert resumed[rank]["replicas_per_device"] == scheduled[rank]


def test_a_resume_with_a_loader_that_saves_its_place_goes_on_at_the_common_orders_place_as_another_loader_does(
    tmp_path: Path, change_scheduled: tuple[list[dict], list[dict]]
) -> None:
    """Each rank's loader takes its own share of the common order, so the place that rank 0's loader saved is not
    rank 1's: resumed there, the ranks disagreed on the steps left and one waited for the other forever. That place
    is not loaded; the strategy's place in the common order is: the resumed fit is that of a loader that does not
    save its place, bitwise, without a warning of a place not restored, from an epoch's middle (step 4: the second
    of epoch 1's) or its last step."""
    epoch_end = str(tmp_path / "epoch_end.ckpt")
    _, resumed = _save_while_a_change_is_scheduled_and_resume(
        tmp_path, "--resumable-loader", "--save-at", f"3:{epoch_end}"
    )
    _, expected = change_scheduled
    for rank in range(2):
        assert resumed[rank]["global_step"] == expected[rank]["global_step"]
        assert resumed[rank]["group_sizes"] == expected[rank]["group_sizes"]
        for x, y in zip(resumed[rank]["z"], expected[rank]["z"], strict=True):
            assert torch.equal(x, y)
    not_restored = "holds no place"
    assert not any(not_restored in message for message in torch.load(tmp_path / "resumed" / "rank0_warnings.pt"))
    _heterogeneous_run(tmp_path / "from_epoch_end", "--epochs", "4", "--resume", epoch_end, "--resumable-loader")
    assert not any(not_restored in message for message in torch.load(tmp_path / "from_epoch_end" / "rank0_warnings.pt"))


def test_a_split_scheduled_at_an_epochs_last_step_starts_at_the_same_group_after_a_resume(
    tmp_path: Path, four_epochs: list[dict]
) -> None:
    """The first window ends before step 3, the last of epoch 0 (3 steps an epoch), whose group the loader has
    drawn ahead: its split is scheduled from the first group no rank has drawn, the first of epoch 1, and the
    checkpoint of step 3 holds it as a change not in force yet. A fit resumed from it starts with that split."""
    checkpoint = str(tmp_path / "step3.ckpt")
    straight = _heterogeneous_run(tmp_path / "straight", "--epochs", "4", "--save-at", f"3:{checkpoint}")
    assert straight[0]["group_sizes"] == four_epochs[0]["group_sizes"]  # (saving changed nothing)
    resumed = _heterogeneous_run(tmp_path / "resumed", "--epochs", "4", "--resume", checkpoint)
    for rank in range(2):
        assert straight[rank]["group_sizes"][2] == 4 and straight[rank]["group_sizes"][3] != 4  # (as described)
        assert resumed[rank]["group_sizes"] == straight[rank]["group_sizes"][3:]
        for x, y in zip(resumed[rank]["z"], straight[rank]["z"], strict=True):
            assert torch.equal(x, y)


def test_heterogeneous_mode_refuses_what_it_cannot_route_or_accumulate() -> None:
    dataset = make_data(num_samples=32)
    with_replacement = DataLoader(
        dataset, batch_size=8, sampler=torch.utils.data.RandomSampler(dataset, replacement=True)
    )
    with pytest.raises(ValueError, match="without replacement over the whole dataset"):
        trainer(strategy=CrossbowStrategy(replicas_per_device=2, heterogeneous=True)).fit(
            Classifier(), with_replacement
        )
    strategy = CrossbowStrategy(replicas_per_device=2, heterogeneous=True)
    with pytest.raises(ValueError, match="cannot be combined with accumulate_grad_batches > 1"):
        trainer(strategy=strategy, accumulate_grad_batches=2).fit(Classifier(), loader(dataset))


def test_heterogeneous_mode_refuses_an_iterable_dataset() -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):  # noqa: ANN204
            return iter(make_data(num_samples=32))

    strategy = CrossbowStrategy(replicas_per_device=2, heterogeneous=True)
    with pytest.raises(ValueError, match="needs a map-style dataset"):
        trainer(strategy=strategy).fit(Classifier(), DataLoader(Stream(), batch_size=8))


def test_ranks_with_different_datasets_fail_before_training(tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    result = _run(tmp_path, ANY_LAUNCHER, "2", "--heterogeneous", "1,1", "--samples", "96", "--uneven-datasets")
    assert result.returncode != 0
    assert (
        "ValueError: crossbow: heterogeneous=True needs the whole dataset and the same seed on every rank"
        in result.stderr
    )
    assert "(dataset length, PL_GLOBAL_SEED) = [(96, 0), (88, 0)]" in result.stderr
    assert not list(tmp_path.glob("rank*.pt"))  # no rank trained


def test_a_collective_in_training_step_is_refused_on_every_rank(tmp_path: Path) -> None:
    """``self.all_gather`` in ``training_step``: each rank runs its own number of replicas, one after another (it
    cannot run fused), so the collectives would not pair up once the split is uneven (rank 0 gathered for its
    extra replicas while rank 1 waited in the averaging, until the timeout). Refused at the first step, on both."""
    result = _run(tmp_path, ANY_LAUNCHER, "3", "--heterogeneous", "1,3", "--samples", "96", "--gathers-in-step")
    assert result.returncode != 0
    assert (
        "crossbow: training_step called the strategy's all_gather (self.all_gather, say) under heterogeneous=True"
        in result.stderr
    )
    assert not list(tmp_path.glob("rank*.pt"))  # no rank trained


class _GathersInStep(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        gathered = self.all_gather(batch[0])
        return super().training_step(batch, batch_idx) + 0.0 * gathered.sum()


def test_a_collective_in_training_step_on_one_process_trains_as_in_uniform_mode() -> None:
    """On one process nothing is left to pair up: heterogeneous mode computes what the uniform path computes."""
    ends = []
    for heterogeneous in (False, True):
        model = _GathersInStep()
        strategy = CrossbowStrategy(replicas_per_device=2, heterogeneous=heterogeneous, engine="sequential")
        trainer(strategy=strategy, max_epochs=1).fit(model, loader(make_data(num_samples=64)))
        ends.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*ends, strict=True))


def test_speed_balancer_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="every must be a positive int"):
        SpeedBalancer(every=0)
    with pytest.raises(ValueError, match=r"min_gain must be a number in \[0, 1\)"):
        SpeedBalancer(min_gain=1.0)
    with pytest.raises(ValueError, match=r"min_gain must be a number in \[0, 1\), got '0.1'"):
        SpeedBalancer(min_gain="0.1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"remember must be a positive int \(1, 2, 3, ...\) \(distinct k per rank\)"):
        SpeedBalancer(remember=True)
    with pytest.raises(ValueError, match="clock must be a function returning seconds"):
        SpeedBalancer(clock=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="heterogeneous must be True, False or a SpeedBalancer"):
        CrossbowStrategy(heterogeneous="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not apply to algorithm='gossip'"):
        CrossbowStrategy(heterogeneous=True, algorithm="gossip")


def test_a_second_fit_starts_again_from_the_mean_k_at_an_even_split(tmp_path: Path) -> None:
    """After a fit that split the learners (6, 2), the same strategy fits again: every rank is configured alike
    (k = 4, the mean), starts at (4, 4), and the balancer finds (6, 2) again."""
    ranks = _heterogeneous_run(tmp_path / "run", "--epochs", "2", "--second-fit")
    assert [split for _, split, _ in ranks[0]["splits"]] == [(4, 4), (6, 2)]
    assert ranks[0]["global_step"] == 3 * 3
    for a, b in zip(ranks[0]["z"], ranks[1]["z"], strict=True):
        assert torch.equal(a, b)


def test_the_tuner_sets_the_mean_k_and_the_balancer_splits_it(tmp_path: Path) -> None:
    """The tuner grows K = k x 2 while the balancer gives the 3x faster rank most learners; every step,
    both ranks cut the same group of the common order, and no sample is trained on twice in an epoch."""
    ranks = _heterogeneous_run(tmp_path / "run", "--epochs", "3", "--tune", k=1)
    sizes = [ranks[rank]["group_sizes"] for rank in range(2)]
    totals = [a + b for a, b in zip(*sizes, strict=True)]
    assert totals[0] == 2 and max(totals) > 2, "the tuner never grew k"  # from k=1 per device (K=2) up to k=3
    assert any(a != b for a, b in zip(*sizes)), "the balancer never split the learners unevenly"
    for a, b in zip(ranks[0]["z"], ranks[1]["z"], strict=True):
        assert torch.equal(a, b)
    dataset_inputs = make_data(num_samples=188).tensors[0]
    for epoch in range(3):
        seen = torch.cat([ranks[0]["seen"][epoch], ranks[1]["seen"][epoch]])
        matches = (seen.unsqueeze(1) == dataset_inputs.unsqueeze(0)).all(-1)
        assert int(matches.sum(0).max()) == 1 and len(seen) > 188 - 8 * max(totals)


class ChangeKAt(Callback):
    """Sets replicas_per_device to ``k`` once, before step ``step``; records the inputs trained on per epoch,
    and the epochs that ended with their validation."""

    def __init__(self, step: int, k: int) -> None:
        self.step, self.k = step, k
        self.seen: dict[int, list[Tensor]] = {}
        self.validated: list[int] = []

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self.validated.append(trainer.current_epoch)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.seen.setdefault(trainer.current_epoch, []).extend(x for x, _ in batch)

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.strategy.set_replicas_per_device(self.k)


def test_a_k_change_with_loader_workers_drawing_ahead_keeps_every_sample_once() -> None:
    """A worker prefetches indices of later groups; the new K starts at a group no one has drawn, and the
    epoch still trains on every sample once (but a last group of fewer than K batches)."""
    dataset = make_data(num_samples=160)  # 20 batches: 5 groups at K=4, then K=3 ...
    recorder = ChangeKAt(step=2, k=3)
    strategy = CrossbowStrategy(replicas_per_device=4, heterogeneous=True)
    train = loader(dataset, num_workers=1, prefetch_factor=4)
    trainer(strategy=strategy, max_epochs=2, callbacks=[recorder]).fit(Classifier(), train, loader(make_data(16)))
    # Lightning counted each epoch's steps right, groups drawn ahead at the old K included: validation ran at
    # the end of both epochs, the one with the change too.
    assert recorder.validated == [0, 1]
    inputs = dataset.tensors[0]
    for epoch, rows in recorder.seen.items():
        seen = torch.cat(rows)
        counts = (seen.unsqueeze(1) == inputs.unsqueeze(0)).all(-1).sum(0)
        assert int(counts.max()) == 1, f"epoch {epoch}: a sample was trained on twice"
        assert len(seen) >= 160 - 8 * 2  # at most K-1 = 2 batches skipped at the epoch's end
    assert strategy.replicas_per_device == 3
