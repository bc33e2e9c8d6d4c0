"""The cross-process operations the averaging rules and the balancer need, as functions over stacked learner rows.

Learner ``i = r * k + j`` is row ``j`` of process ``r``'s ``(k, N)`` stack; ``K = k x world_size``.
Without an initialised process group (one process) all are local.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum_(tensor: Tensor) -> Tensor:
    """Sums ``tensor`` over all processes in place (a no-op without an initialised process group)."""
    if _world()[1] > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def pull_rows(rows: Tensor, shift: int) -> Tensor:
    """``out[j] = learner (r*k + j + shift) mod K``'s row: every learner receives the row ``shift`` ahead.

    Across processes, a rank receives two contiguous blocks, from ranks ``r + q`` and ``r + q + 1``
    (``q, m = divmod(shift mod K, k)``), and sends the matching blocks the other way: point-to-point,
    at most two sends and two receives per rank, and none for blocks that stay on the rank.
    """
    rank, world = _world()
    k = rows.shape[0]
    total = k * world
    q, m = divmod(shift % total, k)
    if world == 1:
        return torch.roll(rows, -m, dims=0)
    out = torch.empty_like(rows)
    # (rows of `out` to fill, source rank, rows of the source) and (rows to send, destination rank).
    receives = [
        (slice(0, k - m), (rank + q) % world, slice(m, k)),
        (slice(k - m, k), (rank + q + 1) % world, slice(0, m)),
    ]
    sends = [(slice(m, k), (rank - q) % world), (slice(0, m), (rank - q - 1) % world)]
    operations = []
    for (target, source, source_rows), (sent_rows, destination) in zip(receives, sends):
        if target.start == target.stop:
            continue
        if source == rank:
            out[target] = rows[source_rows]
            continue
        operations.append(dist.P2POp(dist.irecv, out[target], source))
        operations.append(dist.P2POp(dist.isend, rows[sent_rows].contiguous(), destination))
    if operations:
        for request in dist.batch_isend_irecv(operations):
            request.wait()
    return out


def all_gather_rows(row: Tensor) -> Tensor:
    """Stacks every process's ``row`` (the same shape on all), in rank order: shape ``(world_size, *row.shape)``."""
    world = _world()[1]
    if world == 1:
        return row.unsqueeze(0)
    rows = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(rows, row)
    return torch.stack(rows)


def destroy_process_group_at_exit() -> None:
    """Ends the process group, if one is up (registered with ``atexit`` once per process by the strategy)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
