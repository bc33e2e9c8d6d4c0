r"""SpeedBalancer: gives faster devices proportionally more learners (Adaptive SGD), from measured speed.

Each rank measures its own busy time per step ``T_r``: from the end of one step's averaging to the
start of the next step's (data loading, forward, backward and the local optimizer step, but not the
wait for slower ranks). With ``k_r`` learners on rank ``r``, its time per learner-step is
``t_r = T_r / k_r``; a synchronous step then takes ``max_r k_r t_r``. :func:`split_learners` gives the
split of ``K`` learners that minimises it, each rank at least one; the balancer switches to it when
it is predicted to be at least ``min_gain`` faster than the split in force.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Optional

import torch
from torch import Tensor

from lightning_crossbow.routing import Split


def split_learners(seconds_per_learner: Sequence[float], num_learners: int) -> Split:
    r"""The split ``(k_r)`` of ``K`` learners, each ``k_r >= 1``, that minimises ``max_r k_r t_r``.

    Greedy: from one learner per rank, each further learner goes to the rank whose step would then end
    first (``argmin_r (k_r + 1) t_r``, the lowest rank on ties). For ``K`` large ``k_r`` tends to
    ``K (1/t_r) / sum_q (1/t_q)``: learners in proportion to speed.
    """
    ranks = len(seconds_per_learner)
    if num_learners < ranks:
        raise ValueError(f"{num_learners} learners cannot give each of {ranks} ranks one.")
    if any(not t > 0 for t in seconds_per_learner):
        raise ValueError(f"Times per learner-step must be positive, got {list(seconds_per_learner)}.")
    split = [1] * ranks
    for _ in range(num_learners - ranks):
        rank = min(range(ranks), key=lambda r: ((split[r] + 1) * seconds_per_learner[r], r))
        split[rank] += 1
    return tuple(split)


def step_seconds(split: Sequence[int], seconds_per_learner: Sequence[float]) -> float:
    """``max_r k_r t_r``: how long a synchronous step takes with ``split``."""
    return max(k * t for k, t in zip(split, seconds_per_learner, strict=True))


class SpeedBalancer:
    """Measures every rank's time per learner-step and re-splits the learners when that pays.

    Args:
        every: steps per measurement; the median step of the window is taken (robust to the steps that
            hold an epoch's end, validation or a change of k).
        min_gain: switch only when the new split's predicted step time is below ``(1 - min_gain)`` times
            the current one's (hysteresis against noise).
        clock: seconds as a float; tests inject one.
    """

    def __init__(self, every: int = 20, min_gain: float = 0.05, clock: Callable[[], float] = time.perf_counter) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int (steps per measurement), got {every!r}.")
        if not 0.0 <= min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {min_gain!r}.")
        self.every = every
        self.min_gain = min_gain
        self.clock = clock
        self._busy_since: Optional[float] = None
        self._window: list[float] = []  # this rank's seconds per learner-step, one per step
        #: The last measured seconds per learner-step of every rank (None before the first window).
        self.seconds_per_learner: Optional[list[float]] = None
        #: ``(step, split)`` for every split put in force, the first one included.
        self.history: list[tuple[int, Split]] = []

    def restart(self) -> None:
        """Forgets the step in progress (after validation, or at a new fit)."""
        self._busy_since = None
        self._window.clear()

    def sync_done(self) -> None:
        """Called when a step's averaging ends: this rank is busy with its own work from now on."""
        self._busy_since = self.clock()

    def work_done(self, local_learners: int) -> bool:
        """Called before a step's averaging starts; returns whether a window is complete (every rank
        completes it at the same step, so every rank then calls :meth:`rebalance`)."""
        if self._busy_since is not None:
            self._window.append((self.clock() - self._busy_since) / local_learners)
        self._busy_since = None
        return len(self._window) >= self.every

    def rebalance(
        self, split: Split, all_gather: Callable[[Tensor], Tensor], groups_drawn: int
    ) -> tuple[Optional[Split], int]:
        """Ends a window: gathers every rank's median time per learner-step (and how far its data has been
        drawn), and returns ``(new split or None, the first group no rank has drawn)``."""
        mine = statistics.median(self._window) if self._window else float("nan")
        self._window.clear()
        gathered = all_gather(torch.tensor([mine, float(groups_drawn)], dtype=torch.float64))
        seconds, first_free_group = gathered[:, 0].tolist(), int(gathered[:, 1].max())
        if not all(t > 0 for t in seconds):  # a rank had no measured step (nan) or a broken clock
            return None, first_free_group
        self.seconds_per_learner = seconds
        best = split_learners(seconds, sum(split))
        if step_seconds(best, seconds) < (1.0 - self.min_gain) * step_seconds(split, seconds):
            return best, first_free_group
        return None, first_free_group

    def split_for(self, num_learners: int, ranks: int) -> Split:
        """The split of ``num_learners`` by the last measured speeds; as even as possible before any."""
        if self.seconds_per_learner is None:
            return split_learners([1.0] * ranks, num_learners)
        return split_learners(self.seconds_per_learner, num_learners)
