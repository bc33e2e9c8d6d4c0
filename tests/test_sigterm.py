"""SigtermVote on one trainer: it takes over Lightning's SIGTERM handler and per-batch check, then gives them back.

The vote across processes (rank 1 alone signalled, both ranks stop before the same batch, no broadcast per
step) is tested on 2 processes in test_multiprocess.py.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_crossbow.sigterm import SigtermVote
from tests.helpers import trainer


def test_a_signal_is_noted_then_acted_on_only_when_the_summed_votes_say_so() -> None:
    run = trainer()
    connector, loop = run._signal_connector, run.fit_loop.epoch_loop
    vote = SigtermVote()
    vote.install(run)
    assert vote.installed
    connector.register_signal_handlers()  # as Trainer does after Strategy.setup: it picks up the vote's handler
    try:
        os.kill(os.getpid(), signal.SIGTERM)
    finally:
        connector.teardown()  # the handlers from before
    assert vote.signalled and not run.received_sigterm  # noted; one process does not stop alone
    assert vote.ballot(torch.device("cpu")).tolist() == [1.0]

    loop._broadcast_sigterm_tensor()  # no all-reduce since: nothing to act on (and no broadcast: no process group)
    vote.count(torch.tensor([0.0], dtype=torch.float64))
    loop._broadcast_sigterm_tensor()  # nobody had been signalled at the last all-reduce
    vote.count(torch.tensor([1.0], dtype=torch.float64))
    with pytest.raises(SIGTERMException):
        loop._broadcast_sigterm_tensor()
    assert run.received_sigterm

    vote.uninstall()
    assert "_sigterm_notifier_fn" not in vars(connector) and "_broadcast_sigterm_tensor" not in vars(loop)
    assert loop._broadcast_sigterm_tensor.__func__ is type(loop)._broadcast_sigterm_tensor


def test_a_signal_between_the_strategys_teardown_and_lightnings_is_noted_as_lightning_would() -> None:
    """Lightning restores the signal handlers after the strategy's teardown: a SIGTERM in between reaches the
    vote's handler, uninstalled, which records it on the trainer (no training step is left to agree in)."""
    run = trainer()
    vote = SigtermVote()
    vote.install(run)
    run._signal_connector.register_signal_handlers()
    vote.uninstall()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
    finally:
        run._signal_connector.teardown()
    assert run.received_sigterm and not vote.installed


def test_a_lightning_without_the_per_batch_broadcast_keeps_its_own_handling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before 2.5.2 Lightning had no per-batch broadcast: taking its handler there would leave nobody reading the
    votes, so nothing is installed."""
    run = trainer()
    monkeypatch.delattr(type(run.fit_loop.epoch_loop), "_broadcast_sigterm_tensor")
    vote = SigtermVote()
    vote.install(run)
    assert not vote.installed and "_sigterm_notifier_fn" not in vars(run._signal_connector)


def test_an_unsignalled_process_votes_zero() -> None:
    vote = SigtermVote()
    vote.install(trainer())
    assert vote.ballot(torch.device("cpu")).tolist() == [0.0]
    vote.uninstall()
