r"""When the averaging runs: every ``H = averaging_period`` optimizer steps (local SGD), and where it must.

Between two averagings every learner takes its own optimizer steps on its own batches and z stays as it is
(post-local SGD's period; SlowMo's and DiLoCo's ``H`` inner steps). The rule then averages what the learners
did since the last averaging: for ``scaled_averaging``, with ``w_j`` after the ``H`` local steps,

.. math::

    d_j = w_j - z, \quad z \leftarrow z + \eta \tfrac{1}{K} \textstyle\sum_{j=1}^{K} K p_j d_j + \mu (z - z_{prev}),
    \quad w_j \leftarrow z

and for ``sma``/``easgd`` the elastic pull ``c_j = alpha (w_j - z)`` is taken at those steps only (EASGD's
communication period). ``H = 1`` is every step: the rules as stated in :mod:`lightning_crossbow.algorithms`.

Besides every ``H``-th step, an averaging also ends every epoch (and the last step of fit), so that what
validation, checkpoints and callbacks read at an epoch's end holds every step; and the steps since the last
averaging are averaged, without a local step, before the learners change (a new k, or a new split in heterogeneous
mode: no learner leaves with steps that z has not taken in) and when fit stops within an epoch.
A learner is left out of an averaging (as a skipped one is at ``H = 1``) only if it skipped every step since
the last one. Between two averagings z is as the last one left it (a validation within the epoch reads that z;
under gossip, whose z is the learners' mean formed when read, their current mean); a drop of the learning rate
seen there resets the learners (``reset_on_lr_drop``) after the next averaging; a parameter frozen there stays
at z's value, dropping its steps since.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

import torch
from lightning.pytorch import Callback
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from lightning_crossbow.replicas import resize_rows
from lightning_crossbow.validation import check_int

if TYPE_CHECKING:
    import lightning.pytorch as pl


class AveragingPeriod:
    """Counts the optimizer steps since the last averaging and says when the next one is due."""

    def __init__(self, period: int = 1) -> None:
        check_int("averaging_period", period, note=" (optimizer steps between averagings)")
        self.period = period
        #: Optimizer steps taken since the last averaging (0 right after one: the learners are where it left them).
        self.steps_since = 0
        #: Learners that skipped every step since the last averaging, including the step in progress (None: none).
        self.skipped_throughout: Optional[Tensor] = None

    def due(self, ends_an_epoch: Callable[[], bool]) -> bool:
        """Whether the step in progress ends with an averaging: the ``H``-th step since the last one, or the last step
        of an epoch or of fit (``ends_an_epoch``, asked only when it decides: not at all with ``H = 1``)."""
        return self.steps_since + 1 >= self.period or ends_an_epoch()

    def take_step(self, skipped: Optional[Tensor]) -> Optional[Tensor]:
        """Notes one optimizer step whose skipped learners are ``skipped`` (None: none); returns the learners that
        skipped every step since the last averaging, this one included."""
        if self.steps_since == 0:
            self.skipped_throughout = skipped
        elif self.skipped_throughout is not None:
            self.skipped_throughout = None if skipped is None else self.skipped_throughout & skipped
        self.steps_since += 1
        return self.skipped_throughout

    def resize(self, learners: int) -> None:
        """The learners are now ``learners``, the first ones kept; the new ones joined, so did not skip throughout."""
        if self.skipped_throughout is not None:
            fill = self.skipped_throughout.new_zeros(())
            self.skipped_throughout = resize_rows(self.skipped_throughout, learners, fill=fill)

    def averaged(self) -> None:
        """The averaging ran: a new period starts."""
        self.steps_since, self.skipped_throughout = 0, None

    def restart(self, steps_since: int = 0) -> None:
        """A new fit, or a resume with the replicas of a checkpoint saved ``steps_since`` steps after an averaging
        (nothing known of which learners skipped those steps: none did)."""
        self.steps_since, self.skipped_throughout = steps_since, None


class AveragePendingSteps(Callback):
    """Where fit stops within an epoch (a callback's ``should_stop``: ``Timer``'s ``max_time``, ``EarlyStopping`` on a
    validation within the epoch), or a change of k ends the epoch after its step, averages the steps taken since the
    last averaging before anything reads z: the validation Lightning runs there, the epoch's end, the end of fit.
    The strategy puts it first among the trainer's callbacks when ``averaging_period > 1``; every process reaches
    these hooks alike."""

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # (where Lightning validates because fit stops here: it may not stop yet, min_epochs or min_steps unmet; or
        # because a change of k left no room for another step in the epoch)
        loop = trainer.fit_loop
        if trainer.state.fn == TrainerFn.FITTING and (
            (trainer.should_stop and loop._can_stop_early) or loop.epoch_loop.batch_progress.is_last_batch
        ):
            self._average(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._average(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._average(trainer)

    @staticmethod
    def _average(trainer: pl.Trainer) -> None:
        average: Any = getattr(trainer.strategy, "average_pending_steps", None)
        if average is not None:  # (a trainer of another strategy: nothing to do)
            with torch.inference_mode(False):  # (validation runs in inference mode; training's tensors must not)
                average()
