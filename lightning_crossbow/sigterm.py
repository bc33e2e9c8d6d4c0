"""SIGTERM in a multi-process run: every process stops before the same batch, agreed in the step's own all-reduce.

Lightning (2.5.2 and later) keeps the processes of a run together on SIGTERM with collectives of its own:
every training batch starts with a broadcast of rank 0's flag (``_TrainingEpochLoop._broadcast_sigterm_tensor``),
and the SIGTERM handler broadcasts too. Under crossbow, whose step already synchronises every process once
(the averaging's all-reduce), the per-batch broadcast is a second synchronisation point in every step: one
more wait for the slowest process, about 1 ms of a 20 ms step on 2 CPU processes. And a collective started
from a signal handler pairs with whatever collective the other processes happen to be in.

:class:`SigtermVote` replaces both:

- the handler only notes the signal (and, as Lightning's does, passes it on to the processes this one launched);
- every averaging's all-reduce carries each process's vote, 1 once it was signalled, as one more summed
  number riding in it (``StepContext.riders``): no collective of its own;
- where Lightning broadcast, at the start of the next batch, every process reads the same sum. When any process
  (not only rank 0) was signalled, all of them set ``trainer.received_sigterm`` and raise Lightning's
  ``SIGTERMException`` before the same batch.

A signal is thus acted on at the first batch that starts after the next optimizer step that averages (every step,
unless ``averaging_period > 1``: then up to that many steps later); one that arrives
during validation waits for the next training step, and one after the last optimizer step is agreed on in one
all-reduce when training ends (``SIGTERMException`` then). Lightning releases before 2.5.2, which have no
per-batch broadcast, keep their own handling.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Optional

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message
from torch import Tensor

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

log = logging.getLogger(__name__)

#: Lightning's names for what :class:`SigtermVote` replaces on one trainer's objects (instance attributes that
#: shadow the methods; removed again by :meth:`SigtermVote.uninstall`).
_HANDLER, _BATCH_CHECK = "_sigterm_notifier_fn", "_broadcast_sigterm_tensor"


class SigtermVote:
    """Stops every process before the same batch once any process received SIGTERM (see the module's docstring)."""

    def __init__(self) -> None:
        self.signalled = False  #: whether this process received SIGTERM
        self._connector: Optional[_SignalConnector] = None  # the trainer's, from install on
        self._installed = False
        self._votes: Optional[Tensor] = None  # the summed votes of the last optimizer step, not yet read
        self._ballot: Optional[Tensor] = None  # reused: a new device tensor from a Python number would copy

    @property
    def installed(self) -> bool:
        """Whether the vote stands in for Lightning's SIGTERM handling (between install and uninstall)."""
        return self._installed

    def install(self, trainer: pl.Trainer) -> None:
        """Takes over Lightning's SIGTERM handler and its per-batch broadcast on this trainer (before ``Trainer``
        registers its signal handlers, that is, in ``Strategy.setup``). A Lightning without the per-batch
        broadcast (before 2.5.2) keeps its own handling: nothing is installed."""
        loop = trainer.fit_loop.epoch_loop
        if not hasattr(loop, _BATCH_CHECK):
            return
        self.signalled, self._votes, self._installed = False, None, True
        self._connector = trainer._signal_connector
        vars(self._connector)[_HANDLER] = self._note_signal
        vars(loop)[_BATCH_CHECK] = self._stop_if_voted

    def uninstall(self) -> None:
        """Gives Lightning its own handler and per-batch check back. (Lightning restores the process's signal
        handlers only after the strategy's teardown; a SIGTERM in between is noted as Lightning's handler
        notes it, in ``trainer.received_sigterm``.)"""
        if self._installed:
            assert self._connector is not None
            vars(self._connector).pop(_HANDLER, None)
            vars(self._connector.trainer.fit_loop.epoch_loop).pop(_BATCH_CHECK, None)
        self._installed, self._votes = False, None

    def ballot(self, device: torch.device) -> Tensor:
        """This process's vote for the coming all-reduce, ``[1.]`` once signalled, else ``[0.]`` (float64), in a
        tensor kept on ``device``: filled in place, so on CUDA no host-to-device copy waits for the stream."""
        if self._ballot is None or self._ballot.device != device:
            self._ballot = torch.zeros(1, dtype=torch.float64, device=device)
        return self._ballot.fill_(float(self.signalled))

    def count(self, votes: Tensor) -> None:
        """Keeps the votes summed over every process, read when the next batch starts, where Lightning read its
        broadcast flag (on CUDA the read waits for the step's work on the device there, as Lightning's did)."""
        self._votes = votes

    def stop_if_any_signalled(self, device: torch.device, all_reduce_sum: Callable[[Tensor], Tensor]) -> None:
        """When training ends, on every process alike: one all-reduce of the votes, for a signal that came after
        the last optimizer step (in the last validation, or once ``max_steps`` was reached), which no batch
        start would read; raises ``SIGTERMException`` on every process if any was signalled."""
        if self._installed:
            self.count(all_reduce_sum(self.ballot(device)))
            self._stop_if_voted()

    def _note_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        """The SIGTERM handler: Lightning's, without its broadcast."""
        assert self._connector is not None  # (registered by Lightning after install)
        trainer = self._connector.trainer
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", trainer.local_rank))
        if not self._installed:  # training is over (see uninstall): nothing left to agree on
            self._connector.received_sigterm = True
            return
        launcher = trainer.strategy.launcher
        if not self.signalled and launcher is not None:
            launcher.kill(signum)  # the processes this one launched get it too
        self.signalled = True

    def _stop_if_voted(self) -> None:
        """At the start of a training batch, on every process alike: raises ``SIGTERMException`` if any process
        had been signalled when the last optimizer step all-reduced."""
        votes, self._votes = self._votes, None
        if votes is None or float(votes.sum()) == 0.0:
            return
        assert self._connector is not None
        self._connector.received_sigterm = True
        raise SIGTERMException
