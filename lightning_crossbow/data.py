"""Groups k consecutive batches of the user's training DataLoader into one SMA step.

Replica ``j`` of a step takes the ``j``-th batch of the group, so the DataLoader's batch size is the
per-replica batch size and the user's sampler decides the order, exactly as in plain Lightning.
An epoch is one pass over the loader in ``len(loader) // k`` steps: a trailing group with fewer than
``k`` batches is dropped (a warning at set-up names how many batches that is).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from itertools import islice
from typing import Any


class ReplicaBatchLoader:
    """Wraps a loader so that each item is a list of ``num_replicas`` consecutive batches.

    Attributes it does not define (``sampler``, ``batch_sampler``, ``dataset``, ``batch_size``...)
    are read from the wrapped loader, so Lightning's sampler epoch bookkeeping keeps working.
    """

    def __init__(self, loader: Iterable, num_replicas: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}.")
        self.loader = loader
        self.num_replicas = num_replicas
        self.groups_yielded = 0  # in the current pass
        self.batches_taken = 0
        self._returned: list[Any] = []

    def __iter__(self) -> Iterator[list[Any]]:
        """Each group takes ``num_replicas`` batches as set when the group is made: k may change mid-pass."""
        self.groups_yielded = self.batches_taken = 0
        self._returned = []
        batches = iter(self.loader)
        while True:
            group, self._returned = self._returned[: self.num_replicas], self._returned[self.num_replicas :]
            group += list(islice(batches, self.num_replicas - len(group)))
            self.batches_taken += len(group)
            if len(group) < self.num_replicas:
                return
            self.groups_yielded += 1
            yield group

    def give_back(self, batches: list[Any]) -> None:
        """Returns batches of a group that could not run: the next group starts with them, in order."""
        self._returned = list(batches) + self._returned
        self.batches_taken -= len(batches)

    def groups_in_pass(self) -> int:
        """Groups of the current pass: those already made, and those the rest of the loader fills at k now."""
        if not isinstance(self.loader, Sized):
            raise TypeError("The wrapped loader has no length.")
        return self.groups_yielded + (len(self.loader) - self.batches_taken) // self.num_replicas

    def __len__(self) -> int:
        if not isinstance(self.loader, Sized):
            raise TypeError("The wrapped loader has no length.")
        return len(self.loader) // self.num_replicas

    def dropped_batches(self) -> int:
        """Batches per epoch that do not fill a last group of ``num_replicas`` and are skipped."""
        return len(self.loader) % self.num_replicas if isinstance(self.loader, Sized) else 0

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "num_replicas", "groups_yielded", "batches_taken", "_returned"):  # not set yet (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self.loader, name)
