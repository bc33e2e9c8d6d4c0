"""ReplicaAutoTuner: chooses k, the replicas per device, while training runs (Crossbow's auto-tuning).

Every measurement is a window of ``window`` training steps, the first ``warmup`` steps after a change
excluded; a step's time runs from the previous step's end to its own, and intervals that hold
validation or an epoch boundary are not counted, nor the steps in which ``engine="auto"`` is still
timing fused against streams (CUDA).

- ``objective="throughput"`` (Crossbow's policy): hold the largest k whose last replica raised samples/s
  by more than ``threshold`` of a replica's share, when the next replica does not. The gain of going
  from k-1 to k replicas is ``(R_k - R_{k-1}) / (R_{k-1} / (k-1))``: 1 when throughput scales linearly,
  whatever k. (A plain relative gain ``R_k / R_{k-1} - 1`` is at most ``1/(k-1)`` even with perfect
  scaling, so a 10% threshold would stop near k=10 on any device, and noise stops it far earlier.)
  By default it climbs one replica at a time, as Crossbow does (``climb="linear"``); ``"doubling"``
  doubles k while the replicas pay off and then halves the gap. Both hold at the same k when each
  replica pays off less than the one before; doubling spends fewer windows at small k on the way up
  (k=16 after 8 windows instead of 16) for a few more windows when the best k is small. Before it holds, it
  measures the last pair (k, k+1) once more and judges on both windows of each; then it judges k+2 against
  k (``look_ahead``: the two replicas' mean gain), so that one replica that adds nothing does not stop the
  climb below a k that pays off. Every
  ``recheck_every`` windows' worth of steps it searches again from the held k, starting with one more
  replica.
- ``objective="progress"``: time to accuracy is time per sample x samples to accuracy (Omnivore), and
  more replicas can need more samples. Progress per second is the decrease of the training loss per
  second (the least-squares slope of the per-step loss, mean over replicas, against wall time). The
  loss falls more slowly as training goes on, so a trial of k+1 is compared with windows at k just
  before and just after it (A-B-A); k+1 is kept while it beats their mean by more than ``threshold``.

Both are bounded by
``min_replicas``/``max_replicas`` and by memory (every replica added must fit twice over in the
free memory of every rank's device: RAM on CPU, the accelerator's free memory on CUDA), and below any k
at which the strategy ran out of memory (it backs off one replica and retries the step by itself).
Where the batch size is unknown (a custom ``batch_sampler``), throughput counts batches, not samples.

In multi-process runs rank 0 decides and broadcasts; every rank applies the same k at the same step.
With ``CrossbowStrategy(heterogeneous=True)`` the tuned k is the mean per device (``K = k x world_size``
learners) and samples/s the mean per device; the strategy's balancer splits ``K`` over the ranks by
their measured speed.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_crossbow.validation import check_clock, check_int, check_real

OBJECTIVES = ("throughput", "progress")
CLIMBS = ("linear", "doubling")


@dataclass
class TuningRecord:
    """One measured window, ending at ``step``: samples/s and training-loss decrease per second at k."""

    step: int
    replicas_per_device: int
    samples_per_sec: float
    progress_per_sec: float = float("nan")


@dataclass
class Climb:
    """Where the throughput search stands (see ``ReplicaAutoTuner._decide``): the largest k whose last
    replica paid off (``low``), the smallest k whose last replica did not (``high``, None until found), the k
    being judged (``probe``), whether this judgement is the second look before holding, whether the probe is
    a look ahead (``low + 2``, judged against ``low``), whether this is a search again from a held k (its first
    probe is one more replica, whatever the climb), and the k judged not to pay off so far."""

    low: Optional[int] = None
    high: Optional[int] = None
    probe: Optional[int] = None
    confirming: bool = False
    ahead: bool = False
    again: bool = False
    failed: list[int] = field(default_factory=list)  #: every k judged not to pay off in one window

    def climb_on_from(self, k: int) -> None:
        """``k`` paid off after all: the climb goes on from it, below the smallest failure further up (if any)."""
        self.low = k
        self.high = min((failed for failed in self.failed if failed > k), default=None)


class ReplicaAutoTuner(Callback):
    """Tunes ``replicas_per_device`` of a :class:`~lightning_crossbow.CrossbowStrategy` during fit.

    Args:
        objective: ``"throughput"`` (default: maximise samples/s, Crossbow's policy; with the default
            ``scaled_averaging`` rule it reached the benchmarks' accuracy targets sooner, see
            benchmarks/RESULTS.md) or ``"progress"`` (maximise the training loss's decrease per second).
        min_replicas, max_replicas: bounds on k (training starts at ``min_replicas`` at least, memory and the
            epoch's length permitting, with a warning where they do not; no other window is measured outside
            them).
        window: steps per measurement, counted as Lightning counts a fit's batches: one per crossbow step of k
            batches (with ``accumulate_grad_batches=n``, n of them make one optimizer step).
        warmup: steps after each change that are not measured.
        threshold: the gain that justifies one more replica: for ``"throughput"`` the samples/s the last
            replica added, as a fraction of the average replica's; for ``"progress"`` the relative gain
            in loss decrease per second.
        climb: ``"throughput"`` only: how the search climbs until a replica stops paying off: ``"linear"``
            (default, Crossbow's: one replica at a time) or ``"doubling"`` (probes k = 2, 4, 8, ..., then halves
            the gap). Both hold at the same k when each added replica pays off less than the one before;
            doubling gets to a large k in far fewer windows, and takes a few more when the best k is small.
            Doubling reaches the best samples/s sooner, but the slower climb reached the accuracy targets
            sooner in benchmarks/RESULTS.md: the epochs at small k early on are worth more (fewer learners
            need fewer epochs).
        look_ahead: ``"throughput"`` only: before holding at k, judge ``k + 2`` against k as well (the mean gain
            of the two replicas), so that one replica that adds nothing (a flat step in the device's throughput,
            where a batched kernel changes its blocking, say) does not stop the climb below a k that pays off.
            Where each replica pays off less than the one before, the pair pays off less than the first of them,
            so the tuner holds at the same k, one window later. ``False`` is Crossbow's rule exactly.
        recheck_every: once it holds, the tuner explores again (from the held k, with the same rule) after
            this many windows' worth of steps, so that a choice made on noisy windows, or on conditions that
            changed, is revisited; ``None`` holds for good.
        clock: seconds as a float; tests inject one.
        plot: where to save a plot of k over time and samples/s per k when training ends (rank 0, needs
            matplotlib): a file path (``~`` expanded; its suffix sets the format, as in matplotlib's ``savefig``:
            ``.png``, ``.pdf``, ...; without one, ``.png`` is added; checked before training), ``None`` for
            ``<trainer.log_dir>/replica_tuning.png``, or ``False``. An existing file is never overwritten: the
            plot goes to the first free ``<name>-v1``, ``<name>-v2``, ... beside it (as ``ModelCheckpoint``
            names its files), and the summary says where.

    Under ``Trainer(fast_dev_run=...)`` it does nothing, as Lightning's own tuner, checkpoints and loggers do in a
    dry run: k stays where training starts, and no plot or summary is written.
    """

    def __init__(
        self,
        objective: Literal["throughput", "progress"] = "throughput",
        min_replicas: int = 1,
        max_replicas: int = 16,
        window: int = 20,
        warmup: int = 3,
        threshold: float = 0.1,
        climb: Literal["linear", "doubling"] = "linear",
        look_ahead: bool = True,
        recheck_every: Optional[int] = 10,
        clock: Callable[[], float] = time.perf_counter,
        plot: Union[Literal[False], str, Path, None] = None,  # (False first: a CLI's 'false' is False, not a file)
    ) -> None:
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(map(repr, OBJECTIVES))}, got {objective!r}.")
        for name, value, least in (("min_replicas", min_replicas, 1), ("window", window, 1), ("warmup", warmup, 0)):
            check_int(name, value, least)
        check_int("max_replicas", max_replicas, least=min_replicas, note=f" (min_replicas={min_replicas})")
        check_real("threshold", threshold, ">= 0", lambda value: value >= 0)
        if climb not in CLIMBS:
            raise ValueError(f"climb must be one of {', '.join(map(repr, CLIMBS))}, got {climb!r}.")
        if not isinstance(look_ahead, bool):
            raise ValueError(f"look_ahead must be True or False, got {look_ahead!r}.")
        ignored = [
            f"{name}={value!r}"
            for name, value, default in (("climb", climb, "linear"), ("look_ahead", look_ahead, True))
            if value != default
        ]
        if objective == "progress" and ignored:
            raise ValueError(
                f"{' and '.join(ignored)} {'apply' if len(ignored) > 1 else 'applies'} to objective='throughput'"
                " only: objective='progress' compares each trial of k+1 with windows at k before and after it, one"
                " replica at a time."
            )
        if recheck_every is not None:
            check_int("recheck_every", recheck_every, note=" or None")
        check_clock(clock)
        if plot is not None and plot is not False and (not isinstance(plot, (str, os.PathLike)) or not str(plot)):
            raise ValueError(
                f"plot must be a path (str or os.PathLike), None (in the trainer's log_dir) or False, got {plot!r}."
            )
        self.objective = objective
        self.min_replicas, self.max_replicas = min_replicas, max_replicas
        self.window, self.warmup, self.threshold = window, warmup, float(threshold)
        self.climb = climb
        self.look_ahead = look_ahead
        self.recheck_every = recheck_every
        self.clock = clock
        self.plot = plot
        self.history: list[TuningRecord] = []
        #: The k the tuner settled on (None while it is still exploring).
        self.chosen: Optional[int] = None
        self._steps_since_change = 0
        self._steps_held = 0  # training steps since the tuner last chose
        self._last_step_end: Optional[float] = None  # None after anything that is not a training step
        self._window_seconds = 0.0
        self._window_samples = 0
        self._window_steps = 0
        # (training seconds, mean loss over replicas), in runs of consecutive steps: a skipped interval
        # (validation, an epoch's end) starts a new run.
        self._window_losses: list[list[tuple[float, float]]] = []
        self._window_replicas: Optional[int] = None  # the k the window in progress measures (None: none yet)
        self._window_restored = False  # whether that window came from a checkpoint (it then counts on)
        #: The k the tuner last changed from, while steps still run at it (a group fetched before the change).
        self._changing_from: Optional[int] = None
        self._changing_to: Optional[int] = None  #: the k asked for while ``_changing_from``
        self._windows_before_fit = self._step_at_fit_start = 0  # (set at each fit's start)
        #: "progress": where the A-B-A is ("before", "trial", "after"; see ``_decide_progress``).
        self._phase: Literal["before", "trial", "after"] = "before"
        self._climb = Climb()  #: "throughput": the search (see ``_decide``)
        self._room: Optional[int] = None  # more replicas that fit on every rank, at the last window's end
        self._before: Optional[TuningRecord] = None
        self._trial: Optional[TuningRecord] = None

    # ------------------------------------------------------------------------------- hooks
    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        from lightning_crossbow.strategy import CrossbowStrategy  # the strategy module imports this one

        if not isinstance(trainer.strategy, CrossbowStrategy):
            raise TypeError(
                f"ReplicaAutoTuner tunes CrossbowStrategy's replicas_per_device; the trainer's strategy is"
                f" {type(trainer.strategy).__name__}. Use Trainer(strategy='crossbow')."
            )
        trainer.strategy.restore_replicas_per_device = True  # a resumed run carries on with the tuned k
        if trainer.strategy.replicas_per_device > self.max_replicas:  # (before the training loader groups at it)
            trainer.strategy.set_replicas_per_device(self.max_replicas)
        if self.plot:
            _check_plot_path(self.plot)

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Starts within ``[min_replicas, max_replicas]`` (at least ``min_replicas`` as far as the ceiling allows): no
        window is measured outside them. What the tuner carries from before this fit (a checkpoint's state, or
        this callback's earlier fit) goes on within this fit's bounds: a held k is trained at (clipped to the
        bounds), a search whose k fall outside them starts again from the k training starts at, and a window
        measured at another k than that starts again (a window restored from a checkpoint counts on at its k; one
        left by this callback's earlier fit starts again: no window is measured across two fits). Where memory or
        the epoch's length keep k below ``min_replicas``, a warning says so."""
        if trainer.fast_dev_run:
            return
        strategy = trainer.strategy
        self._last_step_end = None  # the interval up to the first step holds the fit's set-up
        self._after_averaging = True  # whether the last step ended with an averaging (a fit starts after none)
        self._windows_before_fit, self._step_at_fit_start = len(self.history), trainer.global_step
        k = strategy.tuned_replicas_per_device
        self._room = strategy.replica_room()  # a collective: every rank starts training here
        if self.chosen is not None:
            start = self.chosen = min(max(self.chosen, self.min_replicas), self._ceiling(k, strategy))
        else:
            start = min(max(k, min(self.min_replicas, self._ceiling(k, strategy))), self.max_replicas)
            if not self._search_within(self.min_replicas, self.max_replicas):
                self._climb, self._phase, self._before, self._trial = Climb(), "before", None, None
        if start < self.min_replicas:
            rank_zero_warn(
                f"crossbow ReplicaAutoTuner: min_replicas={self.min_replicas}, but training starts at k={start}:"
                f" {self._what_bounds(start, strategy)}. Windows are measured from k={start}."
            )
        if start != k:
            self._change(strategy, k, start)  # (every rank, at the same point)
        if not self._window_restored or self._window_replicas != start:
            self._new_window()
        self._window_restored = False

    def _search_within(self, lowest: int, highest: int) -> bool:
        """Whether every k the search in progress has judged or will judge lies in ``[lowest, highest]``."""
        climb = self._climb
        ks = [climb.low, climb.high, climb.probe, *climb.failed]
        ks += [record.replicas_per_device for record in (self._before, self._trial) if record is not None]
        return all(lowest <= k <= highest for k in ks if k is not None)

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.fast_dev_run:
            return
        if self.chosen is not None:
            self._hold_or_explore_again()
            return
        strategy = trainer.strategy
        now, last = self.clock(), self._last_step_end
        self._last_step_end = now
        # With averaging_period > 1 a window holds whole periods: it starts right after an averaging and ends at one
        # (steps that average take longer than those that do not).
        averaged, after_averaging = _just_averaged(strategy), self._after_averaging
        self._after_averaging = averaged
        if self._changing_from is not None:
            ceiling = strategy.replica_ceiling  # (below the k asked for: it ran out of memory and came back)
            backed_off = ceiling is not None and self._changing_to is not None and ceiling < self._changing_to
            if strategy.tuned_replicas_per_device == self._changing_from and not backed_off:
                return  # a group fetched at the old k before the change (a loader without a length): not the new k's
            self._changing_from = None
        self._steps_since_change += 1
        self._window_replicas = strategy.tuned_replicas_per_device
        if (
            self._steps_since_change <= self.warmup
            or last is None
            or strategy.engine_measuring
            or (self._window_steps == 0 and not after_averaging)
        ):
            if self._window_losses and self._window_losses[-1]:
                self._window_losses.append([])
            return  # a warm-up step, one whose interval holds validation or an epoch's end, or an engine trial
        # One step's interval: from the previous step's end (its batch fetched in between) to this end.
        self._window_seconds += now - last
        self._window_samples += _work_of_step(strategy)
        self._window_steps += 1
        loss = _mean_loss(outputs) if self.objective == "progress" else None
        if loss is not None:  # (None: every replica skipped the step)
            if not self._window_losses:
                self._window_losses.append([])
            self._window_losses[-1].append((self._window_seconds, loss))
        if self._window_steps < self.window or strategy.accumulating or not averaged:  # k changes right after a step
            return
        k = strategy.tuned_replicas_per_device  # in heterogeneous mode, the mean over ranks
        self._room = strategy.replica_room()  # a collective: every rank ends this window at this step
        record = TuningRecord(
            trainer.global_step,
            k,
            self._window_samples / max(self._window_seconds, 1e-12),
            -_slope(self._window_losses) if self.objective == "progress" else float("nan"),
        )
        self.history.append(record)
        next_k = k
        if trainer.is_global_zero:  # rank 0 decides; every rank takes its decision at this same step
            next_k = (
                self._decide_progress(record, strategy) if self.objective == "progress" else self._decide(k, strategy)
            )
        next_k, self.chosen, self._phase, self._climb = strategy.broadcast(
            (next_k, self.chosen, self._phase, self._climb), src=0
        )
        if next_k != k:
            self._change(strategy, k, next_k)
        self._new_window()

    def _change(self, strategy: Any, k: int, new_k: int) -> None:
        """Asks the strategy for ``new_k``; steps that still run at ``k`` (groups fetched before) are not measured."""
        strategy.set_replicas_per_device(new_k)
        self._changing_from = k if strategy.tuned_replicas_per_device == k else None
        self._changing_to = new_k

    def _what_bounds(self, k: int, strategy: Any) -> str:
        """Why k is at most ``k``: the first of the bounds of :meth:`_ceiling` that holds it there."""
        if strategy.replica_ceiling is not None and strategy.replica_ceiling <= k:
            return f"k={strategy.replica_ceiling + 1} ran out of memory"
        keeping = strategy.replicas_keeping_validation()
        if keeping is not None and keeping <= k:
            return (
                f"a larger k would leave an epoch fewer steps than val_check_interval="
                f"{strategy.lightning_module.trainer.val_check_interval}, and it would not validate"
            )
        fitting = strategy.replicas_fitting_an_epoch()
        if fitting is not None and fitting <= k:
            return (
                "a larger k would leave more than a tenth of every epoch's batches out of its last, unfilled step"
                " (give the training loader more batches, or lower min_replicas)"
            )
        return "more replicas would not fit twice in the free memory"

    def _hold_or_explore_again(self) -> None:
        """Counts a held step; after ``recheck_every`` windows' worth, explores again from the held k.

        Every rank counts the same steps, so all of them start exploring at the same step."""
        if self.recheck_every is None:
            return
        self._steps_held += 1
        if self._steps_held >= self.recheck_every * (self.window + self.warmup):
            self.chosen, self._phase, self._steps_held, self._last_step_end = None, "before", 0, None
            self._climb = Climb(again=True)
            self._new_window()

    def _new_window(self) -> None:
        """Starts a measurement afresh: its warm-up steps first, then ``window`` counted steps."""
        self._steps_since_change = self._window_steps = self._window_samples = 0
        self._window_seconds, self._window_losses, self._window_replicas = 0.0, [], None

    @override
    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._last_step_end = None  # the next interval would hold the epoch's end and the next epoch's start

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._last_step_end = None

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if trainer.fast_dev_run:
            return
        if len(self.history) == self._windows_before_fit:
            if self.chosen is None and trainer.global_step > self._step_at_fit_start:
                rank_zero_warn(
                    f"crossbow ReplicaAutoTuner measured no window in this fit, so k stayed at"
                    f" {trainer.strategy.replicas_per_device}: a window takes warmup + window = {self.warmup} +"
                    f" {self.window} steps in a row, and an interval that holds validation or an epoch's end is not"
                    " counted. Lower window or warmup, or validate less often."
                )
            if not self.history:
                return
        # trainer.log_dir is a collective under several processes: every rank reads it.
        path = _plot_file(self.plot) if self.plot else Path(trainer.log_dir or ".") / "replica_tuning.png"
        if trainer.is_global_zero:
            k = trainer.strategy.replicas_per_device
            saved = self.save_plot(_free_path(path), end=(trainer.global_step, k)) if self.plot is not False else None
            rank_zero_info(self.summary(current=k) + (f"\nPlot: {saved}" if saved is not None else ""))

    # ------------------------------------------------------------------------------ policy
    def _decide(self, k: int, strategy: Any) -> int:
        """The throughput search, after a window measured at ``k``; returns the k of the next window.

        ``P(m)``, "the m-th replica paid off", is judged on two windows adjacent in time, at ``m-1`` and at
        ``m``: the gain ``(R_m - R_{m-1}) / (R_{m-1} / (m-1))`` must exceed ``threshold``. The search keeps
        ``low``, the largest k shown to pay off, and ``high``, the smallest shown not to (if any), and probes
        ``low+1`` (``climb="linear"``, Crossbow's) or ``2 low`` (``"doubling"``) while there is no ``high``,
        then halves the gap; a search again from a held k probes ``low+1`` first. When the gap closes
        (``high = low + 1``) the pair is measured once more and judged on both windows of each, so one noisy
        window neither stops the climb early nor settles on a k that the second look refutes: the tuner climbs
        on from ``high``, or (``look_ahead``) judges ``low + 2`` against ``low``'s windows,
        ``(R_{low+2} - R_low) / (2 R_low / low) > threshold``, and climbs on from ``low + 2`` or holds ``low``.
        A probe that no longer fits (memory) counts as not paying off.
        """
        climb = self._climb
        if climb.low is None:  # the first window of an exploration: where it starts
            climb.low = k
            return self._next_probe(k, strategy)
        probe = climb.probe
        assert probe is not None
        if probe > self._ceiling(k, strategy):  # it no longer fits (an out-of-memory back-off, less free memory)
            climb.confirming, climb.high = False, probe
            if climb.ahead:
                climb.ahead = False
                return self._hold(climb.low, strategy)
            return self._next_probe(k, strategy)
        if k != probe:  # this window measured probe - 1 (or k moved by a back-off): now the probe, after probe - 1
            return probe if k == probe - 1 else probe - 1
        base = climb.low if climb.ahead else probe - 1
        paid = self._gain(probe, base, windows=2 if climb.confirming else 1) > self.threshold
        if climb.ahead:
            climb.ahead = False
            if not paid:
                return self._hold(climb.low, strategy)
            climb.climb_on_from(probe)  # the pair paid off: the climb goes on from low + 2
        elif climb.confirming:
            climb.confirming = False
            if not paid:
                if self.look_ahead and climb.low + 2 <= self._ceiling(k, strategy):
                    climb.ahead, climb.probe = True, climb.low + 2  # judged against the windows at low
                    return climb.probe
                return self._hold(climb.low, strategy)
            climb.climb_on_from(probe)  # the second look refuted the failure
        elif paid:
            climb.low = probe
        else:
            climb.high = probe
            climb.failed.append(probe)
        if climb.high == climb.low + 1:  # the gap closed: a second look at low and high before holding
            climb.confirming, climb.probe = True, climb.high
            return climb.low
        return self._next_probe(k, strategy)

    def _next_probe(self, k: int, strategy: Any) -> int:
        """Chooses the next k to judge (see :meth:`_decide`) and returns the k of the next window: the probe,
        or the probe's lower neighbour first unless this window (at ``k``) measured it."""
        climb = self._climb
        assert climb.low is not None
        if climb.high is None:
            target = climb.low + 1 if self.climb == "linear" or climb.again else 2 * climb.low
            climb.again = False
        else:
            target = (climb.low + climb.high) // 2
        target = min(target, self._ceiling(k, strategy))
        if target <= climb.low:
            return self._hold(climb.low, strategy)
        climb.probe = target
        return target if k == target - 1 else target - 1

    def _hold(self, k: int, strategy: Any) -> int:
        """Holds k, at least ``min_replicas`` and at most the ceiling (which an out-of-memory back-off may have
        lowered below a k already judged to pay off, or below ``min_replicas``)."""
        self.chosen = min(max(k, self.min_replicas), self._ceiling(k, strategy))
        return self.chosen

    def _gain(self, k: int, base: int, windows: int) -> float:
        """What each replica from ``base`` to ``k`` added to samples/s, in units of an average replica's at
        ``base``: ``(R_k - R_base) / ((k - base) R_base / base)``, over the last ``windows`` windows at each."""
        lower = [r.samples_per_sec for r in self.history if r.replicas_per_device == base][-windows:]
        upper = [r.samples_per_sec for r in self.history if r.replicas_per_device == k][-windows:]
        if not lower or not upper or sum(lower) <= 0:
            return -math.inf  # nothing to compare with: not shown to pay off
        lower_rate, upper_rate = sum(lower) / len(lower), sum(upper) / len(upper)
        return (upper_rate - lower_rate) / ((k - base) * lower_rate / base)

    def _decide_progress(self, record: TuningRecord, strategy: Any) -> int:
        """A-B-A: measure k, then k+1, then k again; keep k+1 if it beats the mean of both k windows."""
        k = record.replicas_per_device
        if self._phase == "before":
            if k >= self._ceiling(k, strategy):
                self.chosen = k
                return k
            self._before, self._phase = record, "trial"
            return k + 1
        if self._phase == "trial":
            self._trial, self._phase = record, "after"
            return k - 1
        assert self._before is not None and self._trial is not None
        baseline = (self._before.progress_per_sec + record.progress_per_sec) / 2
        self._phase = "before"
        if self._trial.progress_per_sec > baseline + self.threshold * abs(baseline):
            return k + 1  # k+1 becomes the baseline, measured afresh next to the next trial
        self.chosen = k
        return k

    def _ceiling(self, k: int, strategy: Any) -> int:
        """The largest k allowed: ``max_replicas``, below any k that ran out of memory, such that every
        replica beyond ``k`` (weights, gradients, two optimizer states, corrections) fits twice in the free
        memory of every rank (measured at the end of the last window), and such that no k on the way leaves
        more than a tenth of an epoch's batches out of its last, unfilled step, nor an epoch fewer steps than an
        integer ``val_check_interval`` (:meth:`~lightning_crossbow.CrossbowStrategy.replicas_fitting_an_epoch`)."""
        ceiling = min(self.max_replicas, strategy.replica_ceiling or self.max_replicas)
        fitting = strategy.replicas_fitting_an_epoch()
        if fitting is not None:
            ceiling = min(ceiling, fitting)
        return ceiling if self._room is None else min(ceiling, k + self._room)

    # ----------------------------------------------------------------------------- report
    def best(self) -> Optional[TuningRecord]:
        """The measured window that scored highest on the objective: samples/s (``"throughput"``), or loss
        decrease per second (``"progress"``)."""
        if self.objective == "progress":
            return max(self.history, key=lambda record: record.progress_per_sec, default=None)
        return max(self.history, key=lambda record: record.samples_per_sec, default=None)

    def summary(self, current: Optional[int] = None) -> str:
        """Every measured window (k, samples/s, loss decrease per second), the best one by the objective and the
        chosen k (or, while still exploring, the ``current`` k when given), as a table."""
        lines = [
            f"crossbow ReplicaAutoTuner (objective={self.objective})",
            f"  {'window to step':>14}  {'k':>3}  {'samples/s':>10}  {'loss decrease/s':>15}",
        ]
        lines += [
            f"  {r.step:>14}  {r.replicas_per_device:>3}  {r.samples_per_sec:>10.1f}  {r.progress_per_sec:>15.4g}"
            for r in self.history
        ]
        best = self.best()
        if best is not None:
            score = (
                f"{best.progress_per_sec:.4g} loss decrease/s"
                if self.objective == "progress"
                else f"{best.samples_per_sec:.1f} samples/s"
            )
            lines.append(f"  best measured: k={best.replicas_per_device} ({score})")
        if self.chosen is not None:
            lines.append(f"  chosen: k={self.chosen}")
        else:
            lines.append("  still exploring" + (f", at k={current}" if current is not None else ""))
        return "\n".join(lines)

    def k_over_time(self, end: Optional[tuple[int, int]] = None) -> tuple[list[int], list[int]]:
        """``(steps, ks)``: from step 0, each measured window's end step and the k it measured over the steps up
        to it, and ``end`` (``(step, k)`` where training ended) when it lies beyond the last window."""
        steps = [0] + [record.step for record in self.history]
        ks = [self.history[0].replicas_per_device if self.history else 0]
        ks += [record.replicas_per_device for record in self.history]
        if end is not None and end[0] > steps[-1]:
            steps.append(end[0])
            ks.append(end[1])
        return steps, ks

    def save_plot(self, path: Path, end: Optional[tuple[int, int]] = None) -> Optional[Path]:
        """Saves k over training steps (each window's k over the steps it measured, from step 0; ``end``:
        ``(step, k)`` where training ended) and samples/s per k as a PNG; ``None`` without matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        figure, (over_time, per_k) = plt.subplots(1, 2, figsize=(10, 3.5))
        over_time.step(*self.k_over_time(end), where="pre", marker="o")  # (each point's k holds up to its step)
        over_time.set(xlabel="training step", ylabel="replicas per device (k)", title="k over time")
        per_k.plot([r.replicas_per_device for r in self.history], [r.samples_per_sec for r in self.history], "o")
        per_k.set(xlabel="replicas per device (k)", ylabel="samples/s", title="measured throughput")
        figure.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=100)
        plt.close(figure)
        return path

    # ----------------------------------------------------------------------------- checkpoint
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "history": [vars(record).copy() for record in self.history],
            "chosen": self.chosen,
            "steps_held": self._steps_held,
            "phase": self._phase,
            "climb": vars(self._climb).copy(),
            "before": vars(self._before).copy() if self._before else None,
            "trial": vars(self._trial).copy() if self._trial else None,
            "window": {
                "steps_since_change": self._steps_since_change,
                "steps": self._window_steps,
                "samples": self._window_samples,
                "seconds": self._window_seconds,
                "losses": [list(run) for run in self._window_losses],
                "replicas": self._window_replicas,
            },
            "changing": [self._changing_from, self._changing_to],  # (a change asked for, not yet in force)
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [TuningRecord(**record) for record in state_dict["history"]]
        self.chosen = state_dict["chosen"]
        self._steps_held = state_dict.get("steps_held", 0)
        phase = state_dict.get("phase", "before")
        self._phase = phase if phase in ("before", "trial", "after") else "before"
        self._climb = Climb(**state_dict.get("climb", {}))
        self._before = TuningRecord(**state_dict["before"]) if state_dict.get("before") else None
        self._trial = TuningRecord(**state_dict["trial"]) if state_dict.get("trial") else None
        self._new_window()
        window = state_dict.get("window")  # (the window in progress: its steps so far count on after a resume)
        self._window_restored = window is not None
        if window is not None:
            self._steps_since_change, self._window_steps = window["steps_since_change"], window["steps"]
            self._window_samples, self._window_seconds = window["samples"], window["seconds"]
            self._window_losses = [[tuple(point) for point in run] for run in window["losses"]]
            self._window_replicas = window["replicas"]
        self._changing_from, self._changing_to = state_dict.get("changing", (None, None))


def _just_averaged(strategy: Any) -> bool:
    """Whether the last optimizer step ended with an averaging: always with ``averaging_period=1``."""
    period = getattr(strategy, "period", None)
    return period is None or period.steps_since == 0


def _work_of_step(strategy: Any) -> float:
    """The samples of the last step; its batches where the batch size is unknown (a custom batch_sampler)."""
    return strategy.samples_per_step or strategy.replicas_per_device


def _mean_loss(outputs: Any) -> Optional[float]:
    """The step's training loss, mean over replicas (what the strategy reports as the step's loss); None for a
    step that every replica skipped (``training_step`` returned None: Lightning passes ``{}``)."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    return float(loss) if loss is not None else None


