"""engine="streams" and engine="auto"'s choice by measurement, checked on CPU with host-side stand-in streams.

A real :class:`StreamPool` needs CUDA (tests/test_cuda.py runs it on a GPU). Here ``HostStreamPool``
keeps the pool's interface and records the order of the work: which stream each replica's
training_step ran on, and every wait between streams. CPU kernels run in issue order, so the values
must equal the sequential engine's bitwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import lightning as L
import pytest
import torch
import torchmetrics
from torch import nn

from lightning_crossbow import CrossbowStrategy, ReplicaAutoTuner
from lightning_crossbow.engines import Engine, FastestEngine, ReplicaStepOutput, StreamsEngine, make_engine
from lightning_crossbow.streams import StreamPool
from tests.helpers import Classifier, ReplicaSnapshot, loader, make_data, trainer


class HostStreamPool(StreamPool):
    """A stream pool without a GPU: streams are names, and every wait and stream switch is logged."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.sync_stream = "sync"
        self._replica_streams: list[Any] = []
        self._current = ["issuing"]
        self.log: list[tuple[str, ...]] = []
        self.kept: list[tuple[int, str]] = []

    def replica_streams(self, count: int) -> list[Any]:
        return [f"replica{j}" for j in range(count)]

    def current(self) -> Any:
        return self._current[-1]

    @contextmanager
    def use(self, stream: Any):  # noqa: ANN201
        self._current.append(stream)
        self.log.append(("enter", stream))
        try:
            yield
        finally:
            self._current.pop()
            self.log.append(("exit", stream))

    def wait(self, waiting: Any, on: Any) -> None:
        self.log.append(("wait", waiting, on))

    def keep_for(self, tensor: torch.Tensor, stream: Any) -> None:
        self.kept.append((id(tensor), stream))

    def synchronize(self) -> None:
        self.log.append(("synchronize",))


class StreamRecorder(Classifier):
    """Records the stream each replica's training_step runs on."""

    def __init__(self, pool: HostStreamPool) -> None:
        super().__init__()
        self.pool = pool
        self.ran_on: list[Any] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.ran_on.append(self.pool.current())
        return super().training_step(batch, batch_idx)


def fit_with_pool(engine: str, pool: HostStreamPool, model: Classifier, monkeypatch, **kwargs: Any) -> tuple[Any, Any]:
    monkeypatch.setattr(CrossbowStrategy, "_stream_pool", lambda self: pool)
    snapshot = ReplicaSnapshot()
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=3, engine=engine, **kwargs), callbacks=[snapshot])
    fit.fit(model, loader(make_data(num_samples=96)))
    return fit, snapshot


def test_each_replica_runs_on_its_own_stream_ordered_by_waits(monkeypatch) -> None:
    pool = HostStreamPool()
    model = StreamRecorder(pool)
    fit, _ = fit_with_pool("streams", pool, model, monkeypatch)
    steps = fit.global_step
    assert steps == 4
    # The first step runs the replicas one after another on the issuing stream (watching for metric updates).
    assert model.ran_on == ["issuing"] * 3 + ["replica0", "replica1", "replica2"] * (steps - 1)
    averaging = [("wait", "sync", "issuing"), ("enter", "sync"), ("exit", "sync"), ("wait", "issuing", "sync")]
    one_step = (
        [("wait", f"replica{j}", "issuing") for j in range(3)]  # the replicas start after the batch's copy
        + [entry for j in range(3) for entry in (("enter", f"replica{j}"), ("exit", f"replica{j}"))]
        + [("wait", "issuing", f"replica{j}") for j in range(3)]  # the losses are combined after every replica
        + averaging
    )
    assert pool.log == averaging + one_step * (steps - 1)
    # Both tensors of each replica's batch (inputs, targets) are kept from reuse until its stream is done.
    assert [stream for _, stream in pool.kept] == [f"replica{j}" for j in range(3) for _ in range(2)] * (steps - 1)


class MetricInTrainingStep(StreamRecorder):
    """Updates a torchmetrics metric, which all replicas share, in its training_step."""

    def __init__(self, pool: HostStreamPool) -> None:
        super().__init__(pool)
        self.train_mean = torchmetrics.MeanMetric()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.train_mean.update(loss.detach())
        return loss


def test_a_training_step_that_updates_a_metric_keeps_the_replicas_on_one_stream(monkeypatch) -> None:
    pool = HostStreamPool()
    model = MetricInTrainingStep(pool)
    with pytest.warns(UserWarning, match=r"updates the torchmetrics metric\(s\) MeanMetric, which all replicas share"):
        fit, streams = fit_with_pool("streams", pool, model, monkeypatch, algorithm="sma")
    assert model.ran_on == ["issuing"] * 3 * fit.global_step
    assert model.train_mean._update_count == 3 * fit.global_step  # every replica's update, none lost
    assert pool.log == []  # no stream but the issuing one, for the averaging too
    monkeypatch.undo()
    sequential = ReplicaSnapshot()
    trainer(
        strategy=CrossbowStrategy(replicas_per_device=3, engine="sequential", algorithm="sma"), callbacks=[sequential]
    ).fit(MetricInTrainingStep(HostStreamPool()), loader(make_data(num_samples=96)))
    for name, value in sequential.params.items():
        assert torch.equal(streams.params[name], value), name


