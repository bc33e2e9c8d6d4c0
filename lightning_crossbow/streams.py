"""CUDA streams for ``engine="streams"``: each replica on its own stream, as Crossbow runs its learners.

A :class:`StreamPool` belongs to one CUDA device (:class:`~lightning_crossbow.CrossbowAccelerator` keeps one
per device). It holds one stream per replica, grown as k grows and reused from step to step, and one
synchronisation stream on which the model averaging runs. Work on different streams is ordered by CUDA
events only, never by a host-side synchronize:

- the replica streams wait for everything queued before the step on the issuing stream (the batch's copy
  to the device, the previous step's averaging);
- the issuing stream waits for every replica stream before it combines their losses; the backward pass then
  runs each replica's operations on that replica's stream by itself (autograd runs a backward operation on
  the stream of its forward operation) and orders its result on the issuing stream;
- the averaging waits for the local step, and the issuing stream waits for the averaging.

The pool's methods are the whole interface the engine and the strategy use, so a test can stand in a
pool of host-side streams and check the order of the work without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor


class StreamPool:
    """The replica streams and the synchronisation stream of one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA streams need a CUDA device, got {device}.")
        self.device = device
        self._replica_streams: list[torch.cuda.Stream] = []
        self.sync_stream = torch.cuda.Stream(device)

    def replica_streams(self, count: int) -> list[torch.cuda.Stream]:
        """The streams of replicas ``0 .. count-1`` (created on first use, then reused)."""
        while len(self._replica_streams) < count:
            self._replica_streams.append(torch.cuda.Stream(self.device))
        return self._replica_streams[:count]

    def current(self) -> torch.cuda.Stream:
        """The stream the step is issued on (Lightning's: the device's current stream)."""
        return torch.cuda.current_stream(self.device)

    def use(self, stream: torch.cuda.Stream) -> Any:
        """A context in which work is queued on ``stream``."""
        return torch.cuda.stream(stream)

    @staticmethod
    def wait(waiting: torch.cuda.Stream, on: torch.cuda.Stream) -> None:
        """Work queued on ``waiting`` from now on starts after the work queued on ``on`` so far (a CUDA event)."""
        waiting.wait_event(on.record_event())

    @staticmethod
    def keep_for(tensor: Tensor, stream: torch.cuda.Stream) -> None:
        """``tensor`` was allocated on another stream: its memory is not reused before ``stream`` is done with it."""
        tensor.record_stream(stream)

    def synchronize(self) -> None:
        """Waits on the host until the device has done all work queued on it (for timing)."""
        torch.cuda.synchronize(self.device)

    @contextmanager
    def on_sync_stream(self) -> Iterator[None]:
        """Queues the block on the synchronisation stream, after the work queued so far on the current stream;
        the current stream's later work waits for the block's."""
        current = self.current()
        self.wait(self.sync_stream, current)
        with self.use(self.sync_stream):
            yield
        self.wait(current, self.sync_stream)
