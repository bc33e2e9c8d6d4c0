"""Fetching a step's batches in one iterator step: the same batches, drawn, fetched and collated in the same order."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._pytree import tree_flatten
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    SequentialSampler,
    Subset,
    TensorDataset,
)
from torch.utils.data.dataloader import _BaseDataLoaderIter

from lightning_crossbow import CrossbowStrategy
from lightning_crossbow.data import GatheredBatches, ReplicaBatchLoader, group_fetching_loader
from tests.helpers import Classifier, loader, make_data, trainer


class _Records(Dataset):
    """Samples mixing a tensor (with a random draw: augmentation), a number and a string."""

    def __init__(self, size: int = 45) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        x = torch.full((3,), float(index)) + torch.rand(3)
        return {"x": x, "label": index % 4, "name": f"sample-{index}"}


def _collate_with_noise(samples: list[Any]) -> Any:
    """The default collate, then a random draw of its own (as masking or mixup collators do)."""
    batch = torch.utils.data.default_collate(samples)
    batch["x"] = batch["x"] + torch.rand(())
    return batch


class _PreBatched(Dataset):
    """``__getitems__`` returns the batch already made (a tuple of tensors, for an identity collate), padded to the
    longest sample it was asked for."""

    def __len__(self) -> int:
        return 36

    def __getitem__(self, index: int) -> Any:
        raise AssertionError("fetched through __getitems__ only")

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        longest = 1 + max(i % 5 for i in indices)
        return torch.tensor(indices), torch.ones(len(indices), longest)


@pytest.fixture
def iterator_steps(monkeypatch) -> list[int]:
    """Counts DataLoader iterator steps (``__next__`` calls) in a one-element list."""
    count = [0]
    next_item = _BaseDataLoaderIter.__next__

    def counted(self: Any) -> Any:
        count[0] += 1
        return next_item(self)

    monkeypatch.setattr(_BaseDataLoaderIter, "__next__", counted)
    return count


def _groups(grouped: ReplicaBatchLoader, changes: dict[int, int], give_back: dict[int, int]) -> list[Any]:
    """Every group of one pass; ``changes[g]``: k after group g; ``give_back[g]``: that many of group g's batches
    go back (as an out-of-memory back-off does)."""
    groups = []
    for index, group in enumerate(grouped):
        if index in give_back:
            kept = len(group) - give_back[index]
            grouped.give_back(group[kept:])
            group = group[:kept]
        groups.append(list(group))  # (a plain list: pytree reads into it)
        if index in changes:
            grouped.num_replicas = changes[index]
    return groups


def _assert_same(actual: Any, expected: Any) -> None:
    actual_leaves, actual_spec = tree_flatten(actual)
    expected_leaves, expected_spec = tree_flatten(expected)
    assert actual_spec == expected_spec
    for a, e in zip(actual_leaves, expected_leaves, strict=True):
        if isinstance(e, torch.Tensor):
            assert a.dtype == e.dtype and torch.equal(a, e)
        else:
            assert a == e


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_fetched_groups_are_the_users_batches_through_k_changes_and_back_offs(
    shuffle: bool, drop_last: bool, iterator_steps: list[int]
) -> None:
    """The same batches, also where the dataset and the collate_fn draw random numbers (the same draws, in the same
    order), in fewer iterator steps."""

    def passes(fetch_groups: bool) -> tuple[list[Any], int]:
        torch.manual_seed(0)
        iterator_steps[0] = 0
        loader = DataLoader(  # 45 samples in batches of 4: a short last batch unless it is dropped
            _Records(), batch_size=4, shuffle=shuffle, drop_last=drop_last, collate_fn=_collate_with_noise
        )
        grouped = ReplicaBatchLoader(loader, 3, fetch_groups=fetch_groups)
        first = _groups(grouped, changes={1: 2, 3: 4}, give_back={2: 1})
        second = _groups(grouped, changes={}, give_back={})  # a second epoch, at k=4
        return [first, second, torch.rand(())], iterator_steps[0]

    (fetched, steps), (one_by_one, steps_one_by_one) = passes(True), passes(False)
    _assert_same(fetched, one_by_one)  # (the last entries: the generator's state after both epochs)
    assert sum(len(g) for g in one_by_one[0]) >= 9  # (the pass did go through the changes)
    assert steps < steps_one_by_one / 2  # an iterator step per group, not per batch


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("sampling", ["in order", "shuffled", "a NumPy array of indices", "a tensor of indices"])
def test_a_tensor_datasets_groups_are_gathered_and_are_the_users_batches(
    sampling: str, drop_last: bool, iterator_steps: list[int]
) -> None:
    """A TensorDataset with the default collate: each batch is made with one indexing per tensor (none fetched sample
    by sample), and the batches are the user's loader's, value, dtype, shape, memory layout and type, each tensor in
    storage of its own, through changes of k and back-offs, with a short last batch and a short last group; the
    shuffle draws as many numbers. (A tensor whose rows are not contiguous: indexing keeps their layout, a collate
    makes them contiguous.)"""
    rows_not_contiguous = torch.randn(45, 2, 3).permute(0, 2, 1)
    dataset = TensorDataset(rows_not_contiguous, torch.randint(0, 5, (45,)), torch.rand(45, 2).double())
    fetched_one_by_one = []
    getitem = TensorDataset.__getitem__
    try:
        TensorDataset.__getitem__ = lambda self, index: fetched_one_by_one.append(index) or getitem(self, index)
        passes = []
        for fetch_groups in (True, False):
            torch.manual_seed(0)
            sampler = {
                "a NumPy array of indices": np.random.default_rng(0).permutation(45),
                "a tensor of indices": torch.randperm(45, generator=torch.Generator().manual_seed(0)).int(),
            }.get(sampling)
            shuffle = True if sampling == "shuffled" else None
            loader = DataLoader(dataset, batch_size=4, shuffle=shuffle, sampler=sampler, drop_last=drop_last)
            grouped = ReplicaBatchLoader(loader, 3, fetch_groups=fetch_groups)
            first = _groups(grouped, changes={1: 2, 3: 4}, give_back={2: 1})
            passes.append(
                ([first, _groups(grouped, changes={}, give_back={}), torch.rand(())], len(fetched_one_by_one))
            )
    finally:
        TensorDataset.__getitem__ = getitem
    (gathered, fetched_gathering), (one_by_one, fetched_in_all) = passes
    assert fetched_gathering == 0 and fetched_in_all > 0  # gathering fetched nothing sample by sample
    _assert_same(gathered, one_by_one)
    assert all(type(batch) is list for group in gathered[0] for batch in group)  # (default_collate's lists)
    for mine, theirs in zip(tree_flatten(gathered[:2])[0], tree_flatten(one_by_one[:2])[0], strict=True):
        assert mine.stride() == theirs.stride() and mine.untyped_storage().nbytes() == mine.nbytes


@pytest.mark.parametrize(
    "indices", [[0.0, 1.5, 2.0, 3.0], [0, True, 2, 3]], ids=["floats", "a bool among integers (t[True] is not t[1])"]
)
def test_indices_that_are_not_integers_are_fetched_as_the_users_loader_fetches_them(indices: list) -> None:
    """Plain Lightning's loader fails in ``__getitem__`` (floats) or in the collate (a bool indexes as a new
    dimension); so does the gathering one, with the same error."""
    data = make_data(num_samples=8)
    errors = []
    for fetch_groups in (True, False):
        grouped = ReplicaBatchLoader(DataLoader(data, batch_size=2, sampler=indices), 2, fetch_groups)
        with pytest.raises((IndexError, RuntimeError)) as raised:
            list(grouped)
        errors.append((type(raised.value), str(raised.value)))
    assert errors[0] == errors[1]


class _EditsItsBatch(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        x /= 2  # (in place: plain Lightning's loader gives each batch its own tensors)
        return super().training_step((x, y), batch_idx)


@pytest.mark.parametrize("engine", ["sequential", "fused"])
def test_a_training_step_that_edits_its_batch_in_place_trains_as_on_batches_fetched_one_by_one(engine: str) -> None:
    """Each replica's batch is in storage of its own: an edit in place touches no other replica's, which autograd
    may hold (the sequential engine's backward comes after every replica's forward)."""
    weights = []
    for data in (make_data(num_samples=48), Subset(make_data(num_samples=48), range(48))):  # gathered, and not
        model = _EditsItsBatch()
        trainer(strategy=CrossbowStrategy(replicas_per_device=3, engine=engine), max_epochs=2).fit(model, loader(data))
        weights.append([p.detach().clone() for p in model.parameters()])
    for gathered, fetched in zip(*weights, strict=True):
        assert torch.equal(gathered, fetched)


@pytest.mark.parametrize(
    "make",
    [
        lambda data: DataLoader(data, batch_size=4, collate_fn=lambda batch: torch.utils.data.default_collate(batch)),
        lambda data: DataLoader(type("OwnTensorDataset", (TensorDataset,), {})(*data.tensors), batch_size=4),
        lambda data: DataLoader(TensorDataset(data.tensors[0].to_sparse(), data.tensors[1]), batch_size=4),
        lambda data: DataLoader(
            TensorDataset(torch.nested.nested_tensor(list(data.tensors[0])), data.tensors[1]), batch_size=4
        ),
    ],
    ids=["another collate_fn", "TensorDataset subclass", "a sparse tensor", "a nested tensor"],
)
def test_only_a_tensor_dataset_with_the_default_collate_is_gathered(make: Any) -> None:
    fetcher = group_fetching_loader(make(make_data()))
    assert fetcher is not None and not isinstance(fetcher.dataset, GatheredBatches)
    assert isinstance(group_fetching_loader(DataLoader(make_data(), batch_size=4)).dataset, GatheredBatches)


def test_a_dataset_that_fetches_whole_batches_gets_the_same_requests() -> None:
    loader = DataLoader(_PreBatched(), batch_size=4, collate_fn=lambda batch: batch)
    fetched = [list(group) for group in ReplicaBatchLoader(loader, 3)]
    _assert_same(fetched, [list(group) for group in ReplicaBatchLoader(loader, 3, fetch_groups=False)])
    assert [len(group) for group in fetched] == [3, 3, 3] and fetched[0][0][0].shape == (4,)


def test_an_incomplete_last_group_is_dropped_as_when_fetching_batch_by_batch() -> None:
    loader = DataLoader(make_data(num_samples=80), batch_size=8)  # 10 batches
    fetched = [list(group) for group in ReplicaBatchLoader(loader, 4)]
    assert [len(group) for group in fetched] == [4, 4]
    _assert_same(fetched, [list(group) for group in ReplicaBatchLoader(loader, 4, fetch_groups=False)])


class _Stream(IterableDataset):
    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(8.0))


class _OwnLoader(DataLoader):
    pass


@pytest.mark.parametrize(
    "make",
    [
        lambda data: DataLoader(data, batch_size=4, num_workers=2),
        lambda data: DataLoader(data, batch_sampler=[[0, 1], [2, 3]]),
        lambda data: DataLoader(_Stream(), batch_size=4),
        lambda data: _OwnLoader(data, batch_size=4),
    ],
    ids=["worker processes", "custom batch sampler", "iterable dataset", "DataLoader subclass"],
)
def test_loaders_whose_fetching_could_change_are_left_fetching_batch_by_batch(make) -> None:
    assert group_fetching_loader(make(make_data())) is None


def test_lightning_reaches_the_users_sampler_through_the_fetching_loader() -> None:
    loader = DataLoader(make_data(), batch_size=4)
    fetcher = group_fetching_loader(loader)
    assert fetcher is not None and fetcher.batch_sampler.sampler is loader.sampler
    assert isinstance(loader.batch_sampler, BatchSampler) and isinstance(loader.sampler, SequentialSampler)


class _LengthBelowItsIndices(SequentialSampler):
    """Yields more indices than its length says (as the routed sampler of heterogeneous mode does after a split
    changes): the pass must end where the indices end."""

    def __len__(self) -> int:
        return 8


def test_a_pass_ends_where_the_samplers_indices_end_not_where_its_length_says() -> None:
    data = make_data(num_samples=48)
    loader = DataLoader(data, batch_size=4, sampler=_LengthBelowItsIndices(data))
    fetched = [list(group) for group in ReplicaBatchLoader(loader, 3)]
    assert len(fetched) == 4  # 12 batches
    _assert_same(fetched, [list(group) for group in ReplicaBatchLoader(loader, 3, fetch_groups=False)])
