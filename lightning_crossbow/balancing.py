r"""SpeedBalancer: gives faster devices more learners (Adaptive SGD), and larger batches, from measured speed.

Each rank measures its own busy time per step ``T_r``: from the end of one step's averaging to the
start of the next step's (data loading, forward, backward and the local optimizer step, but not the
wait for slower ranks). With ``k_r`` learners of ``b_r`` samples each on rank ``r`` (``b`` the DataLoader's
batch size) a rank's work is ``u_r = k_r b_r / b`` learner-batches, and ``T_r(u) = a_r + c_r u``
(:class:`StepTime`, fitted to the measurements). A synchronous step takes ``max_r T_r(u_r)``.

:func:`split_learners` gives the split of the ``K`` learners at the DataLoader's batch size that minimises it,
each rank at least one. Where a split of a fixed ``K`` cannot balance the ranks (a slow rank whose fixed cost per
step alone exceeds what a fast one takes with all the other learners), ``max_batch_scale > 1`` lets the ranks that
would wait fill the step instead (:func:`fill_batches`): with the split's step ``T = max_q T_q(k_q)``, rank ``r``'s
learners take

.. math::

    b_r = \max\Big(b, \Big\lfloor b \min\Big(s_{max}, \frac{T - a_r}{c_r k_r}\Big) \Big\rfloor\Big)

samples each, so the rank that sets the pace keeps the user's batch. (A per-learner cost that does not grow with
the batch, such as the optimizer step, is counted in ``c_r`` as if it did, so the fill errs short.) The balancer
switches to the new split and batch sizes when their predicted seconds per sample are at least ``min_gain`` below
those in force.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_crossbow.routing import Layout, Split
from lightning_crossbow.validation import check_clock, check_int, check_real


@dataclass(frozen=True)
class StepTime:
    """``T(u) = fixed + per_learner * u``: a rank's busy seconds per step with ``u`` learner-batches (``k``
    learners at ``s`` times the DataLoader's batch size are ``u = k s``).

    The fixed part (the step's per-call overheads: Python, hooks, kernel launches) matters: with a
    purely proportional model a rank with fewer learners looks slower per learner than it is, and
    the split drifts to the fast rank.
    """

    fixed: float
    per_learner: float

    def __call__(self, learners: float) -> float:
        return self.fixed + self.per_learner * learners

    @classmethod
    def fit(cls, seconds_by_learners: Mapping[float, float]) -> StepTime:
        """Least squares through the measured ``(u, T)``; proportional (``T = (T_1 / u_1) u``) from one point,
        or when the line would not rise with u or would start below 0."""
        points = sorted(seconds_by_learners.items())
        if len(points) >= 2:
            ks, ts = [float(k) for k, _ in points], [t for _, t in points]
            k_mean, t_mean = statistics.fmean(ks), statistics.fmean(ts)
            slope = sum((k - k_mean) * (t - t_mean) for k, t in zip(ks, ts)) / sum((k - k_mean) ** 2 for k in ks)
            intercept = t_mean - slope * k_mean
            if slope > 0 and intercept >= 0:
                return cls(intercept, slope)
        k, t = points[-1]
        return cls(0.0, t / k)


def split_learners(
    step_times: Sequence[Callable[[int], float]], num_learners: int, most: Optional[Sequence[int]] = None
) -> Split:
    r"""The split ``(k_r)`` of ``K`` learners, ``1 <= k_r <= most_r``, that minimises ``max_r T_r(k_r)``.

    Greedy, which is optimal for step times that grow with k: from one learner per rank, each further
    learner goes to the rank, among those with room, whose step would then end first
    (``argmin_r T_r(k_r + 1)``, the lowest rank on ties). With ``T_r(k) = t_r k`` the learners go in
    proportion to speed, ``k_r ~ K (1/t_r) / sum_q 1/t_q``. ``most`` (default: no limit) is what fits
    in each rank's memory.
    """
    ranks = len(step_times)
    most = [num_learners] * ranks if most is None else list(most)
    if num_learners < ranks or sum(min(m, num_learners) for m in most) < num_learners or min(most) < 1:
        raise ValueError(
            f"{num_learners} learners cannot be split over {ranks} ranks with at least one and at most {most}."
        )
    split = [1] * ranks
    for _ in range(num_learners - ranks):
        rank = min((r for r in range(ranks) if split[r] < most[r]), key=lambda r: (step_times[r](split[r] + 1), r))
        split[rank] += 1
    return tuple(split)


def step_seconds(
    split: Sequence[int], step_times: Sequence[Callable[[float], float]], scales: Optional[Sequence[float]] = None
) -> float:
    """``max_r T_r(k_r s_r)``: how long a synchronous step takes with ``split`` (and per-replica batches ``s_r`` times
    the DataLoader's, default 1)."""
    scales = [1.0] * len(split) if scales is None else scales
    return max(time_of(k * s) for k, s, time_of in zip(split, scales, step_times, strict=True))


def fill_batches(
    split: Sequence[int],
    step_times: Sequence[StepTime],
    batch_size: int,
    max_scale: float,
) -> Split:
    r"""Per-replica batch sizes that let every rank fill the step the slowest one takes at ``batch_size``:
    ``b_r = max(b, floor(b min(s_max, (T - a_r) / (c_r k_r))))`` with ``T = max_q T_q(k_q)``."""
    pace = step_seconds(split, step_times)
    sizes = []
    for k, model in zip(split, step_times, strict=True):
        room = (pace - model.fixed) / (model.per_learner * k) if model.per_learner > 0 else max_scale
        sizes.append(max(batch_size, math.floor(batch_size * min(max_scale, room) + 1e-9)))
    return tuple(sizes)


def seconds_per_sample(layout: Layout, step_times: Sequence[StepTime], batch_size: int) -> float:
    """A synchronous step's predicted seconds over the samples it trains on (all ranks')."""
    scales = [b / batch_size for b in layout.batch_sizes]
    samples = sum(k * b for k, b in zip(layout.split, layout.batch_sizes))
    return step_seconds(layout.split, step_times, scales) / samples


class SpeedBalancer:
    """Measures every rank's busy time per step and re-splits the learners (and sizes their batches) when that pays.

    Each window, every rank's median busy seconds per step ``T_r`` at its ``u_r`` learner-batches are gathered
    (one small all-gather), with how many more learners fit in its memory. Per rank, the latest ``T`` at each of
    the last ``remember`` distinct u fit a :class:`StepTime` model; :func:`split_learners` splits the
    same ``K`` by the models, within memory, :func:`fill_batches` sizes the faster ranks' batches (with
    ``max_batch_scale > 1``), and the balancer switches when the predicted seconds per sample are at
    least ``min_gain`` lower. A first window at an even split only gives proportional models; the
    next window at the new split corrects them.

    Args:
        every: steps per window; the window's median step counts (robust to the steps that hold an
            epoch's end, validation or a change of k).
        min_gain: switch only when the new split's predicted seconds per sample are below ``(1 - min_gain)``
            times the current one's (hysteresis against noise).
        remember: distinct u per rank whose measurements the models keep (older ones are dropped, so the
            models follow a device whose speed changes).
        clock: seconds as a float; tests inject one.
        max_batch_scale: the largest per-replica batch a faster rank's learners may take, as a multiple of the
            DataLoader's batch size (default 1: every learner keeps the user's batch). Above 1, where a split of
            the learners cannot balance the ranks, the faster ranks' learners take larger batches (Adaptive SGD)
            instead of waiting; their samples weigh in z's update by their number. Each learner's activations
            grow with its batch: the value bounds what the device's memory must hold.
        lr_follows_batch: with larger batches, whether a learner of ``s`` times the DataLoader's batch steps at ``s``
            times the learning rate (Adaptive SGD's ``lr_i = lr b_i / b``, the linear scaling rule), during its local
            optimizer step only; otherwise every learner keeps the user's learning rate.
    """

    def __init__(
        self,
        every: int = 20,
        min_gain: float = 0.05,
        remember: int = 3,
        clock: Callable[[], float] = time.perf_counter,
        max_batch_scale: float = 1.0,
        lr_follows_batch: bool = False,
    ) -> None:
        check_int("every", every, note=" (steps per window)")
        check_real("max_batch_scale", max_batch_scale, ">= 1 (times the DataLoader's batch size)", lambda v: v >= 1.0)
        check_real("min_gain", min_gain, "in [0, 1)", lambda value: 0.0 <= value < 1.0)
        check_int("remember", remember, note=" (distinct k per rank)")
        check_clock(clock)
        self.every = every
        self.min_gain = min_gain
        self.remember = remember
        self.clock = clock
        self.max_batch_scale = float(max_batch_scale)
        if not isinstance(lr_follows_batch, bool):
            raise ValueError(f"lr_follows_batch must be True or False, got {lr_follows_batch!r}.")
        self.lr_follows_batch = lr_follows_batch
        self._busy_since: Optional[float] = None
        self._window: list[float] = []  # this rank's busy seconds, one per step
        self._window_resumes = False  # a window restored from a checkpoint, until training starts
        #: Per rank, measured busy seconds per step by learner-batches u (insertion order: oldest first).
        self.measured: list[dict[float, float]] = []
        #: ``(step, split, batch sizes)`` for every layout scheduled, the first one included (batch sizes None: the
        #: DataLoader's on every rank).
        self.history: list[tuple[int, Split, Optional[Split]]] = []
        #: The most learners that fit in each rank's memory, at the last window (None before it).
        self.most: Optional[list[int]] = None

    def restart(self) -> None:
        """Forgets the step in progress and the window (at a new fit, or when another split comes in force)."""
        self._busy_since = None
        self._window.clear()
        self._window_resumes = False

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the measurements the models fit and the most learners per rank (every rank's, the
        same on each), the layouts scheduled, and this rank's window so far."""
        return {
            "measured": [[[units, seconds] for units, seconds in by_u.items()] for by_u in self.measured],
            "most": self.most,
            "history": [[step, list(split), list(sizes) if sizes else None] for step, split, sizes in self.history],
            "window": list(self._window),
        }

    def load_state_dict(self, state: Mapping[str, Any], window: bool = True) -> None:
        """Goes on from a checkpoint's :meth:`state_dict` (of as many ranks): the models from its measurements and,
        with ``window`` (the fit carries on its layout), its layouts scheduled and its window, to which the first
        step adds, measured from when training starts (:meth:`resume_window`), as the step after the save would
        have."""
        self.measured = [{float(units): float(seconds) for units, seconds in by_u} for by_u in state["measured"]]
        self.most = list(state["most"]) if state["most"] is not None else None
        if window:
            self.history = [
                (int(step), tuple(split), tuple(sizes) if sizes else None) for step, split, sizes in state["history"]
            ]
            self._window = [float(seconds) for seconds in state["window"]]
            self._window_resumes = True

    def resume_window(self) -> None:
        """When training starts (after the sanity check and the loader's set-up): a window restored by
        :meth:`load_state_dict` measures the first step from here."""
        if self._window_resumes:
            self._window_resumes = False
            self._busy_since = self.clock()

    def forget_measurements(self) -> None:
        """Drops the models' measurements and the window (taken in learner-batches of another DataLoader batch
        size): the next windows measure afresh."""
        self.measured, self.most = [], None
        self.restart()

    def sync_done(self) -> None:
        """Called when a step's averaging ends: this rank is busy with its own work from now on."""
        self._busy_since = self.clock()

    def work_done(self) -> bool:
        """Called before a step's averaging starts; returns whether the window is complete (every rank
        completes it at the same step, so every rank then calls :meth:`rebalance`)."""
        if self._busy_since is not None:
            self._window.append(self.clock() - self._busy_since)
        self._busy_since = None
        return len(self._window) >= self.every

    def step_times(self) -> Optional[list[StepTime]]:
        """Every rank's fitted model, or None before the first window."""
        if not self.measured:
            return None
        return [StepTime.fit(by_k) for by_k in self.measured]

    def rebalance(
        self, layout: Layout, batch_size: int, all_gather: Callable[[Tensor], Tensor], groups_drawn: int, room: int
    ) -> tuple[Optional[Layout], int]:
        """Ends a window: gathers every rank's median busy seconds at its layout, how far its data has been drawn,
        and how many more learners fit in its memory (``room``); returns ``(new layout or None, the first group no
        rank has drawn)``. ``batch_size`` is the DataLoader's."""
        split = layout.split
        mine = statistics.median(self._window) if self._window else float("nan")
        self._window.clear()
        gathered = all_gather(torch.tensor([mine, float(groups_drawn), float(room)], dtype=torch.float64))
        seconds, first_free_group = gathered[:, 0].tolist(), int(gathered[:, 1].max())
        self.most = [k + int(extra) for k, extra in zip(split, gathered[:, 2].tolist())]
        if not all(t > 0 for t in seconds):  # a rank had no measured step (nan) or a broken clock
            return None, first_free_group
        if len(self.measured) != len(split):
            self.measured = [{} for _ in split]
        for by_u, k, b, t in zip(self.measured, split, layout.batch_sizes, seconds):
            units = k * b / batch_size
            by_u.pop(units, None)  # re-inserted as the newest
            by_u[units] = t
            while len(by_u) > self.remember:
                del by_u[next(iter(by_u))]
        models = self.step_times()
        assert models is not None
        if sum(self.most) < sum(split):
            return None, first_free_group
        best_split = split_learners(models, sum(split), self.most)
        best = Layout(best_split, fill_batches(best_split, models, batch_size, self.max_batch_scale))
        now = seconds_per_sample(layout, models, batch_size)
        if best != layout and seconds_per_sample(best, models, batch_size) < (1.0 - self.min_gain) * now:
            return best, first_free_group
        return None, first_free_group

    def split_for(self, num_learners: int, ranks: int) -> Split:
        """The split of ``num_learners`` by the models measured so far; as even as possible before any."""
        models = self.step_times()
        if models is None or len(models) != ranks:
            return split_learners([StepTime(0.0, 1.0)] * ranks, num_learners)
        most = self.most if self.most is not None and sum(self.most) >= num_learners else None
        return split_learners(models, num_learners, most)