def _plot_file(plot: Union[str, os.PathLike]) -> Path:
    """The file a ``plot`` argument names: ``~`` expanded, ``.png`` added where it has no suffix (as ``savefig``
    adds it)."""
    path = Path(plot).expanduser()
    return path if path.suffix else path.with_name(path.name + ".png")


def _free_path(path: Path) -> Path:
    """``path`` if no file is there, else the first free ``<stem>-v1<suffix>``, ``<stem>-v2<suffix>``, ...: a file
    already there (the user's, or an earlier fit's plot) is never overwritten."""
    candidate, version = path, 0
    while candidate.exists():
        version += 1
        candidate = path.with_name(f"{path.stem}-v{version}{path.suffix}")
    return candidate


def _check_plot_path(plot: Union[str, os.PathLike]) -> None:
    """Refuses, before training, a plot path that names a directory (as given, or with the ``.png`` that
    :func:`_plot_file` adds), lies under a file, or whose suffix names a format matplotlib does not write (where
    matplotlib is installed)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        formats = None
    else:
        formats = FigureCanvasBase.get_supported_filetypes()
    given, path = Path(plot).expanduser(), _plot_file(plot)
    if formats is not None and path.suffix[1:].lower() not in formats:
        raise ValueError(
            f"ReplicaAutoTuner(plot={str(plot)!r}): matplotlib writes no {path.suffix!r} files; give one of"
            f" {', '.join('.' + name for name in sorted(formats))}."
        )
    for directory in (given, path):
        if directory.is_dir():
            raise ValueError(
                f"ReplicaAutoTuner(plot={str(plot)!r}) names a directory ({str(directory)!r}); give the file to"
                f" write, such as {str(given / 'replica_tuning.png')!r}."
            )
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"ReplicaAutoTuner(plot={str(plot)!r}) lies under {str(parent)!r}, which is a file.")
            return


def _slope(runs: list[list[tuple[float, float]]]) -> float:
    """Least-squares slope of ``y`` against ``x``, one common slope with an intercept per run of points.

    ``sum_runs sum (x - mean_x)(y - mean_y) / sum_runs sum (x - mean_x)^2``; 0 without spread in ``x``.
    """
    covariance = variance = 0.0
    for points in runs:
        if not points:
            continue
        mean_x = sum(x for x, _ in points) / len(points)
        mean_y = sum(y for _, y in points) / len(points)
        covariance += sum((x - mean_x) * (y - mean_y) for x, y in points)
        variance += sum((x - mean_x) ** 2 for x, _ in points)
    return covariance / variance if variance > 0 else 0.0