@pytest.mark.parametrize("algorithm", ["sma", "scaled_averaging"])
def test_the_streams_engine_gives_the_sequential_engines_values(monkeypatch, algorithm: str) -> None:
    pool = HostStreamPool()
    _, streams = fit_with_pool("streams", pool, Classifier(), monkeypatch, algorithm=algorithm)
    monkeypatch.undo()
    snapshot = ReplicaSnapshot()
    trainer(
        strategy=CrossbowStrategy(replicas_per_device=3, engine="sequential", algorithm=algorithm), callbacks=[snapshot]
    ).fit(Classifier(), loader(make_data(num_samples=96)))
    for name, value in snapshot.params.items():
        assert torch.equal(streams.params[name], value), name
    for key in ("replicas", "center_prev"):
        assert all(torch.equal(a, b) for a, b in zip(streams.state[key], snapshot.state[key], strict=True))


class _CostlyEngine(Engine):
    """Runs the sequential engine and advances a fake clock by a fixed cost per step."""

    def __init__(self, module: nn.Module, clock: list[float], cost: float, name: str) -> None:
        super().__init__(module)
        self.clock, self.cost, self.name, self.runs = clock, cost, name, 0

    def run(self, stack: Any, batches: Sequence[Any], args: Sequence[Any], capture: Any) -> ReplicaStepOutput:
        self.clock[0] += self.cost
        self.runs += 1
        return ReplicaStepOutput(torch.zeros(()), torch.zeros(len(batches)))


def test_the_fastest_engine_measures_in_turns_and_keeps_the_fastest(caplog) -> None:
    now = [0.0]
    module = nn.Linear(2, 2)
    slow, fast = _CostlyEngine(module, now, 0.004, "fused"), _CostlyEngine(module, now, 0.003, "streams")
    syncs = []
    engine = FastestEngine(
        module,
        {"fused": slow, "streams": fast},
        warmup=2,
        trials=3,
        clock=lambda: now[0],
        synchronize=lambda: syncs.append(1),
    )
    order = []
    for _ in range(len(engine.schedule) + 4):
        with engine.timed():
            engine.run(None, [0, 1], (), None)
        order.append(engine.active.name)
    assert order == ["fused"] * 2 + ["streams"] * 2 + ["fused", "streams"] * 3 + ["streams"] * 4
    assert engine.seconds == {"fused": [pytest.approx(0.004)] * 3, "streams": [pytest.approx(0.003)] * 3}
    assert engine.chosen == "streams" and slow.runs == 5 and fast.runs == 9
    assert len(syncs) == 2 * len(engine.schedule)  # the device is synchronized only while measuring


def test_the_processes_keep_the_engine_that_is_fastest_summed_over_them() -> None:
    """Here "streams" is faster by 1 ms; another process found it slower by 3 ms: every rank keeps "fused"."""
    now = [0.0]
    module = nn.Linear(2, 2)
    other_process = torch.tensor([0.004, 0.007], dtype=torch.float64)  # its medians: fused, streams
    engine = FastestEngine(
        module,
        {"fused": _CostlyEngine(module, now, 0.004, "fused"), "streams": _CostlyEngine(module, now, 0.003, "streams")},
        warmup=0,
        trials=2,
        clock=lambda: now[0],
        all_reduce_sum=lambda medians: medians + other_process,
    )
    for _ in engine.schedule:
        with engine.timed():
            engine.run(None, [0], (), None)
    assert engine.chosen == "fused"


class EngineSpy(ReplicaSnapshot):
    """Also keeps the strategy's engine as it was at the last training step."""

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.engine = trainer.strategy.engine


def test_auto_on_a_stream_device_measures_fused_against_streams_then_keeps_one(monkeypatch) -> None:
    """With a stream pool (CUDA), engine="auto" times fused and streams in turns, keeps one, and trains on:
    the values are the sequential engine's up to rounding (fused sums in another order)."""
    pool = HostStreamPool()
    monkeypatch.setattr(CrossbowStrategy, "_stream_pool", lambda self: pool)
    spy = EngineSpy()
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=2, algorithm="sma"), callbacks=[spy], max_epochs=4)
    fit.fit(Classifier(), loader(make_data(num_samples=96)))  # 24 steps: the 14 trial steps end in epoch 3
    engine = spy.engine
    assert isinstance(engine, FastestEngine) and engine.chosen in ("fused", "streams")
    assert isinstance(engine.candidates["streams"], StreamsEngine)
    assert {name: len(times) for name, times in engine.seconds.items()} == {"fused": 5, "streams": 5}
    assert pool.log.count(("synchronize",)) == 2 * len(engine.schedule)  # synchronized only while measuring
    monkeypatch.undo()
    reference = ReplicaSnapshot()
    trainer(
        strategy=CrossbowStrategy(replicas_per_device=2, engine="sequential", algorithm="sma"),
        callbacks=[reference],
        max_epochs=4,
    ).fit(Classifier(), loader(make_data(num_samples=96)))
    for name, value in reference.params.items():
        torch.testing.assert_close(spy.params[name], value, rtol=1e-5, atol=1e-6)


