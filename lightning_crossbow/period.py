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
the last one.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from lightning_crossbow.validation import check_int


class AveragingPeriod:
    """Counts the optimizer steps since the last averaging and says when the next one is due."""

    def __init__(self, period: int = 1) -> None:
        check_int("averaging_period", period, note=" (optimizer steps between averagings)")
        self.period = period
        #: Optimizer steps taken since the last averaging (0 right after one: the learners are where it left them).
        self.steps_since = 0
        #: Learners that skipped every step since the last averaging, including the step in progress (None: none).
        self.skipped_throughout: Optional[Tensor] = None

    def due(self, ends_an_epoch: bool) -> bool:
        """Whether the step in progress ends with an averaging: the ``H``-th step since the last one, or the last step
        of an epoch or of fit."""
        return self.steps_since + 1 >= self.period or ends_an_epoch

    def take_step(self, skipped: Optional[Tensor]) -> Optional[Tensor]:
        """Notes one optimizer step whose skipped learners are ``skipped`` (None: none); returns the learners that
        skipped every step since the last averaging, this one included."""
        if self.steps_since == 0:
            self.skipped_throughout = skipped
        elif self.skipped_throughout is not None:
            self.skipped_throughout = None if skipped is None else self.skipped_throughout & skipped
        self.steps_since += 1
        return self.skipped_throughout

    def averaged(self) -> None:
        """The averaging ran: a new period starts."""
        self.steps_since, self.skipped_throughout = 0, None

    def restart(self, steps_since: int = 0) -> None:
        """A new fit, or a resume with the replicas of a checkpoint saved ``steps_since`` steps after an averaging
        (nothing known of which learners skipped those steps: none did)."""
        self.steps_since, self.skipped_throughout = steps_since, None
