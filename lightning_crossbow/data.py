"""Groups k consecutive batches of the user's training DataLoader into one SMA step.

(In heterogeneous mode, :class:`RoutedBatchLoader` groups this rank's share of a common order instead:
see :mod:`lightning_crossbow.routing`.)

Replica ``j`` of a step takes the ``j``-th batch of the group, so the DataLoader's batch size is the
per-replica batch size and the user's sampler decides the order, exactly as in plain Lightning.
An epoch is one pass over the loader in ``len(loader) // k`` steps: a trailing group with fewer than
``k`` batches is dropped (a warning at set-up names how many batches that is). Those batches are still drawn
(before the next pass starts, or when training ends), as plain Lightning draws them, so a sampler's random
draws (a shuffle with the loader's own ``generator``) go on as in plain Lightning.

A plain ``DataLoader`` that loads in the training process (``num_workers=0``) pays its iterator's
per-batch work inside the training step, k times per step. For such a loader a step's batches come from
one step of a second ``DataLoader`` over the same dataset and batch sampler
(:func:`group_fetching_loader`), which draws, fetches and collates them one batch at a time as the
user's loader does: the same batches, the same calls in the same order, one iterator step per group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from itertools import chain, islice
from typing import TYPE_CHECKING, Any, Optional, Union

import numpy as np
import torch
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, Sampler, TensorDataset, default_collate
from typing_extensions import override

from lightning_crossbow.routing import RoutedBatchSampler, RoutingPlan, group_fits
from lightning_crossbow.validation import check_int

if TYPE_CHECKING:
    import lightning.pytorch as pl


def loader_length(loader: object) -> Optional[int]:
    """``len(loader)``, or None when it has none: a DataLoader defines ``__len__`` even over an
    ``IterableDataset`` without a length, and then raises ``TypeError``."""
    if not isinstance(loader, Sized):
        return None
    try:
        return len(loader)
    except TypeError:
        return None


def skips_over_a_tenth(batches: int, group_size: int) -> bool:
    """Whether groups of ``group_size`` leave more than a tenth of an epoch's ``batches`` out of its last,
    unfilled group (``batches mod group_size > batches / 10``): when a change of k warns that it does
    (set-up warns of any batch left out), and the bound of
    :meth:`~lightning_crossbow.CrossbowStrategy.replicas_fitting_an_epoch`."""
    return (batches % group_size) * 10 > batches


class ReplicaGroup(list):
    """The batches of one step, replica j's at index j. A list, so that Lightning moves it like any batch;
    its own type tells the strategy to apply the module's batch-transfer hooks to each batch alone."""


def tensor_sequences(batches: Sequence[Any]) -> bool:
    """Whether every batch is a plain tuple (or every one a plain list) of tensors, all of one length (the common
    ``(x, y)``, which needs no flattening to be stacked or moved)."""
    if not batches:
        return False
    kind = type(batches[0])
    if kind not in (tuple, list):
        return False
    length = len(batches[0])
    return all(
        type(batch) is kind and len(batch) == length and all(isinstance(item, Tensor) for item in batch)
        for batch in batches
    )