def test_the_tuner_does_not_measure_while_the_engine_is_timing_its_candidates(monkeypatch) -> None:
    """The 14 trial steps of engine="auto" mix fused and streams: the tuner's first window starts after them."""
    monkeypatch.setattr(CrossbowStrategy, "_stream_pool", lambda self: HostStreamPool())
    tuner = ReplicaAutoTuner(window=2, warmup=0, max_replicas=2, recheck_every=None, plot=False)
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=2), callbacks=[tuner], max_epochs=4)
    fit.fit(Classifier(), loader(make_data(num_samples=96)))
    assert [(r.step, r.replicas_per_device) for r in tuner.history] == [(16, 2)]  # steps 15 and 16
    assert tuner.chosen == 2


class KSchedule(L.Callback):
    """Sets k at given steps and records, at every step, k and whether engine="auto" was measuring."""

    def __init__(self, schedule: dict[int, int]) -> None:
        self.schedule = schedule
        self.seen: list[tuple[int, bool, Any]] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        strategy = trainer.strategy
        self.seen.append((strategy.replicas_per_device, strategy.engine.measuring, strategy.engine.chosen))
        if trainer.global_step in self.schedule:
            strategy.set_replicas_per_device(self.schedule[trainer.global_step])


def test_auto_measures_each_k_once_and_keeps_its_choice_when_k_returns(monkeypatch) -> None:
    """k = 2 for 14 trial steps, then 3 (measured anew: the fastest engine can depend on k), then 2 again:
    the choice made at k=2 is kept without a second measurement."""
    monkeypatch.setattr(CrossbowStrategy, "_stream_pool", lambda self: HostStreamPool())
    recorder = KSchedule({16: 3, 32: 2})
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=2), callbacks=[recorder], max_epochs=-1, max_steps=40)
    fit.fit(Classifier(), loader(make_data(num_samples=96)))
    at = {k: [(measuring, chosen) for kk, measuring, chosen in recorder.seen if kk == k] for k in (2, 3)}
    # (seen at each step's end: the 14th trial step ends with the choice made)
    first_choice = at[2][13][1]
    assert [m for m, _ in at[2][:14]] == [True] * 13 + [False] and first_choice in ("fused", "streams")
    assert [m for m, _ in at[3][:14]] == [True] * 13 + [False]  # k=3 is new: measured
    back = at[2][16:]  # the steps after k returned to 2
    assert len(back) == 8 and all(not measuring and chosen == first_choice for measuring, chosen in back)


def test_heterogeneous_mode_keeps_auto_as_fused_without_timing_streams(monkeypatch) -> None:
    """Ranks of different k would time their candidates at different steps, and the choice is agreed by an
    all-reduce: in heterogeneous mode engine="auto" is fused (with its fallback) on every rank."""
    monkeypatch.setattr(CrossbowStrategy, "_stream_pool", lambda self: HostStreamPool())
    spy = EngineSpy()
    strategy = CrossbowStrategy(replicas_per_device=2, heterogeneous=True)
    trainer(strategy=strategy, callbacks=[spy], max_epochs=1).fit(Classifier(), loader(make_data(num_samples=96)))
    assert type(spy.engine).__name__ == "FusedOrSequentialEngine"


def test_make_engine_without_a_pool_refuses_streams_and_keeps_auto_as_fused_with_fallback() -> None:
    module = Classifier()
    with pytest.raises(ValueError, match="engine='streams' runs every replica on its own CUDA stream"):
        make_engine("streams", module, 2)
    assert type(make_engine("auto", module, 2)).__name__ == "FusedOrSequentialEngine"
    assert type(make_engine("auto", module, 2, fused_failed=True)).__name__ == "SequentialEngine"
    assert type(make_engine("auto", module, 1, HostStreamPool())).__name__ == "SequentialEngine"
    known = make_engine("auto", module, 2, HostStreamPool(), fastest="streams")
    assert isinstance(known, FastestEngine) and known.chosen == "streams" and not known.measuring
    assert isinstance(known.active, StreamsEngine)
    with pytest.raises(ValueError, match=r"chosen must be one of the candidates \['fused', 'streams'\], got 'vmap'"):
        make_engine("auto", module, 2, HostStreamPool(), fastest="vmap")
