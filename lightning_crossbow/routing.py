r"""Routing by speed (Adaptive SGD): every rank takes its share of one common order of batches.

Every rank draws the same order of the whole training set (the same seed and epoch). The order is
cut into batches of the DataLoader's batch size ``b`` and the batches into *groups*, one per
optimizer step. With the *split* ``(k_0, ..., k_{R-1})`` in force at group ``g`` (``K_g = sum_r k_r``
learners in all), group ``g`` is the next ``K_g`` batches of the order and rank ``r`` takes

.. math::

    \text{batches } o_g + \textstyle\sum_{q<r} k_q, \ \dots, \ o_g + \sum_{q \le r} k_q - 1,
    \qquad o_{g+1} = o_g + K_g

one per local learner. However the split changes, an epoch sees every batch once, on exactly one
learner, and a last group of fewer than ``K_g`` batches is skipped on every rank alike.

Splits change at group boundaries that no rank has reached yet, not even to find that the epoch has
no room for it (:meth:`RoutingPlan.schedule`), so the routing stays consistent when DataLoader workers
have drawn indices ahead of training.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence
from typing import Optional

from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

Split = tuple[int, ...]


class RoutingPlan:
    """The splits in force from each group on, and where this rank's sampler and training loop are.

    Groups are counted from the start of fit, across epochs. ``groups_drawn`` counts the groups this
    rank's :class:`RoutedSampler` has started to draw indices for, or found no room for at an epoch's end
    (it may run ahead of training by the DataLoader's prefetching); ``groups_trained`` those its
    training loop has taken.
    """

    def __init__(self, split: Sequence[int], rank: int) -> None:
        check_split(split)
        if not 0 <= rank < len(split):
            raise ValueError(f"rank {rank} has no share in a split over {len(split)} ranks.")
        self.rank = rank
        self._starts: list[int] = [0]
        self._splits: list[Split] = [tuple(split)]
        self.groups_drawn = 0
        self.groups_trained = 0
        #: Batch sizes of the groups whose batches are not all full (a short last batch of the order).
        self.uneven_groups: dict[int, tuple[int, ...]] = {}

    def split_at(self, group: int) -> Split:
        """The split in force at ``group``."""
        return self._splits[bisect.bisect_right(self._starts, group) - 1]

    def share(self, group: int) -> tuple[int, int]:
        """``(first, count)``: this rank's learners are ``first .. first + count - 1`` of the group's ``K``."""
        split = self.split_at(group)
        return sum(split[: self.rank]), split[self.rank]

    @property
    def latest(self) -> Split:
        """The split of the last change scheduled (in force now or soon)."""
        return self._splits[-1]

    @property
    def latest_from(self) -> int:
        """The group from which :attr:`latest` is in force."""
        return self._starts[-1]

    def schedule(self, split: Sequence[int], from_group: int) -> None:
        """Puts ``split`` in force from ``from_group`` on; every rank must schedule the same.

        ``from_group`` must be one that no rank has started to draw (see the strategy: the maximum of
        ``groups_drawn`` over ranks), else the ranks would cut that group differently.
        """
        check_split(split, len(self.latest))
        if from_group < self.groups_drawn:
            raise ValueError(
                f"group {from_group} is already drawn; a new split can start at {self.groups_drawn} or later."
            )
        while len(self._starts) > 1 and self._starts[-1] >= from_group:  # superseded changes no rank has reached
            self._starts.pop()
            self._splits.pop()
        if tuple(split) == self._splits[-1]:
            return
        if from_group == self._starts[-1]:  # (only the first entry can start there)
            self._splits[-1] = tuple(split)
            return
        self._starts.append(from_group)
        self._splits.append(tuple(split))

    def restart(self, split: Sequence[int]) -> None:
        """A new fit (or a resume): ``split`` from the first group on, counters at zero."""
        check_split(split, len(self.latest))
        self._starts, self._splits = [0], [tuple(split)]
        self.groups_drawn = self.groups_trained = 0
        self.uneven_groups.clear()

    def learner_weights(self, group: int, full_groups_before: int = 0, batch_size: int = 0) -> Optional[list[float]]:
        """``K p_i`` for this rank's learners of ``group``, with ``p_i = b_i / sum_j b_j`` over all ``K``
        learners (Adaptive SGD's normalized merging) and ``b_i`` learner ``i``'s samples since the last
        synchronisation: its batch of ``group`` after ``full_groups_before`` groups of full batches of
        ``batch_size`` (the local steps of an averaging period, at the same split); ``None`` when all batches
        are full (every ``K p_i = 1``)."""
        sizes = self.uneven_groups.get(group)
        if sizes is None:
            return None
        first, count = self.share(group)
        samples = [full_groups_before * batch_size + size for size in sizes]
        total = sum(samples)
        return [len(samples) * b / total for b in samples[first : first + count]]


def check_split(split: Sequence[int], ranks: Optional[int] = None) -> None:
    """Raises unless ``split`` gives every rank (``ranks`` of them, when given) a positive number of learners."""
    if not split or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in split):
        raise ValueError(f"A split gives every rank a positive int number of learners, got {tuple(split)!r}.")
    if ranks is not None and len(split) != ranks:
        raise ValueError(f"A split must have one entry per rank ({ranks}), got {tuple(split)!r}.")


class RoutedSampler(Sampler[int]):
    """Yields this rank's sample indices of a common ``order``, group by group, as :class:`RoutingPlan` splits it.

    ``order`` must give every rank the same indices (a :class:`~torch.utils.data.DistributedSampler`
    with one replica and a common seed); its ``set_epoch`` is forwarded. The DataLoader batches the
    indices with the same ``batch_size`` and ``drop_last``, so its batches are exactly the routed ones.
    """

    def __init__(self, order: Sampler[int], batch_size: int, drop_last: bool, plan: RoutingPlan) -> None:
        self.order = order
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.plan = plan

    def batches_per_epoch(self) -> int:
        """Batches of the common order in one epoch (its last one short unless ``drop_last``)."""
        samples = len(self.order)  # type: ignore[arg-type]
        return samples // self.batch_size if self.drop_last else math.ceil(samples / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the order, whose shuffle depends on the epoch."""
        set_epoch = getattr(self.order, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        indices = list(self.order)
        b, batches, plan = self.batch_size, self.batches_per_epoch(), self.plan
        first_batch = 0
        while True:
            group = plan.groups_drawn
            num_learners = sum(plan.split_at(group))
            plan.groups_drawn += 1  # drawn, or found not to fit: either way its split is settled
            if first_batch + num_learners > batches:
                return  # a last group of fewer than K batches: skipped on every rank
            last = first_batch + num_learners
            if last * b > len(indices):  # the order's short last batch is in this group
                plan.uneven_groups[group] = tuple(min(b, len(indices) - i * b) for i in range(first_batch, last))
            start, count = plan.share(group)
            yield from indices[(first_batch + start) * b : (first_batch + start + count) * b]
            first_batch = last

    def __len__(self) -> int:
        """Indices for one epoch at the latest split (the number the DataLoader's length is computed from)."""
        split = self.plan.latest
        groups = self.batches_per_epoch() // sum(split)
        return groups * split[self.plan.rank] * self.batch_size


def why_unroutable(dataloader: object) -> Optional[str]:
    """What heterogeneous mode's routing needs that ``dataloader`` lacks, or None."""
    if not isinstance(dataloader, DataLoader):
        return f"to be a torch DataLoader, got {type(dataloader).__name__}"
    if isinstance(dataloader.dataset, IterableDataset):
        return "a map-style dataset (an IterableDataset has no order to share out)"
    sampler = dataloader.sampler
    if type(sampler) not in (RandomSampler, SequentialSampler, DistributedSampler):  # (Lightning's injected one)
        return f"shuffle=True or False (a RandomSampler or SequentialSampler), got a {type(sampler).__name__}"
    if isinstance(sampler, RandomSampler) and (sampler.replacement or sampler.num_samples != len(dataloader.dataset)):
        return (
            "shuffle=True without replacement over the whole dataset (a RandomSampler with replacement or num_samples)"
        )
    if type(dataloader.batch_sampler) is not BatchSampler or dataloader.batch_size is None:
        given = type(dataloader.batch_sampler).__name__
        return "the DataLoader's own batches of its batch_size (not a batch_sampler given to it), got" + (
            f" batch_sampler={given}" if dataloader.batch_size is None else f" a {given}"
        )
    return None
