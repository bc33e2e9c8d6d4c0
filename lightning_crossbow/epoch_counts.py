"""Lightning's counts of a training epoch when one step takes a group of k of the loader's batches.

Lightning counts an epoch in steps: it reads the training loader's length (crossbow's loader has one group of k
batches per step), applies ``limit_train_batches`` to it, marks the last step, and validates every
``val_check_batch`` steps. Those counts are plain Lightning's at a fixed k over whole epochs; this module keeps
them right where they are not:

- a fractional ``limit_train_batches`` (or ``overfit_batches``) ``f`` takes ``f`` of the loader's batches, not of
  its groups (:meth:`EpochCounts.fraction_as_steps`);
- a change of k (the tuner's) within a fit, or a resume at another k, changes the epoch's steps
  (:meth:`EpochCounts.fit_epoch_length`);
- a fractional ``val_check_interval`` at k > 1, or in an epoch whose k changed, validates where plain Lightning
  would by the loader's batches (:meth:`EpochCounts.time_fractional_validation`).

Heterogeneous mode's routed loader (:class:`~lightning_crossbow.data.RoutedBatchLoader`) takes the integer and the
whole-epoch limits; a fraction of its common order is not supported (Lightning's count stays).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_crossbow.data import ReplicaBatchLoader, RoutedBatchLoader, loader_length, skips_over_a_tenth

#: How far :meth:`EpochCounts.replicas_fitting_an_epoch` looks.
_MOST_REPLICAS_CHECKED = 4096


def limit_argument(trainer: "pl.Trainer") -> str:
    """The Trainer argument the user limited the training batches with (Lightning holds ``overfit_batches`` as
    ``limit_train_batches`` too)."""
    return "overfit_batches" if trainer.overfit_batches else "limit_train_batches"


def smallest_fraction_taking(batches: int, length: int) -> float:
    """The smallest fraction of 4 decimals whose ``int(length * fraction)``, as Lightning counts a fractional limit,
    is at least ``batches`` (``batches / length`` rounded up: rounded to nearest it may fall short)."""
    fraction = math.ceil(round(batches / length * 1e4, 9)) / 1e4  # (a whole number of ten-thousandths stays one)
    while int(length * fraction) < batches:  # (float rounding)
        fraction = round(fraction + 1e-4, 4)
    return fraction


class EpochCounts:
    """Keeps Lightning's counts of the training epoch (its steps, the step it marks last, the steps after which it
    validates) right for the groups of :attr:`loader` (set by the strategy when it makes the training loader)."""

    def __init__(self) -> None:
        #: The training loader of the fit in progress (or of the last one).
        self.loader: Optional[ReplicaBatchLoader] = None
        #: The user's fractional ``limit_train_batches`` while Lightning holds it as a number of steps (see
        #: :meth:`fraction_as_steps`), else None.
        self.train_fraction: Optional[float] = None
        #: Whether each epoch's length is counted again as it starts (Lightning counted it at another k).
        self.follows_k = False
        #: Whether the next batch's epoch is counted again, wherever it starts (a resume's restored layout).
        self.recount_at_next_batch = False
        #: Whether k changed in this epoch (then a fractional ``val_check_interval`` is timed by batches).
        self.k_changed_in_epoch = False
        #: Whether a step of crossbow's groups has started in this fit.
        self.in_a_step = False
        #: Of this epoch's checks of a fractional ``val_check_interval`` (timed by batches), those validated, and
        #: those the step in progress validates if it is told to.
        self.checks_done = self.checks_if_validated = 0
        #: Whether an epoch of the fit in progress has begun its first step.
        self.epoch_begun = False

    def _routed(self) -> bool:
        return isinstance(self.loader, RoutedBatchLoader)

    def _sized(self) -> bool:
        """Whether the training loader's passes have a length (a routed one's always do)."""
        return self._routed() or (self.loader is not None and loader_length(self.loader.loader) is not None)

    def train_limit(self, trainer: "pl.Trainer") -> Union[int, float]:
        """The user's ``limit_train_batches`` (a fraction even while Lightning holds it as steps)."""
        return self.train_fraction if self.train_fraction is not None else trainer.limit_train_batches

    def fraction_as_steps(self, trainer: "pl.Trainer", grouped: ReplicaBatchLoader) -> None:
        """A fractional ``limit_train_batches`` (or ``overfit_batches``) ``f`` takes ``f`` of the loader's ``B``
        batches: ``int(B f) // k`` steps, where Lightning would take ``f`` of the ``B // k`` groups. Lightning is
        given that number of steps as its limit for this fit (the user's fraction is back at :meth:`end_fit`), so
        that every count it makes from it is crossbow's from the start: the epoch's steps, ``val_check_interval``,
        the progress bar, ``estimated_stepping_batches``. After a change of k, :meth:`fit_epoch_length` counts from
        the fraction."""
        fraction = self.train_limit(trainer)
        length = loader_length(grouped.loader)
        if not isinstance(fraction, float) or not 0.0 < fraction < 1.0 or not length:  # (no batches: no steps)
            return
        batches = int(length * fraction)
        steps = grouped.groups_in(batches)
        if steps == 0:
            name = limit_argument(trainer)
            raise ValueError(
                f"crossbow: {name}={fraction} of the training DataLoader's {length} batches is"
                f" {batches} batches, fewer than the {grouped.num_replicas} that one step takes"
                f" (replicas_per_device={grouped.num_replicas}): not one step could be made. Use"
                + (
                    f" {name} >= {smallest_fraction_taking(grouped.num_replicas, length):g}, or fewer replicas."
                    if grouped.num_replicas <= length
                    else f" at most replicas_per_device={length}, with {name}=1.0."
                )
            )
        self.train_fraction, trainer.limit_train_batches = fraction, steps
        grouped.batch_limit = batches  # (the batches that fill no step are drawn all the same)

    def end_fit(self, trainer: Optional["pl.Trainer"]) -> None:
        """Gives the trainer the user's fractional limit back (see :meth:`fraction_as_steps`)."""
        if self.train_fraction is not None and trainer is not None:
            trainer.limit_train_batches = self.train_fraction
        self.train_fraction = None
        self.epoch_begun = False

    def count_the_epoch_to_come(self, trainer: "pl.Trainer") -> None:
        """At an epoch's start, before the callbacks' ``on_train_epoch_start`` (where progress bars read it): after
        an epoch of this fit whose k or layout changed, Lightning still holds that epoch's count of steps; this
        epoch's, at the k its groups take, replaces it (its first step counts it again, as ever). Not for a fit's
        first epoch, or a pass resumed in its middle (a resume counts those)."""
        fit_loop = trainer.fit_loop
        if not (self.follows_k and self.epoch_begun and self.loader is not None):
            return
        if not math.isfinite(fit_loop.max_batches) or not self._sized():
            return
        steps = self._epoch_steps(trainer, self.loader.groups_of_next_pass)
        if steps is not None:
            fit_loop.max_batches = steps

    def _epoch_steps(self, trainer: "pl.Trainer", groups: Callable[[Optional[int]], Optional[int]]) -> Optional[int]:
        """An epoch's steps under ``limit_train_batches`` as Lightning applies it (a number of steps, or a fraction of
        the loader's batches), from ``groups(batches)``: the groups within a pass's first ``batches`` (None: all of
        them). None where ``groups`` gives none, or for a fraction of heterogeneous mode's common order (not
        supported: Lightning's count stays)."""
        assert self.loader is not None
        limit = self.train_limit(trainer)
        if isinstance(limit, float) and limit < 1.0:
            return None if self._routed() else groups(self._epoch_batches(limit))
        steps = groups(None)
        return None if steps is None else min(limit, steps) if isinstance(limit, int) else steps

    def start_batch(self, trainer: "pl.Trainer", batch_idx: int, in_a_step: bool, k: int) -> None:
        """At each batch Lightning hands the strategy (``in_a_step``: a group of crossbow's, not a batch of a
        forward-only pass): a new epoch starts its checks afresh; its length is counted again where Lightning
        counted it at another k; a fractional ``val_check_interval`` timed by batches tells the step whether it
        validates (``k``: the replicas' count)."""
        self.epoch_begun = True  # (also where a fit resumed in an epoch's middle begins)
        if batch_idx == 0:
            self.k_changed_in_epoch = False
            self.checks_done = self.checks_if_validated = 0
        if (batch_idx == 0 and self.follows_k) or self.recount_at_next_batch or self.resumed_mid_pass():
            self.recount_at_next_batch = False
            self.fit_epoch_length(trainer, k)  # Lightning counted the epoch's steps at another k
        self.in_a_step = in_a_step
        if self.times_validation_by_batches(trainer, k) and in_a_step:
            self.time_fractional_validation(trainer, batch_idx)

    def k_changed(self, trainer: "pl.Trainer", k: int) -> None:
        """After ``set_replicas_per_device`` (the loader makes its next groups at the new k; ``k``: the replicas'
        count, until those groups arrive): the epoch's length follows, this epoch's and the next ones'."""
        if not self._routed():
            self.warn_of_skipped_batches()
            self.k_changed_in_epoch = True
        self.follows_k = True
        self.fit_epoch_length(trainer, k)
        if self.in_a_step and self.times_validation_by_batches(trainer, k):
            # The step in progress was told whether it validates at the old k; the new k may end the epoch at it
            # (fewer batches left than k), or no longer (a smaller k makes one more step of the batches left).
            self.time_fractional_validation(trainer, trainer.fit_loop.epoch_loop.batch_idx)

    def validation_started(self) -> None:
        """A validation within fit (not the sanity check) does the checks its step reached, at least one."""
        self.checks_done = max(self.checks_done + 1, self.checks_if_validated)
        self.checks_if_validated = 0

    def checks_to_save(self, step_ended: bool) -> int:
        """The epoch's checks done, for a checkpoint: that of a step that ended counted in (a resumed fit goes on
        from the next step, as plain Lightning does, skipping its check)."""
        return max(self.checks_done, self.checks_if_validated) if step_ended else self.checks_done

    def restore(self, checks_done: int) -> None:
        """The checks done in the checkpoint's epoch (:meth:`checks_to_save`)."""
        self.checks_done, self.checks_if_validated = checks_done, 0

    def times_validation_by_batches(self, trainer: "pl.Trainer", k: int) -> bool:
        """Whether a fractional ``val_check_interval`` (and ``limit_train_batches``) is timed by the loader's batches
        (see :meth:`time_fractional_validation`): below 1 at k > 1, or in an epoch whose k changed (Lightning's
        count of steps then fits no single k). (At a fixed k > 1, a fraction of the epoch's steps is not one of its
        batches: 0.3 of 5 steps of 2 batches is every step, where plain Lightning validates every 3 batches. At k=1
        Lightning's count is plain Lightning's, resumes included.)"""
        return (
            isinstance(trainer.val_check_interval, float)
            and (self.k_changed_in_epoch or (trainer.val_check_interval < 1.0 and k > 1))
            and isinstance(self.train_limit(trainer), float)
            and not self._routed()
            and self.loader is not None
            and trainer.val_check_batch is not None
            and math.isfinite(trainer.val_check_batch)
        )

    def _epoch_batches(self, fraction: float) -> int:
        """The loader's batches an epoch takes under a fractional ``limit_train_batches``, as Lightning counts them."""
        assert self.loader is not None
        return int(self.loader.batches_per_pass() * fraction)

    def time_fractional_validation(self, trainer: "pl.Trainer", batch_idx: int) -> None:
        """In an epoch whose k changed, a fractional ``val_check_interval`` f validates after each step whose batches
        reach a multiple of ``int(f N)`` not yet validated for (N: the epoch's batches; plain Lightning validates every
        ``int(f N)`` batches, ``N // int(f N)`` times an epoch), and after the epoch's last step while one of those
        checks is undone (its batches that fill no step would have reached it). A validation does every check its
        step reached (one step may reach two), and one that Lightning ran by its count of steps, before k changed,
        does one. Lightning validates every ``val_check_batch`` steps, a count that no single k gives such an epoch:
        each step is told whether it is one, once its group is drawn (``batch_idx``: the step's)."""
        assert self.loader is not None
        interval = float(trainer.val_check_interval)
        epoch_batches = self._epoch_batches(float(self.train_limit(trainer)))
        every = max(1, int(interval * epoch_batches))
        checks = max(1, epoch_batches // every)
        after = self.loader.batches_taken  # (this step's group drawn)
        loop = trainer.fit_loop.epoch_loop
        done, reached, last = self.checks_done, min(after // every, checks), loop.batch_progress.is_last_batch
        reaches = reached > done or (last and done < checks)
        self.checks_if_validated = (checks if last else reached) if reaches else 0
        iteration = loop.total_batch_idx if trainer.check_val_every_n_epoch is None else batch_idx
        trainer.val_check_batch = iteration + 1 if reaches else iteration + 2  # (Lightning: (iteration + 1) % it == 0)

    def warn_of_skipped_batches(self) -> None:
        """Warns when k now leaves more than a tenth of every epoch's batches out of its last, unfilled step."""
        assert self.loader is not None
        length, k = self.loader.pass_batches(), self.loader.num_replicas  # (under a fractional limit, its)
        if length is not None and skips_over_a_tenth(length, k):
            rank_zero_warn(
                f"crossbow: with replicas_per_device={k} the last {self.loader.dropped_batches()} of the"
                f" {length} batches of every epoch do not fill a step and are skipped."
            )

    def replicas_fitting_an_epoch(self, trainer: "pl.Trainer") -> Optional[int]:
        """The largest k such that no k' <= k leaves more than a tenth of an epoch's batches out of its last,
        unfilled step (``batches mod k' <= batches / 10``); at least 1. None when the training loader has no
        length or the data are routed (heterogeneous mode)."""
        length = self._batches_an_epoch_takes(trainer)
        if length is None:
            return None
        k = 1
        while k < min(length, _MOST_REPLICAS_CHECKED) and not skips_over_a_tenth(length, k + 1):
            k += 1
        return k

    def replicas_keeping_validation(self, trainer: "pl.Trainer") -> Optional[int]:
        """The largest k whose epochs still hold ``val_check_interval`` steps where that is a number of steps within
        each epoch (an int, with ``check_val_every_n_epoch`` set and validation on: Lightning refuses a longer one at
        set-up, and an epoch shorter than it never validates); at least 1. None where no such bound holds (a
        fraction, checks counted across epochs, ``limit_val_batches=0``, a loader without a length, routed data)."""
        interval = trainer.val_check_interval
        if not isinstance(interval, int) or trainer.check_val_every_n_epoch is None or trainer.limit_val_batches == 0:
            return None
        length = self._batches_an_epoch_takes(trainer)
        return None if length is None else max(1, length // interval)

    def _batches_an_epoch_takes(self, trainer: "pl.Trainer") -> Optional[int]:
        """The loader's batches that an epoch takes, under a fractional ``limit_train_batches`` its fraction of them
        (an integer limit counts steps: its epochs never skip batches); None without a length, or for routed data."""
        if self.loader is None or self._routed():
            return None
        length = loader_length(self.loader.loader)
        if length is None:
            return None
        limit = self.train_limit(trainer)
        return max(1, int(length * limit)) if isinstance(limit, float) else length

    def resumed_mid_pass(self) -> bool:
        """Once per resume in the middle of a pass (a loader that saves its position): the steps trained before it
        may have been at another k than the steps left, so the epoch's length is counted again."""
        if self.loader is None or not self.loader.resumed_mid_pass:
            return False
        self.loader.resumed_mid_pass = False
        self.follows_k = True  # (Lightning would keep this epoch's count for the next ones)
        return True

    def align_the_resumed_epoch(self, trainer: "pl.Trainer", k: int) -> None:
        """Before the first epoch of a resumed fit, Lightning's count of its steps, kept from the checkpoint (steps
        at the checkpoint's k), is made to agree with the steps at k now:

        - from a step that ended its epoch (saved in ``on_train_batch_end``, or after it, in ``on_validation_end``),
          the next epoch starts afresh, as in plain Lightning: Lightning moves to it by the saved ``is_last_batch``,
          but starts its count afresh only if the steps done reach an epoch's steps at k now (a larger k at the
          save, fewer steps, had it begin at that step's index; after validation, it trained the ended epoch's
          first batches again);
        - from the middle of an epoch whose loader counts on (:attr:`ReplicaBatchLoader.resumed_mid_pass`), the epoch
          has the steps done and those the batches left make at k now: Lightning would otherwise start the epoch's
          count again where the steps done reach its steps at k now, and mark no step the last, nor validate after
          it."""
        epoch_loop = trainer.fit_loop.epoch_loop
        progress, steps = epoch_loop.batch_progress, trainer.num_training_batches
        if not math.isfinite(steps):
            return
        if epoch_loop.restarted_on_train_batch_end and progress.is_last_batch:
            if progress.current.completed + 1 < steps:  # (Lightning completes the saved step when the epoch starts)
                progress.current.ready = progress.current.started = progress.current.processed = int(steps)
                progress.current.completed = int(steps) - 1
        elif getattr(epoch_loop, "restarted_on_last", False) and progress.is_last_batch:
            # Saved after the epoch's last step ended (in on_validation_end, say): Lightning takes the epoch for
            # done only where the steps done make an epoch at k now (its check of validation counts them).
            if progress.current.completed != steps:
                progress.current.ready = progress.current.started = int(steps)
                progress.current.processed = progress.current.completed = int(steps)
        elif self.resumed_mid_pass():  # (and the epochs after it are counted again as they start)
            self.fit_epoch_length(trainer, k)

    def fit_epoch_length(self, trainer: "pl.Trainer", k: int) -> None:
        """Sets Lightning's counts of this epoch to the groups at k now: its steps (``limit_train_batches`` as
        Lightning applies it: a fraction of the loader's batches, or a number of steps), the last step the
        fetcher marks, and the step of a fractional ``val_check_interval`` (``k``: the replicas' count)."""
        fit_loop = trainer.fit_loop
        if self.loader is None or not math.isfinite(fit_loop.max_batches) or not self._sized():
            return  # (a loader without a length: Lightning's count, an integer limit's, does not depend on k)
        loader = self.loader
        epoch_length = self._epoch_steps(
            trainer, lambda batches: loader.groups_in_pass() if batches is None else loader.groups_in(batches)
        )
        if epoch_length is None:
            return
        interval = trainer.val_check_interval
        if (
            isinstance(interval, float)
            and trainer.val_check_batch is not None
            and math.isfinite(trainer.val_check_batch)
            and not self.times_validation_by_batches(trainer, k)  # (then the step in progress was told already)
        ):
            trainer.val_check_batch = max(1, int(epoch_length * interval))  # as Lightning sets it at an epoch's start
        fit_loop.max_batches = epoch_length
        # Lightning's fetcher marks the last batch from the length it read when the epoch began.
        fetcher = getattr(fit_loop, "_data_fetcher", None)
        if fetcher is not None and getattr(fetcher, "length", None) is not None:
            fetcher.length = epoch_length
            if fetcher.fetched > 0 and not isinstance(getattr(type(fetcher), "done", None), property):
                # Batches given back after the epoch's last group was fetched (an out-of-memory back-off), or
                # left over at a smaller k, make more groups: the group in progress is no longer the last.
                fetcher.done = fetcher.fetched >= epoch_length
                fit_loop.epoch_loop.batch_progress.is_last_batch = fetcher.done


class ShowEpochCounts(Callback):
    """Shows the other callbacks each epoch's count of steps as :class:`EpochCounts` keeps it: counts an epoch at its
    start, before they read it (:meth:`EpochCounts.count_the_epoch_to_come`), and gives Lightning's progress bar the
    new total where k (or the layout) changes within an epoch (it reads the total only as the epoch starts). Across
    processes it also has the strategy check, as the epoch starts, that every process counts the same steps. The
    strategy puts it first among the trainer's callbacks."""

    def __init__(self) -> None:
        self._shown: Optional[int] = None  #: the total the progress bar shows

    @override
    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        counts = getattr(trainer.strategy, "_epoch", None)
        if isinstance(counts, EpochCounts):
            counts.count_the_epoch_to_come(trainer)
            trainer.strategy.check_epoch_steps_agree(trainer)  # type: ignore[attr-defined]
        self._shown = trainer.num_training_batches

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", *args: Any) -> None:
        self._show_a_new_count(trainer)

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", *args: Any) -> None:
        self._show_a_new_count(trainer)

    def _show_a_new_count(self, trainer: "pl.Trainer") -> None:
        total = trainer.num_training_batches
        if total == self._shown or not math.isfinite(total):
            return
        self._shown = total
        bar = trainer.progress_bar_callback
        if isinstance(bar, TQDMProgressBar) and bar._train_progress_bar is not None:
            bar._train_progress_bar.total = total
        elif isinstance(bar, RichProgressBar) and bar.progress is not None and bar.train_progress_bar_id is not None:
            bar.progress.update(bar.train_progress_bar_id, total=total)