class GroupedBatchSampler(Sampler[list[Any]]):
    """Draws ``group_size`` batches of ``batch_sampler`` per item, for :class:`FetchedBatches`.

    Each item is the first batch's indices, then ``group_size - 1`` references to the iterator over
    ``batch_sampler`` that the other batches' indices are drawn from one at a time while the batches are fetched,
    as the user's loader draws them. The pass ends when ``batch_sampler`` does (its length is not relied on: a
    routed sampler's changes with the split). ``group_size`` is read as each item is made, so it may change
    between groups.
    """

    def __init__(self, batch_sampler: BatchSampler, group_size: int = 1) -> None:
        self.batch_sampler = batch_sampler
        self.group_size = group_size

    @property
    def sampler(self) -> Any:
        """The user's sampler (Lightning sets its epoch through here too)."""
        return self.batch_sampler.sampler

    def __iter__(self) -> Iterator[list[Any]]:
        batches = iter(self.batch_sampler)
        while (first := next(batches, None)) is not None:
            yield [first, *[batches] * (self.group_size - 1)]

    def __len__(self) -> int:
        return -(-len(self.batch_sampler) // self.group_size)


class FetchedBatches(Dataset):
    """A dataset whose item is a batch, fetched and collated exactly as a ``DataLoader`` without workers fetches
    one batch of ``dataset`` (``__getitems__`` when the dataset has one, else one ``__getitem__`` per index; then
    ``collate_fn``). The item's key is the batch's indices, or an iterator to draw them from; past the
    iterator's end it is :data:`NO_BATCH`."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn

    def __getitem__(self, key: Union[list[int], Iterator[list[int]]]) -> Any:
        indices = key if isinstance(key, list) else next(key, None)
        if indices is None:
            return NO_BATCH
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(indices) if getitems else [self.dataset[index] for index in indices]
        return self.collate_fn(samples)


#: What :class:`FetchedBatches` gives past the last batch.
NO_BATCH = object()


class GatheredBatches(FetchedBatches):
    """:class:`FetchedBatches` of a ``TensorDataset`` with ``default_collate``: each batch made a tensor at a time.

    A ``DataLoader`` makes a batch of indices ``i_1 .. i_b`` as ``default_collate([dataset[i] for i in ...])``: for
    each of the dataset's tensors ``t``, the rows ``t[i_1], ..., t[i_b]`` stacked into a new contiguous tensor, which
    is ``t[[i_1, ..., i_b]]`` made contiguous. Here each batch's tensors are made so, one indexing per tensor,
    without the ``b`` calls of ``__getitem__`` and the collate: the same values, dtypes, shapes and memory layout,
    each batch in storage of its own (as a collated one: editing one in place, or keeping it, touches no other),
    its indices drawn from the batch sampler as the user's loader draws them (a ``TensorDataset`` draws no random
    numbers when it is indexed). A batch of indices that are not all integers (Python's, NumPy's, or one-number
    tensors of a signed integer dtype: ``sampler=torch.randperm(n)``) goes to ``__getitem__`` one index at a time,
    as a ``DataLoader`` fetches it (and fails as it fails there): a ``bool`` among them (``t[True]`` is not
    ``t[1]``), a ``float``, a ``uint8`` tensor (a mask)."""

    def __getitems__(self, keys: list[Union[list[int], Iterator[list[int]]]]) -> list[Any]:
        batches: list[Any] = []
        for key in keys:
            indices = key if isinstance(key, list) else next(key, None)
            if indices is None:  # (the other keys are the same iterator, at its end)
                break
            if all(type(i) is int or _integer(i) for i in indices):  # (PyTorch's samplers give ints)
                index = torch.tensor(indices, dtype=torch.int64)
                batches.append([tensor[index].contiguous() for tensor in self.dataset.tensors])
            else:
                batches.append(super().__getitem__(indices))
        return batches + [NO_BATCH] * (len(keys) - len(batches))


#: Integer dtypes that index as numbers (``torch.uint8`` and ``torch.bool`` index as masks).
_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8)


def _integer(index: Any) -> bool:
    """Whether ``index`` indexes a tensor's first dimension as the number it is: a NumPy integer, or a one-number
    tensor of a signed integer dtype (a Python ``int`` is checked before)."""
    if isinstance(index, Tensor):
        return index.dim() == 0 and index.dtype in _INDEX_DTYPES
    return isinstance(index, np.integer)


def _gathers(dataset: Any, collate_fn: Any) -> bool:
    """Whether :class:`GatheredBatches` makes the batches that a ``DataLoader`` over ``dataset`` with
    ``collate_fn`` makes: a ``TensorDataset`` itself (not a subclass, which may index otherwise) of dense tensors
    (a sparse or nested tensor's rows are indexed and stacked otherwise, where they are at all) and PyTorch's
    ``default_collate``."""
    return (
        type(dataset) is TensorDataset
        and all(tensor.layout is torch.strided and not tensor.is_nested for tensor in dataset.tensors)
        and collate_fn is default_collate
    )


def _batches_of_group(batches: list[Any]) -> list[Any]:
    """The fetching loader's ``collate_fn``: a group's batches as they are, without any past the last."""
    return [batch for batch in batches if batch is not NO_BATCH]


def group_fetching_loader(loader: object) -> Optional[DataLoader]:
    """A DataLoader whose items are groups of ``loader``'s batches (see :class:`GroupedBatchSampler` for the group
    size): one ``DataLoader`` step per group, while every batch is drawn, fetched and collated as ``loader`` does
    it, in the same order (so also the same random draws). None where the group's steps could differ: a
    DataLoader subclass, a custom batch sampler, an iterable dataset, or worker processes (they already fetch
    batches in parallel, and a group per worker would make the pipeline coarser)."""
    if not (
        type(loader) is DataLoader
        and loader.num_workers == 0
        and type(loader.batch_sampler) in (BatchSampler, RoutedBatchSampler)
        and not isinstance(loader.dataset, IterableDataset)
    ):
        return None
    fetched = GatheredBatches if _gathers(loader.dataset, loader.collate_fn) else FetchedBatches
    return DataLoader(
        fetched(loader.dataset, loader.collate_fn),
        batch_sampler=GroupedBatchSampler(loader.batch_sampler),
        collate_fn=_batches_of_group,
        pin_memory=loader.pin_memory,
        pin_memory_device=loader.pin_memory_device,
        timeout=loader.timeout,
        generator=loader.generator,
    )


_OWN_ATTRIBUTES = frozenset(
    (
        "loader",
        "batch_limit",
        "_unfilled_warned",
        "_a_pass_ended",
        "_pass_over",
        "num_replicas",
        "groups_yielded",
        "batches_taken",
        "last_group_batches",
        "_returned",
        "_fetcher",
        "plan",
        "routed_sampler",
        "_saved_place",
        "_resume_at",
        "_restart_counted",
        "_ends_when_counted",
        "resumed_mid_pass",
        "counts_on_resume",
        "_drawn",
        "_pass_length",
        "_tail",
        "current_group",
        "_order_samples_taken",
    )
)


class ReplicaBatchLoader:
    """Wraps a loader so that each item is a list of ``num_replicas`` consecutive batches.

    Attributes it does not define (``sampler``, ``batch_sampler``, ``dataset``, ``batch_size``...)
    are read from the wrapped loader, so Lightning's sampler epoch bookkeeping keeps working.

    With ``fetch_groups`` (default) and a loader that :func:`group_fetching_loader` accepts, the batches come from
    that loader instead, a group per iterator step; the groups are the same.

    A wrapped loader that saves its position (``state_dict``/``load_state_dict``, as torchdata's
    ``StatefulDataLoader``) saves and loads its own state, as in plain Lightning. When Lightning loads it in the
    middle of a pass, the pass counts on from :attr:`counts_on_resume` (the groups and batches trained in it before
    the checkpoint, which the strategy keeps in its own part of the checkpoint), so the groups left in it are
    counted right whatever k was (:attr:`resumed_mid_pass`).
    """

    #: Whether a pass is one pass of the wrapped loader (not a routed share of a common order): a pass resumed in its
    #: middle counts on from :attr:`counts_on_resume`, and the batches that do not fill the pass's last group are
    #: still drawn (see the module docstring).
    own_passes = True

    def __init__(self, loader: Iterable, num_replicas: int, fetch_groups: bool = True) -> None:
        check_int("num_replicas", num_replicas)
        self.loader = loader
        self.num_replicas = num_replicas
        self.groups_yielded = 0  # in the current pass
        self.batches_taken = 0
        #: Batches of the last group yielded, less those given back: a checkpoint saved while its step runs (from
        #: an exception in it) counts them drawn, not trained.
        self.last_group_batches = 0
        self._resume_at: Optional[tuple[int, int]] = None  # (groups, batches) of a pass resumed in its middle
        self._restart_counted = False  # whether that pass restarts at the loader's first batch (see count_on_from)
        self._ends_when_counted = False  # whether the current pass does
        #: Whether the current pass was resumed in its middle (from a checkpoint's loader state).
        self.resumed_mid_pass = False
        #: (groups, batches) of the pass trained before a checkpoint this fit resumes from, if any.
        self.counts_on_resume: Optional[tuple[int, int]] = None
        self._returned: list[Any] = []
        self._fetcher = group_fetching_loader(loader) if fetch_groups else None
        self._drawn = 0  # batches drawn from the wrapped loader in the current pass
        self._pass_length: Optional[int] = None  # its batches (None without a length, or for a routed share)
        #: The pass's iterator while its groups are not all made: its batches that fill no group (at k as it is
        #: then) are drawn when the next pass starts, or when training ends (:meth:`draw_tail`).
        self._tail: Optional[Iterator[Any]] = None
        #: The batches a pass takes where fewer than the wrapped loader's (a fractional ``limit_train_batches``, as
        #: Lightning counts it): those that fill no group are drawn all the same, as plain Lightning draws them.
        self.batch_limit: Optional[int] = None
        self._unfilled_warned = False
        self._a_pass_ended = False  # (a pass's groups all made: its loader's length is known from then on)
        self._pass_over = False  # (this pass's groups all made: a batch given back now opens no other group)

    def __iter__(self) -> Iterator[ReplicaGroup]:
        """Each group takes ``num_replicas`` batches as set when the group is made: k may change mid-pass.

        The wrapped loader's iterator is made here, not at the first group, as ``iter(loader)`` makes it: a
        ``DataLoader`` draws its iterator's base seed then, also for an iterator that Lightning makes and drops."""
        self.draw_tail()
        self._count_pass_from(self._resume_at, self._restart_counted)
        self._resume_at, self._restart_counted = None, False
        self._pass_length = self.pass_batches() if self.own_passes else None  # (once a pass, not a step)
        batches = iter(self.loader) if self._fetcher is None else chain.from_iterable(iter(self._fetcher))
        return self._groups(batches)

    def _count_pass_from(self, counts: Optional[tuple[int, int]], restarted: bool) -> None:
        """The current pass's counts start from ``counts`` (groups, batches) of a pass resumed in its middle, else from
        zero; ``restarted``: its wrapped loader starts again at its first batch, and the pass ends once its batches
        are all counted (:meth:`count_on_from`)."""
        self.groups_yielded, self.batches_taken = counts or (0, 0)
        self.resumed_mid_pass, self._ends_when_counted = counts is not None, restarted
        self._returned, self._drawn = [], self.batches_taken
        self._pass_over = False

    def _groups(self, batches: Iterator[Any]) -> Iterator[ReplicaGroup]:
        """The pass's groups, drawn from ``batches`` (see :meth:`__iter__`)."""
        while True:
            self._tail = None
            size = self._group_size()
            group, self._returned = self._returned[:size], self._returned[size:]
            missing = size - len(group)
            group += self._draw(
                batches, min(missing, max(0, self._left_in_pass() or 0)) if self._ends_when_counted else missing
            )
            self.batches_taken += len(group)
            if len(group) < size:
                first_pass_short = not self._a_pass_ended and self.batches_taken == len(group)
                self._a_pass_ended = True
                unfilled = bool(group) and self._pass_length is None and self.own_passes  # (a loader without a length)
                if unfilled and first_pass_short:
                    raise ValueError(  # (a loader with a length is refused before training: see the strategy)
                        f"crossbow: the first pass of the training DataLoader gave {len(group)} batch(es), fewer"
                        f" than the {size} that one step takes (replicas_per_device={size}): not one step could be"
                        f" made. Use at most replicas_per_device={len(group)}, or give the loader more batches (a"
                        " smaller batch size)."
                    )
                if unfilled and not self._unfilled_warned:
                    self._unfilled_warned = True  # (set-up could not say it)
                    rank_zero_warn(
                        f"crossbow: a pass of the training DataLoader ended with {len(group)} batch(es) that do not"
                        f" fill a step of {size}; they are skipped, at the end of every pass."
                    )
                self._pass_over = True
                return
            self.groups_yielded += 1
            self.last_group_batches = len(group)
            self._tail = batches  # (if no other group is asked for)
            yield ReplicaGroup(group)

    def _draw(self, batches: Iterator[Any], count: int) -> list[Any]:
        """The next ``count`` batches of the pass (fewer at its end)."""
        if self._fetcher is not None:  # the batches still missing, in one iterator step
            self._fetcher.batch_sampler.group_size = count
        drawn = list(islice(batches, count))
        self._drawn += len(drawn)
        return drawn

    def _left_in_pass(self) -> Optional[int]:
        """Batches of the wrapped loader's pass not yet drawn (None without a length, or for a routed share)."""
        return None if self._pass_length is None else self._pass_length - self._drawn

    def draw_tail(self) -> None:
        """Draws the last pass's batches that filled no group at k as it is now (also after a change of k that left
        fewer batches than the new k), as plain Lightning draws every batch of a pass; called when the next pass
        starts, and when training ends, so that a later fit's draws go on from there. A pass stopped with batches
        left for a group (by ``max_steps``, an integer limit) leaves them undrawn, as plain Lightning does."""
        batches, self._tail = self._tail, None
        left = self._left_in_pass()
        if batches is not None and left is not None and 0 < left and len(self._returned) + left < self._group_size():
            self._draw(batches, left)

    def forget_tail(self) -> None:
        """Lets the last pass's iterator go without drawing the rest (when training ends: its worker processes end)."""
        self._tail = None

    def _group_size(self) -> int:
        """Batches in the next group."""
        return self.num_replicas

    def give_back(self, batches: list[Any]) -> None:
        """Returns batches of a group that could not run: the next group starts with them, in order. Where the pass
        has made its last group already (a loader without a length, whose end Lightning saw by fetching ahead),
        there is no next group in it: a warning says that they are skipped."""
        self._returned = list(batches) + self._returned
        self.batches_taken -= len(batches)
        self.last_group_batches -= len(batches)
        if self._pass_over and batches:
            rank_zero_warn(
                f"crossbow: {len(batches)} batch(es) of the pass's last step, given back by the out-of-memory back-off,"
                " open no other step: the training DataLoader (without a length) had ended its pass. They are"
                " skipped in this epoch."
            )

    def groups_in_pass(self) -> int:
        """Groups of the current pass: those already made, and those the rest of the loader fills at k now."""
        return self.groups_in(self.batches_per_pass())

    def groups_in(self, batches: int) -> int:
        """Groups of the current pass within its first ``batches`` batches: those already made, and those the
        rest of them fills at k now."""
        return self.groups_yielded + max(0, batches - self.batches_taken) // self.num_replicas

    def __len__(self) -> int:
        return self.batches_per_pass() // self.num_replicas

    def groups_of_next_pass(self, batches: Optional[int] = None) -> Optional[int]:
        """Between two passes: the groups that the next pass makes (within its first ``batches``, default all) at k
        now; None where that pass goes on from a checkpoint's place in its middle."""
        if self._resume_at is not None:
            return None
        return (self.batches_per_pass() if batches is None else batches) // self.num_replicas

    def pass_batches(self) -> Optional[int]:
        """The batches a pass takes: the wrapped loader's, or fewer under :attr:`batch_limit` (None without a
        length)."""
        length = loader_length(self.loader)
        return length if length is None or self.batch_limit is None else min(length, self.batch_limit)

    def dropped_batches(self) -> int:
        """Batches per epoch that do not fill a last group of ``num_replicas`` and are skipped (0 without a length)."""
        length = self.pass_batches()
        return 0 if length is None else length % self.num_replicas

    def batches_per_pass(self) -> int:
        """The wrapped loader's batches per pass (``TypeError`` when it has no length)."""
        length = loader_length(self.loader)
        if length is None:
            raise TypeError("The wrapped loader has no length.")
        return length

    def _load_state_dict(self, state: Any) -> None:
        """The wrapped loader's ``load_state_dict``; in the middle of a pass (a group left to make after
        :attr:`counts_on_resume`), the next pass counts on from those counts."""
        self.loader.load_state_dict(state)  # type: ignore[attr-defined]
        length, counts = loader_length(self.loader), self.counts_on_resume
        if counts is not None and 0 < counts[1] and (length is None or counts[1] + self.num_replicas <= length):
            self._resume_at = counts

    def count_on_from(self, counts: tuple[int, int], pass_begun: bool = False) -> None:
        """For a pass resumed in its middle whose wrapped loader's position is not restored (``counts``: the groups
        and batches trained in it before the checkpoint): the next pass (or, ``pass_begun``, the current one, whose
        iterator is made and no group drawn yet) starts at the loader's first batch, as plain Lightning's does,
        counts on from ``counts``, and ends once the pass's batches are all counted. So the batches left make the
        groups left at k now, as plain Lightning trains the batches left, whatever k was."""
        length = self.pass_batches()
        if not (self.own_passes and length is not None and 0 < counts[1] < length):
            return
        if pass_begun:
            self._count_pass_from(counts, restarted=True)
        else:
            self._resume_at, self._restart_counted = counts, True

    def __setattr__(self, name: str, value: Any) -> None:
        """An attribute of the wrapped loader's that is not the wrapper's own is set there: what Lightning writes on
        the training loader (``worker_init_fn`` under ``seed_everything(workers=True)``, ``_iterator`` when it shuts
        down persistent workers) reaches it, as in plain Lightning."""
        own = name in _OWN_ATTRIBUTES or name in vars(self) or hasattr(type(self), name)
        loader = vars(self).get("loader")
        if not own and loader is not None and hasattr(loader, name):
            setattr(loader, name, value)
        else:
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        if name in _OWN_ATTRIBUTES:  # not set yet (e.g. while unpickling)
            raise AttributeError(name)
        if name == "load_state_dict" and self.own_passes:
            getattr(self.loader, name)  # (a loader that does not save its position: AttributeError, as it would give)
            return self._load_state_dict
        return getattr(self.loader, name)


