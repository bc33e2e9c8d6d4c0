r"""Routing by speed (Adaptive SGD): every rank takes its share of one common order of samples.

Every rank draws the same order of the whole training set (the same seed and epoch). The order is cut
into *groups*, one per optimizer step. With the *split* ``(k_0, ..., k_{R-1})`` and the per-replica batch
sizes ``(b_0, ..., b_{R-1})`` in force at group ``g`` (``b_r`` is the DataLoader's batch size ``b`` unless
the balancer gave rank ``r``'s learners larger batches), group ``g`` holds
``N_g = sum_r k_r b_r`` samples of the order and rank ``r`` takes

.. math::

    \text{samples } o_g + \textstyle\sum_{q<r} k_q b_q, \ \dots, \ o_g + \sum_{q \le r} k_q b_q - 1,
    \qquad o_{g+1} = o_g + N_g

as ``k_r`` batches of ``b_r``, one per local learner. However the split and the batch sizes change, an
epoch sees every sample at most once, on exactly one learner. At an epoch's end a group is made only where
the samples left fill every learner's batch but the last one's (which may be short, as the DataLoader's
last batch may be; with ``drop_last`` every batch must be full); otherwise the rest is skipped on every
rank alike. With every ``b_r = b`` these are the DataLoader's own batches, ``K_g`` of them per group.

Splits change at group boundaries that no rank has reached yet, not even to find that the epoch has
no room for it (:meth:`RoutingPlan.schedule`), so the routing stays consistent when DataLoader workers
have drawn indices ahead of training.

The place in an epoch's order is the same on every rank, and a checkpoint keeps it: a fit resumed in an epoch's
middle goes on from there (:meth:`RoutedBatchSampler.start_next_pass_at`), cut at the layout in force then.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from typing import NamedTuple, Optional

from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

Split = tuple[int, ...]


class Layout(NamedTuple):
    """The learners on each rank and each rank's per-replica batch size."""

    split: Split
    batch_sizes: Split

    def learner_batch_sizes(self) -> Split:
        """The full batch size of each of the ``K`` learners, rank by rank."""
        return tuple(b for k, b in zip(self.split, self.batch_sizes) for _ in range(k))


