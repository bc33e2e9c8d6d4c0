"""Fetching a step's batches in one go: the same groups as batch by batch, for fewer fetches."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_flatten
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, SequentialSampler

from lightning_crossbow.data import ReplicaBatchLoader, group_fetching_loader
from tests.helpers import make_data


class _Records(Dataset):
    """Samples mixing a tensor, a number and a string; counts the fetches (``__getitems__`` calls)."""

    def __init__(self, size: int = 45) -> None:
        self.size = size
        self.fetches = 0

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"x": torch.full((3,), float(index)), "label": index % 4, "name": f"sample-{index}"}

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        self.fetches += 1
        return [self[i] for i in indices]


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
def test_fetched_groups_are_the_users_batches_through_k_changes_and_back_offs(shuffle: bool, drop_last: bool) -> None:
    def passes(fetch_groups: bool) -> tuple[list[Any], int]:
        dataset = _Records()  # 45 samples in batches of 4: a short last batch unless it is dropped
        loader = DataLoader(
            dataset, batch_size=4, shuffle=shuffle, drop_last=drop_last, generator=torch.Generator().manual_seed(3)
        )
        grouped = ReplicaBatchLoader(loader, 3, fetch_groups=fetch_groups)
        first = _groups(grouped, changes={1: 2, 3: 4}, give_back={2: 1})
        second = _groups(grouped, changes={}, give_back={})  # a second epoch, at k=4
        return [first, second], dataset.fetches

    (fetched, fetches), (one_by_one, single_fetches) = passes(True), passes(False)
    _assert_same(fetched, one_by_one)
    assert sum(len(g) for g in one_by_one[0]) >= 9  # (the pass did go through the changes)
    assert fetches < single_fetches / 2  # a fetch per group, not per batch


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