class RoutedBatchLoader(ReplicaBatchLoader):
    """Groups the batches of a loader over a :class:`~lightning_crossbow.routing.RoutedBatchSampler`: each group
    is this rank's share of one group of the common order, ``plan.share(g)[1]`` batches at group ``g``.

    Lengths count groups of the whole order (every rank has the same), not of this rank's batches.
    """

    own_passes = False  # (the routing plan keeps the order's place)

    def __init__(self, loader: Iterable, routed_sampler: RoutedBatchSampler) -> None:
        self.plan: RoutingPlan = routed_sampler.plan
        self.routed_sampler = routed_sampler
        super().__init__(loader, self.plan.share(self.plan.groups_trained)[1])
        self.current_group = -1  #: the group of the last batches handed out
        self._order_samples_taken = 0  # in the current pass, by the groups of every rank
        #: (epoch, groups, samples of the order) of a pass saved in its middle, which the pass of that epoch goes on
        #: with (:meth:`resume_pass_at`; the base class's ``_resume_at`` counts that pass on from its groups)
        self._saved_place: Optional[tuple[int, int, int]] = None

    def resume_pass_at(self, epoch: int, groups: int, samples: int) -> None:
        """The pass of ``epoch`` goes on with one saved in its middle: ``groups`` groups of it were trained, which
        took its order's first ``samples`` samples. It counts on from those groups and draws the rest of the order,
        cut at the layout in force now (whatever it was before), so the epoch still takes each sample at most once.
        Until it starts, the loader's length is that pass's: the groups trained and those the rest makes (Lightning
        reads it for the resumed epoch's count). A pass of another epoch (the resumed one had no group left) starts
        afresh. A place beyond this order's end (a smaller dataset than the checkpoint's) is not taken, with a
        warning."""
        if samples > self.routed_sampler.samples_per_epoch():
            rank_zero_warn(
                f"crossbow: the checkpoint's place in the common order (after {samples} samples) lies beyond the"
                f" {self.routed_sampler.samples_per_epoch()} samples of this training set: the resumed epoch starts"
                " the order again."
            )
            return
        self._saved_place = (epoch, groups, samples)

    def place_in_pass(self, in_flight: bool) -> tuple[int, int]:
        """``(groups, samples)`` of the current pass trained so far, for :meth:`resume_pass_at`; ``in_flight``: the
        last group handed out is not trained (its step did not end)."""
        if self._saved_place is not None:  # (the resumed pass has not started)
            return self._saved_place[1:]
        if not in_flight:
            return self.groups_yielded, self._order_samples_taken
        in_flight_samples = sum(self.plan.learner_batch_sizes(self.current_group))
        return self.groups_yielded - 1, self._order_samples_taken - in_flight_samples

    @override
    def _group_size(self) -> int:
        return self.plan.share(self.plan.groups_trained)[1]

    def __iter__(self) -> Iterator[ReplicaGroup]:
        place, self._saved_place = self._saved_place, None
        epoch, groups, samples = place if place is not None else (None, 0, 0)
        if epoch != self.routed_sampler.epoch:  # (a pass of another epoch than the one saved in its middle)
            groups = samples = 0
        self._resume_at = (groups, 0) if samples else None  # (the pass counts on from its groups trained)
        self.routed_sampler.start_next_pass_at(samples)
        self._order_samples_taken = samples
        # Groups the last pass drew ahead of training (prefetching; limit_train_batches, max_steps), or found no
        # room for, were never trained: the new pass draws from where training is (every rank is there too).
        self.plan.groups_drawn = self.plan.groups_trained
        self.plan.uneven_groups.clear()
        for group in super().__iter__():
            self.current_group = self.plan.groups_trained
            self.num_replicas = len(group)
            self._order_samples_taken += sum(self.plan.learner_batch_sizes(self.current_group))
            self.plan.groups_trained += 1
            yield group

    @override
    def give_back(self, batches: list[Any]) -> None:
        raise RuntimeError("A routed group cannot be split: the other ranks' shares of it are fixed.")

    def load_state_dict(self, state: Any) -> None:
        """Not loaded: a place in its pass that the wrapped loader saved (rank 0's, in the checkpoint) is not the
        other ranks' (each takes its own share of the common order), and a rank resumed there would train other
        steps than the rest, which then wait for it. The place in the common order, the same on every rank, is the
        strategy's to restore (:meth:`resume_pass_at`)."""

    @override
    def groups_in_pass(self) -> int:
        """Groups of the current pass: those handed out, and those the rest of the order makes, each group at
        the split in force for it (groups drawn ahead keep the split they were drawn with)."""
        return self._rest_of_pass()[0]

    def samples_left_out_of_pass(self) -> int:
        """Samples of the current pass's order that no group takes: the tail its last group leaves (0 when that
        group takes the order's short last batch)."""
        return max(0, self._rest_of_pass()[1])

    @override
    def groups_of_next_pass(self, batches: Optional[int] = None) -> Optional[int]:
        """Between two passes: the groups that the next pass makes, each at the layout in force for it; None where
        that pass goes on from a checkpoint's place in its middle (``batches``: not supported, see
        :class:`~lightning_crossbow.epoch_counts.EpochCounts`)."""
        return None if self._saved_place is not None else self._rest_of_pass(next_pass=True)[0]

    def _rest_of_pass(self, next_pass: bool = False) -> tuple[int, int]:
        """``(groups of the current pass, samples of the order no group takes)``, each group at its own layout (of
        the pass resumed in its middle, while it has not started; ``next_pass``: of the pass to start next)."""
        sampler = self.routed_sampler
        if next_pass:
            groups, taken = 0, 0
        elif self._saved_place is not None:
            _, groups, taken = self._saved_place
        else:
            groups, taken = self.groups_yielded, self._order_samples_taken
        remaining, group = sampler.samples_per_epoch() - taken, self.plan.groups_trained
        while remaining > 0 and group_fits(remaining, sizes := self.plan.learner_batch_sizes(group), sampler.drop_last):
            remaining -= sum(sizes)
            groups += 1
            group += 1
        return groups, remaining

    def __len__(self) -> int:
        if self._saved_place is not None:  # (the resumed pass, not started: its groups, which Lightning counts)
            return self._rest_of_pass()[0]
        return self.routed_sampler.groups_per_epoch()

    @override
    def dropped_batches(self) -> int:
        """Batches of the DataLoader's size that the samples skipped at each epoch's end make
        (:meth:`~lightning_crossbow.routing.RoutedBatchSampler.skipped_samples`)."""
        return -(-self.routed_sampler.skipped_samples() // self.routed_sampler.batch_size)

    @property
    def batch_size(self) -> int:
        """The user's DataLoader's batch size (the re-made loader's own is None: it takes a batch sampler)."""
        return self.routed_sampler.batch_size


#: The LightningModule hooks that move a batch: where a user overrides one, each replica's batch goes through it alone.
TRANSFER_HOOKS = ("transfer_batch_to_device", "on_after_batch_transfer")


def moved_tensors(batch: Union[tuple[Tensor, ...], list[Tensor]], device: torch.device) -> Any:
    """A tuple or list of tensors moved to ``device`` as Lightning's default ``transfer_batch_to_device`` moves each
    (``non_blocking`` where it is not the CPU or MPS)."""
    if device.type in ("cpu", "mps"):
        return type(batch)(tensor.to(device) for tensor in batch)
    return type(batch)(tensor.to(device, non_blocking=True) for tensor in batch)


def group_as_it_is(module: "pl.LightningModule", batch: Any, dataloader_idx: int = 0) -> Any:
    """The module's ``on_before_batch_transfer`` dispatch for a fit whose transfer hooks are the user's: a group of
    the replicas' batches passes as it is (:meth:`CrossbowStrategy.batch_to_device` calls the hook batch by batch,
    each before its own transfer); any other batch goes to the hook. Bound to the module during fit."""
    if isinstance(batch, ReplicaGroup):
        return batch
    return type(module)._on_before_batch_transfer(module, batch, dataloader_idx)


def on_before_batch_transfer_per_batch(module: "pl.LightningModule", batch: Any, dataloader_idx: int = 0) -> Any:
    """The module's ``on_before_batch_transfer`` hook (through Lightning's own dispatch), batch by batch for a
    group of the replicas' batches. Bound to the module during fit under the name it replaces."""
    hook = type(module)._on_before_batch_transfer
    if isinstance(batch, ReplicaGroup):
        return ReplicaGroup(hook(module, b, dataloader_idx) for b in batch)
    return hook(module, batch, dataloader_idx)


def saves_its_position(loader: object) -> bool:
    """Whether Lightning saves and loads ``loader``'s own state in checkpoints (``state_dict``/``load_state_dict``)."""
    return isinstance(loader, _Stateful)