class RoutingPlan:
    """The splits (and batch sizes) in force from each group on, and where this rank's sampler and training loop are.

    Groups are counted from the start of fit, across epochs. ``groups_drawn`` counts the groups this
    rank's :class:`RoutedBatchSampler` has started to draw indices for, or found no room for at an epoch's end
    (it may run ahead of training by the DataLoader's prefetching); ``groups_trained`` those its
    training loop has taken. Batch sizes ``None`` stand for the DataLoader's, :attr:`batch_size`, on every rank.
    """

    def __init__(self, split: Sequence[int], rank: int, batch_size: int = 1) -> None:
        check_split(split)
        if not 0 <= rank < len(split):
            raise ValueError(f"rank {rank} has no share in a split over {len(split)} ranks.")
        self.rank = rank
        #: The DataLoader's batch size: every rank's per-replica batch unless a change gave it another.
        self.batch_size = batch_size
        self._starts: list[int] = [0]
        self._splits: list[Split] = [tuple(split)]
        self._batch_sizes: list[Optional[Split]] = [None]
        self.groups_drawn = 0
        self.groups_trained = 0
        #: Every learner's samples in the groups whose batches are not all full (the order's short last one).
        self.uneven_groups: dict[int, tuple[int, ...]] = {}

    def _entry(self, group: int) -> int:
        return bisect.bisect_right(self._starts, group) - 1

    def split_at(self, group: int) -> Split:
        """The split in force at ``group``."""
        return self._splits[self._entry(group)]

    def layout_at(self, group: int) -> Layout:
        """The split and batch sizes in force at ``group``."""
        entry = self._entry(group)
        return Layout(self._splits[entry], self._sizes_or_the_loaders(self._batch_sizes[entry]))

    def learner_batch_sizes(self, group: int) -> Split:
        """The full batch size of each of the group's ``K`` learners, rank by rank."""
        return self.layout_at(group).learner_batch_sizes()

    def scaled(self, batch_sizes: Split) -> Optional[Split]:
        """``batch_sizes``, or None where every one is the DataLoader's (how the plan keeps them)."""
        return None if set(batch_sizes) == {self.batch_size} else batch_sizes

    def _sizes_or_the_loaders(self, batch_sizes: Optional[Split]) -> Split:
        return batch_sizes or (self.batch_size,) * len(self.latest)

    def share(self, group: int) -> tuple[int, int]:
        """``(first, count)``: this rank's learners are ``first .. first + count - 1`` of the group's ``K``."""
        split = self.split_at(group)
        return sum(split[: self.rank]), split[self.rank]

    @property
    def latest(self) -> Split:
        """The split of the last change scheduled (in force now or soon)."""
        return self._splits[-1]

    @property
    def latest_scaled_batch_sizes(self) -> Optional[Split]:
        """The batch sizes of the last change scheduled where they are not all the DataLoader's, else None."""
        return self._batch_sizes[-1]

    @property
    def latest_layout(self) -> Layout:
        """The split and batch sizes of the last change scheduled."""
        return Layout(self.latest, self._sizes_or_the_loaders(self._batch_sizes[-1]))

    @property
    def latest_from(self) -> int:
        """The group from which :attr:`latest` is in force."""
        return self._starts[-1]

    def schedule(self, split: Sequence[int], from_group: int, batch_sizes: Optional[Sequence[int]] = None) -> None:
        """Puts ``split`` (and ``batch_sizes``, default: the DataLoader's on every rank) in force from ``from_group``
        on; every rank must schedule the same.

        ``from_group`` must be one that no rank has started to draw (see the strategy: the maximum of
        ``groups_drawn`` over ranks), else the ranks would cut that group differently.
        """
        check_split(split, len(self.latest))
        sizes = None
        if batch_sizes is not None:
            check_split(batch_sizes, len(self.latest), what="per-replica batch size")
            sizes = self.scaled(tuple(batch_sizes))
        if from_group < self.groups_drawn:
            raise ValueError(
                f"group {from_group} is already drawn; a new split can start at {self.groups_drawn} or later."
            )
        while len(self._starts) > 1 and self._starts[-1] >= from_group:  # superseded changes no rank has reached
            self._starts.pop()
            self._splits.pop()
            self._batch_sizes.pop()
        if (tuple(split), sizes) == (self._splits[-1], self._batch_sizes[-1]):
            return
        if from_group == self._starts[-1]:  # (only the first entry can start there)
            self._splits[-1], self._batch_sizes[-1] = tuple(split), sizes
            return
        self._starts.append(from_group)
        self._splits.append(tuple(split))
        self._batch_sizes.append(sizes)

    def restart(self, split: Sequence[int], batch_sizes: Optional[Sequence[int]] = None) -> None:
        """A new fit (or a resume): ``split`` (and ``batch_sizes``) from the first group on, counters at zero."""
        check_split(split, len(self.latest))
        self._starts, self._splits, self._batch_sizes = [0], [tuple(split)], [None]
        self.groups_drawn = self.groups_trained = 0
        self.uneven_groups.clear()
        if batch_sizes is not None:
            self.schedule(split, 0, batch_sizes)

    def scaled_batch_sizes(self) -> list[Split]:
        """The batch sizes of every entry that are not all the DataLoader's."""
        return [sizes for sizes in self._batch_sizes if sizes is not None]

    def forget_batch_sizes(self) -> None:
        """Every entry back at the DataLoader's batch size on every rank."""
        self._batch_sizes = [None] * len(self._batch_sizes)

    def learner_weights(self, group: int, full_groups_before: int = 0) -> Optional[list[float]]:
        """``K p_i`` for this rank's learners of ``group``, with ``p_i = b_i / sum_j b_j`` over all ``K``
        learners (Adaptive SGD's normalized merging) and ``b_i`` learner ``i``'s samples since the last
        synchronisation: its batch of ``group`` after ``full_groups_before`` groups of full batches at the same
        split and batch sizes (the local steps of an averaging period); ``None`` when every learner has as many
        (every ``K p_i = 1``)."""
        full = self.learner_batch_sizes(group)
        sizes = self.uneven_groups.get(group)
        if sizes is None:
            return full_batch_weights(self.layout_at(group), self.rank)
        first, count = self.share(group)
        samples = [full_groups_before * b + size for b, size in zip(full, sizes)]
        total = sum(samples)
        return [len(samples) * b / total for b in samples[first : first + count]]


def full_batch_weights(layout: Layout, rank: int) -> Optional[list[float]]:
    """``K p_i`` for ``rank``'s learners after any number of steps of full batches at ``layout``:
    ``p_i = b_r / sum_q k_q b_q`` for a learner of rank ``r``; ``None`` where every ``b_r`` is the same."""
    if len(set(layout.batch_sizes)) == 1:
        return None
    num_learners = sum(layout.split)
    total = sum(k * b for k, b in zip(layout.split, layout.batch_sizes))
    return [num_learners * layout.batch_sizes[rank] / total] * layout.split[rank]


def skips_too_much(sampler: RoutedBatchSampler, layout: Layout, current: Layout) -> bool:
    """Whether ``layout`` would leave more than a tenth of an epoch's samples out of its groups (none at all when
    its batches are larger than the epoch), and more than ``current`` does."""
    skipped = sampler.skipped_samples(layout)
    return skipped * 10 > sampler.samples_per_epoch() and skipped > sampler.skipped_samples(current)


def group_fits(samples_left: int, learner_sizes: Sequence[int], drop_last: bool) -> bool:
    """Whether ``samples_left`` of the order make one more group of learners with these batch sizes: every
    batch full, or (without ``drop_last``) all but the last learner's, which keeps at least one sample."""
    needed = sum(learner_sizes)
    return samples_left >= needed or (not drop_last and samples_left > needed - learner_sizes[-1])


def check_split(split: Sequence[int], ranks: Optional[int] = None, what: str = "number of learners") -> None:
    """Raises unless ``split`` gives every rank (``ranks`` of them, when given) a positive int ``what``."""
    if not split or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in split):
        raise ValueError(f"A split gives every rank a positive int {what}, got {tuple(split)!r}.")
    if ranks is not None and len(split) != ranks:
        raise ValueError(f"A split must have one entry per rank ({ranks}), got {tuple(split)!r}.")


class RoutedBatchSampler(BatchSampler):
    """Yields this rank's batches of a common ``order``, group by group, as :class:`RoutingPlan` cuts it.

    ``order`` must give every rank the same indices (a :class:`~torch.utils.data.DistributedSampler`
    with one replica and a common seed); its ``set_epoch`` is forwarded. ``batch_size`` and ``drop_last`` are
    the user's DataLoader's: its batch size is every learner's until the plan gives a rank another.
    """

    def __init__(self, order: Sampler[int], batch_size: int, drop_last: bool, plan: RoutingPlan) -> None:
        super().__init__(order, batch_size, drop_last)
        self.plan = plan
        plan.batch_size = batch_size
        #: Where in the order the next pass starts (a pass resumed in its middle; see :meth:`start_next_pass_at`).
        self.next_pass_starts_at = 0

    @property
    def epoch(self) -> int:
        """The epoch the order is drawn for (Lightning sets it on the order, the batch sampler's ``sampler``)."""
        return getattr(self.sampler, "epoch", 0)

    def start_next_pass_at(self, sample: int) -> None:
        """The next pass draws the order from its ``sample``-th index on: the rest of a pass saved in its middle, whose
        groups before it every rank trained (the order and its cut are the same on every rank, so is the place)."""
        if not 0 <= sample <= self.samples_per_epoch():
            raise ValueError(f"a pass of {self.samples_per_epoch()} samples cannot resume at sample {sample}.")
        self.next_pass_starts_at = sample

    def samples_per_epoch(self) -> int:
        """The common order's length."""
        return len(self.sampler)  # type: ignore[arg-type]

    def batches_per_epoch(self) -> int:
        """Batches of the DataLoader's batch size in the common order (its last one short unless ``drop_last``)."""
        samples = self.samples_per_epoch()
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)

    def groups_per_epoch(self, layout: Optional[Layout] = None) -> int:
        """Groups of one epoch at ``layout`` (default: the latest split and batch sizes)."""
        return self._cut_epoch(layout or self.plan.latest_layout)[0]

    def skipped_samples(self, layout: Optional[Layout] = None) -> int:
        """Samples at the end of each epoch that fill no group at ``layout`` (default: the latest)."""
        return self._cut_epoch(layout or self.plan.latest_layout)[1]

    def _cut_epoch(self, layout: Layout) -> tuple[int, int]:
        """``(groups, samples left out)`` of one epoch at ``layout`` (a last group keeps a short last batch)."""
        sizes = layout.learner_batch_sizes()
        full, left = divmod(self.samples_per_epoch(), sum(sizes))
        if left > 0 and group_fits(left, sizes, self.drop_last):
            return full + 1, 0
        return full, left

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the order, whose shuffle depends on the epoch."""
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        indices, plan, offset = list(self.sampler), self.plan, self.next_pass_starts_at
        self.next_pass_starts_at = 0
        while True:
            group = plan.groups_drawn
            sizes = plan.learner_batch_sizes(group)
            plan.groups_drawn += 1  # drawn, or found not to fit: either way its split is settled
            left = len(indices) - offset
            if not group_fits(left, sizes, self.drop_last):
                return  # a last group that does not fill its learners: skipped on every rank
            if left < sum(sizes):  # the order's short last batch is in this group
                starts = [offset + sum(sizes[:i]) for i in range(len(sizes))]
                plan.uneven_groups[group] = tuple(min(b, len(indices) - s) for b, s in zip(sizes, starts))
            first, count = plan.share(group)
            start = offset + sum(sizes[:first])
            for size in sizes[first : first + count]:
                yield indices[start : start + size]
                start += size
            offset += sum(sizes)

    def __len__(self) -> int:
        """This rank's batches in one epoch at the latest split (the number the DataLoader's length is taken from)."""
        return self.groups_per_epoch() * self.plan.latest[self.plan.rank]


def why_unroutable(dataloader: object) -> Optional[str]:
    """What heterogeneous mode's routing needs that ``dataloader`` lacks, or None."""
    if not isinstance(dataloader, DataLoader):
        return f"to be a torch DataLoader, got {type(dataloader).__name__}"
    if isinstance(dataloader.dataset, IterableDataset):
        return "a map-style dataset (an IterableDataset has no order to share out)"
    sampler = dataloader.sampler
    if type(sampler) not in (RandomSampler, SequentialSampler, DistributedSampler):  # (Lightning's injected one)
        # (Lightning wraps a sampler of the user's for its processes: named is the user's)
        yours = getattr(getattr(sampler, "dataset", None), "_sampler", sampler)
        return f"shuffle=True or False (a RandomSampler or SequentialSampler), got a {type(yours).__name__}"
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
