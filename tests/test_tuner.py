"""ReplicaAutoTuner: with injected step times it settles where Crossbow's rule says; its k survives a resume."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional
from unittest import mock

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import lightning_crossbow.strategy as strategy_module
from lightning_crossbow import CrossbowStrategy, ReplicaAutoTuner
from lightning_crossbow.tuner import TuningRecord
from tests.helpers import Classifier, ResumableLoader, loader, make_data, trainer


def step_seconds(k: int) -> float:
    """A device whose step time grows faster than linearly in k: throughput k / (1 + 0.05 k^2) peaks at k=4."""
    return 1.0 + 0.05 * k * k


class FakeClock(L.Callback):
    """A clock that advances by ``step_seconds(k)`` at the end of every step (k = that step's group size)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.now += step_seconds(len(batch))


def progress_per_step(k: int) -> float:
    """Statistical efficiency: a step of k replicas is worth sqrt(k) single-replica steps of loss decrease."""
    return 0.01 * k**0.5


class ScriptedLoss(Classifier):
    """Its training loss is scripted: it falls by ``progress_per_step(k)`` every step (gradients are zero)."""

    def __init__(self) -> None:
        super().__init__()
        self.scripted = 10.0

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.scripted -= progress_per_step(len(batch))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return super().training_step(batch, batch_idx) * 0.0 + self.scripted


def throughput(k: int) -> float:
    return k / step_seconds(k)


def expected_choice(threshold: float, start: int = 1) -> int:
    """Crossbow's rule on the known step times: add replicas while the last one added more than
    ``threshold`` of an average replica's throughput."""
    k = start
    while (throughput(k + 1) - throughput(k)) / (throughput(k) / k) > threshold:
        k += 1
    return k


class SpikyClock(FakeClock):
    """``FakeClock``, plus ``extra`` seconds once, on the second step at k=2 (its first measured step)."""

    def __init__(self, extra: float) -> None:
        super().__init__()
        self.extra, self.steps_at_two = extra, 0

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if len(batch) == 2:
            self.steps_at_two += 1
            if self.steps_at_two == 2:
                self.now += self.extra


class ChangingClock(FakeClock):
    """``FakeClock`` until step ``switch``; then larger k pays off more: step time ``1 + 0.02 k^2``."""

    def __init__(self, switch: int) -> None:
        super().__init__()
        self.switch = switch

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        k = len(batch)
        self.now += step_seconds(k) if trainer.global_step <= self.switch else 1.0 + 0.02 * k * k


def tuned_fit(
    tmp_path,
    max_steps: int,
    start_k: int = 1,
    ckpt_path=None,
    objective: str = "throughput",
    model=None,
    clock=None,
    num_samples: int = 800,
    **tuner_kwargs: Any,
) -> tuple[ReplicaAutoTuner, L.Trainer]:
    clock = clock or FakeClock()
    tuner = ReplicaAutoTuner(objective=objective, window=4, warmup=1, threshold=0.1, clock=clock, **tuner_kwargs)
    fit = trainer(
        strategy=CrossbowStrategy(replicas_per_device=start_k),
        callbacks=[clock, tuner],
        max_steps=max_steps,
        max_epochs=-1,
        default_root_dir=tmp_path,
    )
    # num_samples / 8 batches per epoch: the tuner keeps k at most a tenth of that
    fit.fit(model or Classifier(), loader(make_data(num_samples=num_samples)), ckpt_path=ckpt_path)
    return tuner, fit


@pytest.mark.parametrize(
    ("climb", "windows"),
    [
        # Crossbow's climb: one replica at a time; k=5 adds nothing, so k=4 and k=5 are measured once more, and
        # k=6 is judged against k=4 (the look ahead) before holding.
        ("linear", [1, 2, 3, 4, 5, 4, 5, 6]),
        # Doubling: P(2), P(4) (3 then 4) pay off, P(8) (7 then 8) does not; P(6) (5, 6) does not either, nor
        # P(5) (4, 5); the closed gap (4, 5) is measured once more, and k=6 against k=4, before holding at 4.
        ("doubling", [1, 2, 3, 4, 7, 8, 5, 6, 4, 5, 4, 5, 6]),
    ],
)
def test_tuner_settles_on_the_k_crossbows_rule_picks(tmp_path, climb: str, windows: list[int]) -> None:
    tuner, fit = tuned_fit(tmp_path, max_steps=80, climb=climb)
    expected = expected_choice(0.1)
    assert expected == max(range(1, 9), key=throughput) == 4  # k=5 adds nothing: the throughput peak
    assert tuner.chosen == expected
    assert fit.strategy.replicas_per_device == expected
    assert [r.replicas_per_device for r in tuner.history] == windows
    for record in tuner.history:  # measured rates are the injected ones: samples per step / seconds per step
        k = record.replicas_per_device
        assert record.samples_per_sec == pytest.approx(k * 8 / step_seconds(k))
    assert "chosen: k=4" in tuner.summary()
    assert (tmp_path / "replica_tuning.png").read_bytes().startswith(b"\x89PNG")


def test_a_tuner_still_exploring_says_at_which_k_and_draws_k_up_to_the_end(tmp_path) -> None:
    tuner, fit = tuned_fit(tmp_path, max_steps=13)  # windows of 4 steps after 1 of warm-up: 2 windows, then 3 steps
    k = fit.strategy.replicas_per_device
    assert tuner.chosen is None and len(tuner.history) == 2
    assert k == 3 and [r.replicas_per_device for r in tuner.history] == [1, 2]
    assert tuner.summary(current=k).endswith("still exploring, at k=3")
    steps, ks = tuner.k_over_time(end=(fit.global_step, k))
    assert steps == [0, tuner.history[0].step, tuner.history[1].step, 13]
    assert ks == [1, 1, 2, 3]  # drawn "pre": the k of each point holds over the steps up to it
    assert (tmp_path / "replica_tuning.png").read_bytes().startswith(b"\x89PNG")


def test_the_best_window_is_the_best_by_the_objective() -> None:
    tuner = ReplicaAutoTuner(objective="progress", plot=False)
    tuner.history = [
        TuningRecord(step=5, replicas_per_device=1, samples_per_sec=100.0, progress_per_sec=0.5),
        TuningRecord(step=10, replicas_per_device=2, samples_per_sec=180.0, progress_per_sec=0.4),
    ]
    assert tuner.best().replicas_per_device == 1
    assert "best measured: k=1 (0.5 loss decrease/s)" in tuner.summary()
    tuner.objective = "throughput"
    assert tuner.best().replicas_per_device == 2


def search(
    climb: str,
    rate: Callable[[int], float],
    max_replicas: int = 16,
    fitting_an_epoch: Optional[int] = None,
    look_ahead: bool = True,
) -> tuple[int, list[int]]:
    """Runs the throughput search on exact rates, window by window; returns the k it holds and the windows."""
    tuner = ReplicaAutoTuner(climb=climb, max_replicas=max_replicas, threshold=0.1, look_ahead=look_ahead)
    device = SimpleNamespace(  # no memory bound
        replica_ceiling=None, stack=None, replicas_fitting_an_epoch=lambda: fitting_an_epoch
    )
    k = 1
    while tuner.chosen is None:
        tuner.history.append(TuningRecord(len(tuner.history), k, rate(k)))
        k = tuner._decide(k, device)
        assert len(tuner.history) < 100
    return tuner.chosen, [r.replicas_per_device for r in tuner.history]


def search_with_memory(climb: str, rate: Callable[[int], float], fits: int) -> tuple[int, list[int]]:
    """The search on a device where more than ``fits`` replicas run out of memory: the strategy backs off to
    ``fits`` during the window and remembers it as its ceiling (as ``CrossbowStrategy._back_off`` does)."""
    tuner = ReplicaAutoTuner(climb=climb, max_replicas=16, threshold=0.1)
    device = SimpleNamespace(replica_ceiling=None, stack=None, replicas_fitting_an_epoch=lambda: None)
    k = 1
    while tuner.chosen is None:
        if k > fits:
            k, device.replica_ceiling = fits, fits
        tuner.history.append(TuningRecord(len(tuner.history), k, rate(k)))
        k = tuner._decide(k, device)
        assert len(tuner.history) < 100
    return tuner.chosen, [r.replicas_per_device for r in tuner.history]


@pytest.mark.parametrize(
    ("climb", "windows"),
    [
        ("linear", [1, 2, 3, 4, 5, 5]),  # 6 ran out of memory in the sixth window: it holds 5
        ("doubling", [1, 2, 3, 4, 5, 4, 5]),  # 7 (on the way to probing 8) did: it judges 5 (4, 5) and holds it
    ],
)
def test_a_probe_that_ran_out_of_memory_is_not_tried_again(climb: str, windows: list[int]) -> None:
    chosen, measured = search_with_memory(climb, lambda k: float(k), fits=5)
    assert chosen == 5 and measured == windows


@pytest.mark.parametrize("look_ahead", [True, False])
def test_the_tuner_holds_within_a_ceiling_that_fell_below_what_paid_off(look_ahead: bool) -> None:
    """k = 1..4 paid off; the window at 5 ran out of memory down to 2 (free memory shrank): it holds 2, not 4."""
    tuner = ReplicaAutoTuner(max_replicas=8, threshold=0.1, look_ahead=look_ahead)
    device = SimpleNamespace(replica_ceiling=None, stack=None, replicas_fitting_an_epoch=lambda: None)
    k, windows = 1, []
    while tuner.chosen is None:
        if k == 5:
            k, device.replica_ceiling = 2, 2
        tuner.history.append(TuningRecord(len(windows), k, float(k)))
        windows.append(k)
        k = tuner._decide(k, device)
        assert len(windows) < 50
    assert windows == [1, 2, 3, 4, 2] and tuner.chosen == k == 2


def crossbow_rule(rate: Callable[[int], float], max_replicas: int = 16, threshold: float = 0.1) -> int:
    """Crossbow's rule written out: add a replica while the added one pays off more than ``threshold``."""
    k = 1
    while k < max_replicas and (rate(k + 1) - rate(k)) / (rate(k) / k) > threshold:
        k += 1
    return k


CURVES = {
    **{f"k / (1 + {c} k^2)": (lambda k, c=c: k / (1 + c * k * k)) for c in (0.5, 0.05, 0.01, 0.002, 0.0005)},
    **{f"k^{e}": (lambda k, e=e: k**e) for e in (1.0, 0.5, 0.2, 0.05)},
    **{f"saturating at {s}": (lambda k, s=s: min(k, s) + 0.01 * k) for s in (3, 6, 11, 30)},
}


@pytest.mark.parametrize("look_ahead", [True, False])
@pytest.mark.parametrize("curve", list(CURVES))
def test_doubling_holds_where_crossbows_linear_climb_does(curve: str, look_ahead: bool) -> None:
    """Where each added replica pays off less than the one before, both climbs hold at the k of Crossbow's
    rule, with the look ahead or without. At the top of the range doubling gets there in 8 windows instead of
    16, and forgoes less throughput on the way (the sum over windows of 1 - R_k / R_best)."""
    rate = CURVES[curve]
    expected = crossbow_rule(rate)
    (linear, linear_windows), (doubling, doubling_windows) = (
        search("linear", rate, look_ahead=look_ahead),
        search("doubling", rate, look_ahead=look_ahead),
    )
    assert linear == doubling == expected
    if expected == 16:  # k = 1, 2, 3, 4, 7, 8, 15, 16 against 1 .. 16
        assert doubling_windows == [1, 2, 3, 4, 7, 8, 15, 16] and linear_windows == list(range(1, 17))
        forgone = lambda windows: sum(1 - rate(k) / rate(16) for k in windows)  # noqa: E731
        assert forgone(doubling_windows) < forgone(linear_windows)


def flat_at(*flat: int) -> Callable[[int], float]:
    """Linear throughput, except that each replica in ``flat`` adds a twentieth of a replica's share only."""
    return lambda k: k - 0.95 * sum(1 for j in flat if j <= k)


@pytest.mark.parametrize(
    ("flat", "look_ahead", "held", "windows"),
    [
        ((5,), False, 4, [1, 2, 3, 4, 5, 4, 5]),  # Crossbow's rule: the flat fifth replica stops the climb
        ((5,), True, 8, [1, 2, 3, 4, 5, 4, 5, 6, 7, 8]),  # 6 against 4 pays off: the climb goes on to the top
        ((5, 6), True, 4, [1, 2, 3, 4, 5, 4, 5, 6]),  # two flat replicas in a row: the pair does not pay off
    ],
)
def test_the_look_ahead_climbs_past_one_flat_replica(
    flat: tuple[int, ...], look_ahead: bool, held: int, windows: list[int]
) -> None:
    rate = flat_at(*flat)
    assert crossbow_rule(rate, max_replicas=8) == 4
    assert search("linear", rate, max_replicas=8, look_ahead=look_ahead) == (held, windows)


def test_one_slow_window_does_not_stop_the_climb(tmp_path) -> None:
    """A stall of 4 s inside the first window at k=2 makes k=2 look slower than k=1; measured again,
    k=1 and k=2 are judged on both of their windows, and the climb goes on to the true best k."""
    clock = SpikyClock(extra=4.0)
    tuner, _ = tuned_fit(tmp_path, max_steps=80, clock=clock)
    assert [r.replicas_per_device for r in tuner.history][:4] == [1, 2, 1, 2]
    assert tuner.history[1].samples_per_sec < tuner.history[0].samples_per_sec  # the stall
    assert tuner.chosen == 4


CLIMB_TRACES = {
    # climb: (the step after which the step times change (after the first hold), the last step (while it holds),
    # windows until it holds 4, windows of the search again from 4 under the new step times)
    "linear": (45, 95, [1, 2, 3, 4, 5, 4, 5, 6], [4, 5, 6, 7, 6, 7, 8]),  # P(5), P(6) pay off, P(7) fails twice
    # from 4: P(5) pays off, P(10) does not, nor P(7); P(6) does; P(7) fails again (and 8 against 6)
    "doubling": (70, 140, [1, 2, 3, 4, 7, 8, 5, 6, 4, 5, 4, 5, 6], [4, 5, 9, 10, 6, 7, 5, 6, 6, 7, 8]),
}


@pytest.mark.parametrize("climb", list(CLIMB_TRACES))
@pytest.mark.parametrize(("recheck_every", "expected"), [(2, 6), (None, 4)])
def test_the_tuner_explores_again_after_holding(tmp_path, recheck_every, expected: int, climb: str) -> None:
    """It holds at k=4 (by step 40 or 65, each search ending with a look ahead); the device then favours more replicas (best by Crossbow's rule: 6).
    Exploring again after 2 windows' worth of held steps finds 6; holding for good stays at 4."""
    late = lambda k: k / (1.0 + 0.02 * k * k)  # noqa: E731
    assert max(k for k in range(4, 9) if k == 4 or (late(k) - late(k - 1)) / (late(k - 1) / (k - 1)) > 0.1) == 6
    switch, last, first, again = CLIMB_TRACES[climb]
    tuner, fit = tuned_fit(
        tmp_path, max_steps=last, clock=ChangingClock(switch=switch), recheck_every=recheck_every, climb=climb
    )
    windows = [r.replicas_per_device for r in tuner.history]
    assert windows[: len(first)] == first
    if recheck_every:
        assert windows[len(first) : len(first) + len(again)] == again
    assert tuner.chosen == fit.strategy.replicas_per_device == expected


def test_the_tuner_counts_batches_where_the_batch_size_is_unknown(tmp_path) -> None:
    """A loader with a custom batch_sampler has no batch_size: throughput counts batches (k per step)."""
    clock = FakeClock()
    tuner = ReplicaAutoTuner(window=4, warmup=1, threshold=0.1, clock=clock, plot=False)
    sampler = torch.utils.data.BatchSampler(
        torch.utils.data.SequentialSampler(range(400)), batch_size=8, drop_last=False
    )
    fit = trainer(
        strategy=CrossbowStrategy(replicas_per_device=1), callbacks=[clock, tuner], max_steps=80, max_epochs=-1
    )
    fit.fit(Classifier(), DataLoader(make_data(num_samples=400), batch_sampler=sampler))
    assert tuner.chosen == 4
    for record in tuner.history:
        assert record.samples_per_sec == pytest.approx(
            record.replicas_per_device / step_seconds(record.replicas_per_device)
        )


@pytest.mark.parametrize("objective", ["throughput", "progress"])
def test_no_window_is_measured_below_min_replicas(tmp_path, objective: str) -> None:
    tuner, _ = tuned_fit(tmp_path, max_steps=60, objective=objective, min_replicas=3)
    measured = [record.replicas_per_device for record in tuner.history]
    assert measured and min(measured) == 3
    assert tuner.chosen is None or tuner.chosen >= 3


@pytest.mark.parametrize("objective", ["throughput", "progress"])
def test_no_window_is_measured_above_max_replicas(tmp_path, objective: str) -> None:
    """The strategy's replicas_per_device above the tuner's max_replicas: training starts at max_replicas."""
    tuner, _ = tuned_fit(tmp_path, max_steps=30, start_k=4, objective=objective, max_replicas=2)
    measured = [record.replicas_per_device for record in tuner.history]
    assert measured and max(measured) <= 2


def test_a_resumed_choice_above_max_replicas_becomes_max_replicas(tmp_path) -> None:
    tuner, fit = tuned_fit(tmp_path, max_steps=70)
    assert tuner.chosen == 4
    fit.save_checkpoint(tmp_path / "tuned.ckpt")
    resumed, fit = tuned_fit(tmp_path, max_steps=80, ckpt_path=tmp_path / "tuned.ckpt", max_replicas=2)
    assert resumed.chosen == fit.strategy.replicas_per_device == 2
    assert resumed.summary().endswith("chosen: k=2")


def test_a_resumed_run_keeps_the_tuned_k(tmp_path) -> None:
    tuner, fit = tuned_fit(tmp_path, max_steps=70)
    fit.save_checkpoint(tmp_path / "tuned.ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed_tuner, resumed = tuned_fit(tmp_path, max_steps=80, start_k=1, ckpt_path=tmp_path / "tuned.ckpt")
    assert not [w for w in caught if "re-seeded" in str(w.message)]  # the replicas were restored, not re-seeded
    assert resumed.strategy.replicas_per_device == tuner.chosen == resumed_tuner.chosen == 4
    assert resumed.global_step == 80


def _checkpointed_every_epoch(
    tmp_path: Path, ckpt_path: Optional[Path], window: int, max_replicas: int, epochs: int, batches: int
) -> tuple[list[int], Classifier]:
    """A tuned fit from k=1 (warm-up 1) over ``batches`` batches of 8 an epoch, checkpointed at every epoch's end
    into ``tmp_path`` (``epoch=N.ckpt``), or resumed from ``ckpt_path``; returns its steps' group sizes and z."""
    clock, sizes = FakeClock(), _GroupSizes()
    tuner = ReplicaAutoTuner(window=window, warmup=1, threshold=0.1, clock=clock, max_replicas=max_replicas, plot=False)
    saves = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    fit = trainer(
        strategy=CrossbowStrategy(replicas_per_device=1),
        callbacks=[clock, tuner, sizes, saves],
        max_epochs=epochs,
        enable_checkpointing=True,
    )
    model = Classifier()
    fit.fit(model, loader(make_data(num_samples=8 * batches)), ckpt_path=ckpt_path)
    return sizes.sizes, model


def test_a_checkpoint_taken_where_the_tuner_changes_k_resumes_with_the_new_k(tmp_path) -> None:
    """The tuner's first window ends on the first epoch's last step and moves k from 1 to 2 there; the epoch-end
    checkpoint resumes with k=2 from the next step on, as the uninterrupted run goes on: bitwise the same run."""

    def run(ckpt_path: Optional[Path] = None) -> tuple[list[int], Classifier]:
        return _checkpointed_every_epoch(tmp_path, ckpt_path, window=9, max_replicas=2, epochs=3, batches=10)

    sizes, straight = run()
    assert sizes[:10] == [1] * 10 and sizes[10] == 2  # k changed at the first epoch's end
    resumed_sizes, resumed = run(tmp_path / "epoch=0.ckpt")
    assert resumed_sizes == sizes[10:]
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_tuner_that_the_strategy_adds_decides_before_a_checkpoint_of_the_same_step_is_saved(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """replicas_per_device="auto" adds the strategy's own tuner, before the checkpoint callbacks (where Lightning puts
    a tuner given to the Trainer): a checkpoint that every_n_train_steps saves at the step where the tuner moves k
    from 1 to 2 resumes with k=2, as the run that went on, bitwise (before: at k=1 for another window, its choice
    lost). (The loader saves its place, so that the resume in the epoch's middle goes on with its next batch.)"""
    clock = FakeClock()

    class ClockedTuner(ReplicaAutoTuner):  # the strategy's tuner, on the test's clock
        def __init__(self) -> None:
            super().__init__(window=4, warmup=1, threshold=0.1, clock=clock, max_replicas=2, plot=False)

    monkeypatch.setattr(strategy_module, "ReplicaAutoTuner", ClockedTuner)

    def run(ckpt_path: Optional[Path] = None) -> tuple[list[int], Classifier]:
        sizes, model = _GroupSizes(), Classifier()
        saves = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=5, save_top_k=-1)
        fit = trainer(
            strategy=CrossbowStrategy(replicas_per_device="auto"),
            callbacks=[clock, sizes, saves],
            max_steps=12,
            enable_checkpointing=True,
        )
        fit.fit(model, ResumableLoader(make_data(num_samples=8 * 40), batch_size=8), ckpt_path=ckpt_path)
        order.append([type(c) for c in fit.callbacks][-2:])
        return sizes.sizes, model

    order: list[list[type]] = []
    sizes, straight = run()
    assert sizes[:5] == [1] * 5 and sizes[5] == 2  # k changed at step 5's end
    resumed_sizes, resumed = run(tmp_path / "step=5.ckpt")
    assert resumed_sizes == sizes[5:]
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert order == [[ClockedTuner, ModelCheckpoint]] * 2


def test_a_tuned_k_per_device_carries_on_under_another_world_size(tmp_path) -> None:
    """k is per device: resumed with as many devices or not, the tuned k is in force and the tuner holds it (the
    checkpoint is marked as written by 2 processes, so the replicas are re-seeded from z)."""
    tuner, fit = tuned_fit(tmp_path, max_steps=70)
    fit.save_checkpoint(tmp_path / "tuned.ckpt")
    checkpoint = torch.load(tmp_path / "tuned.ckpt", weights_only=False)
    checkpoint["crossbow"]["world_size"] = 2
    torch.save(checkpoint, tmp_path / "two.ckpt")
    with pytest.warns(UserWarning, match="world_size=2 with replicas_per_device=4 x world_size=1: the replicas"):
        resumed_tuner, resumed = tuned_fit(tmp_path, max_steps=80, start_k=1, ckpt_path=tmp_path / "two.ckpt")
    assert resumed.strategy.replicas_per_device == tuner.chosen == resumed_tuner.chosen == 4


def test_a_run_resumed_mid_search_goes_on_with_the_same_search(tmp_path) -> None:
    """Stopped after 4 windows of the doubling climb (k = 1, 2, 3, 4: probing 8 next), the resumed tuner carries on
    where it was."""
    tuner, fit = tuned_fit(tmp_path, max_steps=21, climb="doubling")
    assert [r.replicas_per_device for r in tuner.history] == [1, 2, 3, 4] and tuner.chosen is None
    fit.save_checkpoint(tmp_path / "searching.ckpt")
    resumed_tuner, _ = tuned_fit(tmp_path, max_steps=80, ckpt_path=tmp_path / "searching.ckpt", climb="doubling")
    assert [r.replicas_per_device for r in resumed_tuner.history] == [1, 2, 3, 4, 7, 8, 5, 6, 4, 5, 4, 5, 6]
    assert resumed_tuner.chosen == 4


def test_a_run_resumed_from_an_epoch_end_in_the_middle_of_a_window_trains_at_the_same_k_every_step(tmp_path) -> None:
    """The default epoch-end checkpoint falls inside a window (40 batches an epoch, windows of 1 + 7 steps): the
    resumed tuner goes on with the steps that window had measured, so k changes at the same steps as in the
    uninterrupted run, and the two runs train the same values."""

    def run(ckpt_path: Optional[Path] = None) -> tuple[list[int], Classifier]:
        return _checkpointed_every_epoch(tmp_path, ckpt_path, window=7, max_replicas=6, epochs=4, batches=40)

    sizes, straight = run()
    assert sizes[:22] == [1] * 8 + [2] * 8 + [3] * 6  # the first epoch (21 steps) ends in the window at k=3
    resumed_sizes, resumed = run(tmp_path / "epoch=0.ckpt")
    assert resumed_sizes == sizes[21:]
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_search_resumed_under_other_bounds_measures_no_window_outside_them(tmp_path) -> None:
    """Stopped while probing k=3 (windows at 1 and 2), resumed with min_replicas=4: the search starts again from 4."""
    tuner, fit = tuned_fit(tmp_path, max_steps=11)
    assert [r.replicas_per_device for r in tuner.history] == [1, 2] and tuner._climb.probe == 3
    fit.save_checkpoint(tmp_path / "searching.ckpt")
    resumed, fit = tuned_fit(tmp_path, max_steps=60, ckpt_path=tmp_path / "searching.ckpt", min_replicas=4)
    assert min(r.replicas_per_device for r in resumed.history[2:]) == 4
    assert resumed.chosen == fit.strategy.replicas_per_device == 4


def test_a_tuner_used_again_in_another_trainer_goes_on_at_its_choice_and_measures_afresh() -> None:
    """Its held k is what the next fit trains at; a window that the last fit left half measured at k=3 is not
    mixed with the new fit's steps at k=1: the new fit's first window measures k=1 alone."""
    clock, sizes = FakeClock(), _GroupSizes()
    tuner = ReplicaAutoTuner(window=4, warmup=1, threshold=0.1, clock=clock, plot=False, recheck_every=None)
    for max_steps in (60, 30):
        fit = trainer(
            strategy=CrossbowStrategy(replicas_per_device=1),
            callbacks=[clock, tuner, sizes],
            max_steps=max_steps,
            max_epochs=-1,
        )
        fit.fit(Classifier(), loader(make_data(num_samples=800)))
    assert tuner.chosen == 4 and set(sizes.sizes[-30:]) == {4}
    clock = FakeClock()
    tuner = ReplicaAutoTuner(window=4, warmup=1, threshold=0.1, clock=clock, plot=False)
    for max_steps in (13, 30):  # the first fit stops two steps into the window at k=3
        fit = trainer(
            strategy=CrossbowStrategy(replicas_per_device=1),
            callbacks=[clock, tuner],
            max_steps=max_steps,
            max_epochs=-1,
        )
        fit.fit(Classifier(), loader(make_data(num_samples=800)))
        clock.now += 1000.0  # time between the fits
    rates = [(r.replicas_per_device, r.samples_per_sec) for r in tuner.history]
    assert rates[2] == (1, pytest.approx(8 / step_seconds(1)))  # 8 samples a batch
    assert all(rate == pytest.approx(8 * k / step_seconds(k)) for k, rate in rates)


class _Stream(torch.utils.data.IterableDataset):
    def __init__(self, num_samples: int) -> None:
        self.data = make_data(num_samples=num_samples)

    def __iter__(self) -> Any:
        return (self.data[i] for i in range(len(self.data)))


@pytest.mark.parametrize("warmup", [0, 1])
def test_the_tuner_changes_k_over_a_loader_without_a_length(warmup: int) -> None:
    """Lightning fetches such a loader's next group before the step that changes k: the first step after a change
    still runs at the old k, and is not measured as the new k's (without warm-up steps, it would be)."""
    clock, sizes = FakeClock(), _GroupSizes()
    tuner = ReplicaAutoTuner(window=4, warmup=warmup, threshold=0.1, clock=clock, plot=False)
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=1), callbacks=[clock, tuner, sizes], max_steps=30)
    fit.fit(Classifier(), DataLoader(_Stream(800), batch_size=8))
    assert [r.replicas_per_device for r in tuner.history][:4] == [1, 2, 3, 4] and max(sizes.sizes) >= 4
    assert all(r.samples_per_sec == pytest.approx(throughput(r.replicas_per_device) * 8) for r in tuner.history)


class _SkipsAStep(ScriptedLoss):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return None if batch_idx == 7 else super().training_step(batch, batch_idx)


class _SlowerClock(FakeClock):
    """``FakeClock`` with every step ``slower`` times as long."""

    slower = 1.0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.now += step_seconds(len(args[1])) * self.slower


def test_a_window_is_not_measured_across_two_fits_of_one_trainer() -> None:
    """A fit that stops inside a window at k=3, then a second fit of the same trainer at that k, on a device now
    twice as slow: the second fit's windows hold its own steps only."""
    clock = _SlowerClock()
    tuner = ReplicaAutoTuner(window=4, warmup=1, threshold=0.1, clock=clock, plot=False)
    fit = trainer(
        strategy=CrossbowStrategy(replicas_per_device=1), callbacks=[clock, tuner], max_steps=13, max_epochs=-1
    )
    data = loader(make_data(num_samples=800))
    fit.fit(Classifier(), data)
    measured = len(tuner.history)
    assert fit.strategy.replicas_per_device == 3 and tuner._window_steps > 0  # (stopped inside a window at k=3)
    clock.slower = 2.0
    fit.fit_loop.epoch_loop.max_steps = 30
    fit.fit(fit.lightning_module, data)
    assert len(tuner.history) > measured
    rates = [(r.replicas_per_device, r.samples_per_sec) for r in tuner.history[measured:]]
    assert all(rate == pytest.approx(throughput(k) * 8 / 2.0) for k, rate in rates)


def test_a_min_replicas_that_the_epoch_cannot_hold_is_warned_of() -> None:
    """20 batches an epoch: k above 6 would leave more than a tenth of them out of the last step."""
    tuner = ReplicaAutoTuner(min_replicas=8, max_replicas=8, window=4, warmup=1, plot=False)
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=1), callbacks=[tuner], max_steps=6)
    with pytest.warns(UserWarning, match=r"min_replicas=8, but training starts at k=6: a larger k would leave"):
        fit.fit(Classifier(), loader(make_data(num_samples=160)))
    assert fit.strategy.replicas_per_device == 6


def test_a_starting_k_above_max_replicas_is_lowered_before_the_loader_groups_at_it(recwarn) -> None:
    """100 batches at k=8 would skip 4 of them each epoch (a warning); at max_replicas=4 none are skipped."""
    tuner = ReplicaAutoTuner(max_replicas=4, window=4, warmup=1, plot=False)
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=8), callbacks=[tuner], max_steps=3)
    fit.fit(Classifier(), loader(make_data(num_samples=800)))
    assert fit.strategy.replicas_per_device == 4
    assert not [w for w in recwarn if "do not fill a step" in str(w.message)]


def test_the_progress_objective_leaves_out_a_step_every_replica_skipped(tmp_path) -> None:
    tuner, _ = tuned_fit(tmp_path, max_steps=40, objective="progress", model=_SkipsAStep())
    assert len(tuner.history) >= 3 and all(math.isfinite(r.progress_per_sec) for r in tuner.history)


def test_a_tuner_that_measured_no_window_says_so() -> None:
    tuner = ReplicaAutoTuner(window=4, warmup=1, plot=False)
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=1), callbacks=[tuner], max_epochs=20)
    with pytest.warns(UserWarning, match="ReplicaAutoTuner measured no window in this fit, so k stayed at 1"):
        fit.fit(Classifier(), loader(make_data(), batch_size=80))  # one step an epoch: no interval counts
    with warnings.catch_warnings(record=True) as caught:  # a fit that measures windows...
        warnings.simplefilter("always")
        trainer(strategy=CrossbowStrategy(replicas_per_device=1), callbacks=[tuner], max_steps=12).fit(
            Classifier(), loader(make_data(num_samples=400))
        )
    assert tuner.history and not [w for w in caught if "measured no window" in str(w.message)]
    with pytest.warns(
        UserWarning, match="ReplicaAutoTuner measured no window in this fit"
    ):  # ...then one that does not
        trainer(strategy=CrossbowStrategy(replicas_per_device=1), callbacks=[tuner], max_steps=3).fit(
            Classifier(), loader(make_data(num_samples=400))
        )


def test_a_plot_path_that_cannot_be_written_is_refused_before_training(tmp_path) -> None:
    (tmp_path / "a_file").write_text("")
    (tmp_path / "figure.png").mkdir()
    for plot, message in (
        (tmp_path, r"names a directory \(.*\); give the file to write, such as"),
        (tmp_path / "figure", r"names a directory \('.*figure.png'\)"),  # (the .png added to a name without a suffix)
        (tmp_path / "a_file" / "tuning.png", "lies under .*a_file', which is a file"),
        (tmp_path / "tuning.xyz", r"matplotlib writes no '.xyz' files; give one of .*\.pdf, .*\.png"),
    ):
        fit = trainer(strategy=CrossbowStrategy(replicas_per_device=1), callbacks=[ReplicaAutoTuner(plot=plot)])
        with pytest.raises(ValueError, match=message):
            fit.fit(Classifier(), loader(make_data()))
        assert fit.global_step == 0


def test_the_plot_never_overwrites_a_file_and_expands_the_home_folder(tmp_path, monkeypatch) -> None:
    """A file already where the plot goes (the user's, or an earlier fit's plot) stays as it was: the plot goes to
    the first free ``-v1``, ``-v2``, ... beside it; ``~`` is the home folder, as for ModelCheckpoint's dirpath."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "tuning.png").write_text("the user's own figure")
    for _ in range(2):
        clock = FakeClock()
        tuner = ReplicaAutoTuner(window=4, warmup=1, clock=clock, plot="~/tuning.png")
        trainer(strategy=CrossbowStrategy(replicas_per_device=1), callbacks=[clock, tuner], max_steps=12).fit(
            Classifier(), loader(make_data(num_samples=400))
        )
    assert (tmp_path / "tuning.png").read_text() == "the user's own figure"
    for written in ("tuning-v1.png", "tuning-v2.png"):
        assert (tmp_path / written).read_bytes().startswith(b"\x89PNG")
    assert not (Path.cwd() / "~").exists()


def test_the_tuner_needs_the_crossbow_strategy() -> None:
    with pytest.raises(TypeError, match="ReplicaAutoTuner tunes CrossbowStrategy's replicas_per_device"):
        trainer(callbacks=[ReplicaAutoTuner()]).fit(Classifier(), loader(make_data()))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"objective": "accuracy"}, "objective must be one of"),
        ({"min_replicas": 0}, "min_replicas must be a positive int"),
        ({"min_replicas": 4, "max_replicas": 2}, r"max_replicas must be an int >= 4 \(min_replicas=4\), got 2"),
        ({"window": 0}, "window must be a positive int"),
        ({"threshold": -0.1}, "threshold must be a number >= 0"),
        ({"threshold": True}, "threshold must be a number >= 0, got True"),
        ({"threshold": float("inf")}, "threshold must be a number >= 0, got inf"),
        ({"recheck_every": 0}, "recheck_every must be a positive int .* or None"),
        ({"climb": "binary"}, "climb must be one of"),
        ({"look_ahead": "yes"}, "look_ahead must be True or False, got 'yes'"),
        (
            {"objective": "progress", "climb": "doubling", "look_ahead": False},
            "climb='doubling' and look_ahead=False apply to objective='throughput' only",
        ),
        ({"objective": "progress", "look_ahead": False}, r"^look_ahead=False applies to objective='throughput' only"),
        ({"plot": True}, r"plot must be a path \(str or os.PathLike\), None \(in the trainer's log_dir\) or False"),
        ({"plot": 123}, "plot must be a path .*, got 123"),
        ({"plot": ""}, "plot must be a path .*, got ''"),
        ({"clock": 5}, r"clock must be a function returning seconds \(as time.perf_counter\), got 5"),
    ],
)
def test_bad_tuner_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReplicaAutoTuner(**kwargs)


def test_auto_replicas_adds_a_tuner_and_starts_from_one_replica() -> None:
    strategy = CrossbowStrategy(replicas_per_device="auto")
    assert strategy.replicas_per_device == 1
    fit = trainer(strategy=strategy, max_steps=3)
    fit.fit(Classifier(), loader(make_data(num_samples=80)))
    assert sum(isinstance(c, ReplicaAutoTuner) for c in fit.callbacks) == 1


def test_the_progress_objective_weighs_statistical_efficiency(tmp_path) -> None:
    """Throughput alone would take k=4; per second of wall time the loss falls fastest at k=2."""
    rate = {k: progress_per_step(k) / step_seconds(k) for k in range(1, 5)}  # loss decrease per second
    assert rate[2] > 1.1 * rate[1] and rate[3] < 1.1 * rate[2]
    tuner, fit = tuned_fit(tmp_path, max_steps=80, objective="progress", model=ScriptedLoss(), num_samples=400)
    assert tuner.chosen == fit.strategy.replicas_per_device == 2
    assert [r.replicas_per_device for r in tuner.history] == [1, 2, 1, 2, 3, 2]  # A-B-A around every trial
    for record in tuner.history:
        assert record.progress_per_sec == pytest.approx(rate[record.replicas_per_device], rel=1e-4)  # float32 losses


@pytest.mark.parametrize("climb", ["linear", "doubling"])
def test_the_search_keeps_k_where_an_epoch_skips_under_a_tenth_of_its_batches(climb: str) -> None:
    """With a ceiling of 3 from the epoch's length, a throughput that keeps rising never takes k past 3."""
    chosen, windows = search(climb, lambda k: 100.0 * k, fitting_an_epoch=3)
    assert chosen == 3
    assert max(windows) == 3


@pytest.mark.parametrize(("batches", "ceiling"), [(35, 5), (12, 4), (6, 3), (250, 27), (7, 1)])
def test_the_strategy_bounds_k_where_an_epoch_would_skip_over_a_tenth_of_its_batches(
    batches: int, ceiling: int
) -> None:
    strategy = CrossbowStrategy(replicas_per_device=1)
    fit = trainer(strategy=strategy, max_epochs=1, limit_train_batches=1)
    fit.fit(Classifier(), loader(make_data(num_samples=8 * batches)))
    assert strategy.replicas_fitting_an_epoch() == ceiling
    for k in range(1, ceiling + 1):  # the rule, written out
        assert batches % k <= batches / 10
    assert batches % (ceiling + 1) > batches / 10 or ceiling == batches


class _KAtBatch(L.Callback):
    """Records (batch_idx, k) at every batch's start."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append((batch_idx, len(batch)))


def test_with_accumulated_gradients_k_changes_right_after_an_optimizer_step(tmp_path) -> None:
    """accumulate_grad_batches=3 and a window of 4 steps: every window ends between two optimizer steps,
    and the tuner waits for the next one; the run changes k several times without an error."""
    seen = _KAtBatch()
    tuner = ReplicaAutoTuner(window=4, warmup=1, threshold=0.1, clock=FakeClock())
    fit = trainer(
        strategy=CrossbowStrategy(replicas_per_device=1),
        callbacks=[tuner.clock, tuner, seen],
        max_steps=12,
        accumulate_grad_batches=3,
        max_epochs=-1,
        default_root_dir=tmp_path,
    )
    fit.fit(Classifier(), loader(make_data(num_samples=800)))
    changes = [index for index in range(1, len(seen.seen)) if seen.seen[index][1] != seen.seen[index - 1][1]]
    assert len(changes) >= 2
    for index in changes:  # the first batch of an accumulation window, in its epoch
        assert seen.seen[index][0] % 3 == 0


def test_a_schedule_that_steps_every_step_is_warned_of_when_k_is_tuned() -> None:
    class OneCycle(Classifier):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            total = self.trainer.estimated_stepping_batches
            schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    with pytest.warns(UserWarning, match="OneCycleLR steps every optimizer step, and the ReplicaAutoTuner"):
        trainer(strategy=CrossbowStrategy(replicas_per_device="auto"), max_epochs=1).fit(
            OneCycle(), loader(make_data(num_samples=32))
        )


class _RoomSeen(L.Callback):
    """The room for more learners this rank reports, were the machine shared by 1 or 4 processes."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        strategy = trainer.strategy
        self.per_replica = strategy.stack.state_bytes_per_replica()
        self.room = {}
        for processes in (1, 4):
            with mock.patch.object(type(strategy), "num_processes", property(lambda self: processes)):
                self.room[processes] = strategy._room_for_learners()


def test_the_room_for_more_replicas_on_cpu_shares_the_ram_among_the_machines_processes(monkeypatch) -> None:
    """Each further replica must fit twice in the free RAM, which every process on the machine draws from."""
    free = 10_000_000
    monkeypatch.setattr("lightning_crossbow.strategy.device_memory", lambda device: {"memory_free_bytes": free})
    seen = _RoomSeen()
    trainer(strategy=CrossbowStrategy(replicas_per_device=2), callbacks=[seen], max_steps=1).fit(
        Classifier(), loader(make_data())
    )
    for processes in (1, 4):
        assert seen.room[processes] == int(free / processes // (2 * seen.per_replica))


class _GroupSizes(L.Callback):
    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.sizes.append(len(batch))


def test_min_replicas_starts_no_higher_than_the_free_memory_allows(monkeypatch) -> None:
    """Free memory for one more replica only (each must fit twice): min_replicas=4 starts at k=2, not 4."""
    per_replica = 5 * 4 * sum(p.numel() for p in Classifier().parameters())  # ReplicaStack.state_bytes_per_replica
    monkeypatch.setattr(
        "lightning_crossbow.strategy.device_memory", lambda device: {"memory_free_bytes": 2.5 * per_replica}
    )
    sizes = _GroupSizes()
    tuner = ReplicaAutoTuner(min_replicas=4, max_replicas=8, window=2, warmup=0, plot=False)
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=1), callbacks=[tuner, sizes], max_steps=3)
    fit.fit(Classifier(), loader(make_data(num_samples=192)))
    assert sizes.sizes[0] == 2


def test_a_command_line_reads_plot_false_as_no_plot_not_a_file_named_false() -> None:
    """LightningCLI parses the tuner's arguments with jsonargparse, by their type hints: ``--plot false`` is False (no
    plot), where it was the path 'false' (a file false.png); a path and null keep their meaning."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(ReplicaAutoTuner, "tuner")
    parsed = [parser.parse_args(["--tuner.plot", value]).tuner.plot for value in ("false", "plots/k.png", "null")]
    assert parsed == [False, "plots/k.png", None]


class _Validations(L.Callback):
    def __init__(self) -> None:
        self.epochs: list[int] = []

    def on_validation_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self.epochs.append(trainer.current_epoch)


def test_the_tuner_keeps_an_integer_val_check_intervals_steps_in_every_epoch() -> None:
    """20 batches an epoch and val_check_interval=5 (steps of k batches, counted within each epoch): above k=4 an
    epoch has fewer than 5 steps and never validates (Lightning refuses that at set-up). The tuner climbs to 4, not
    further (before: 5-6, validating once in 8 epochs), and every epoch validates; asked by hand, k=5 is refused."""
    clock, sizes, validations = FakeClock(), _GroupSizes(), _Validations()
    tuner = ReplicaAutoTuner(window=2, warmup=0, threshold=0.0, clock=clock, plot=False, max_replicas=8)
    fit = trainer(
        strategy=CrossbowStrategy(replicas_per_device=1),
        callbacks=[clock, tuner, sizes, validations],
        max_epochs=8,
        val_check_interval=5,
    )
    fit.fit(Classifier(), loader(make_data(num_samples=160)), loader(make_data(num_samples=16)))
    assert max(sizes.sizes) == 4 and fit.strategy.replicas_keeping_validation() == 4
    assert set(validations.epochs) == set(range(8))

    class AskForFive(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            trainer.strategy.set_replicas_per_device(5)

    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=1), callbacks=[AskForFive()], val_check_interval=5)
    with pytest.raises(ValueError, match=r"fewer steps than val_check_interval=5 .*Use at most replicas_per_device=4"):
        fit.fit(Classifier(), loader(make_data(num_samples=160)), loader(make_data(num_samples=16)))
    # with validation off (limit_val_batches=0, where Lightning does not check val_check_interval), no bound
    fit = trainer(
        strategy=CrossbowStrategy(replicas_per_device=1), callbacks=[AskForFive()], val_check_interval=5,
        limit_val_batches=0, max_steps=3,
    )  # fmt: skip
    fit.fit(Classifier(), loader(make_data(num_samples=160)), loader(make_data(num_samples=16)))
    assert fit.strategy.replicas_keeping_validation() is None and fit.strategy.replicas_per_device == 5


def test_a_fast_dev_run_leaves_k_and_writes_no_plot(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's dry run turns its tuner, checkpoints and loggers off; so does the replica tuner: k stays where
    training starts and no plot is written (40 steps whose clock makes more replicas pay off raise k otherwise)."""
    monkeypatch.chdir(tmp_path)
    ks = {}
    for dry in (False, True):
        clock = FakeClock()
        tuner = ReplicaAutoTuner(window=4, warmup=1, threshold=0.1, clock=clock)
        strategy = CrossbowStrategy(replicas_per_device=1)
        fit = trainer(
            strategy=strategy,
            callbacks=[clock, tuner],
            max_epochs=-1,
            default_root_dir=tmp_path / str(dry),
            **({"fast_dev_run": 40} if dry else {"max_steps": 40}),
        )
        fit.fit(Classifier(), loader(make_data(num_samples=800)))
        ks[dry] = (strategy.replicas_per_device, len(tuner.history), sorted(p.name for p in tmp_path.rglob("*.png")))
    assert ks[False][0] > 1 and ks[False][1] > 0 and ks[False][2] == ["replica_tuning.png"]
    assert ks[True] == (1, 0, ["replica_tuning.png"])  # (the first run's plot alone)


class _OnlyTwoReplicasFit(Classifier):
    """Runs out of memory (simulated on the CPU) with more than two replicas."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.strategy.stack.num_replicas > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return super().training_step(batch, batch_idx)


def test_the_tuner_goes_on_measuring_after_a_back_off_undoes_its_climb(tmp_path) -> None:
    """Its climb asks for k=3, which runs out of memory: the strategy backs off to 2. The tuner goes on measuring
    windows at 2, where k=3 no longer fits (it waited for its change from 2 for good: two windows in 100 steps)."""
    clock = FakeClock()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "crossbow: out of memory")
        tuner, fit = tuned_fit(tmp_path, max_steps=100, clock=clock, model=_OnlyTwoReplicasFit(), recheck_every=2)
    assert fit.strategy.replica_ceiling == 2
    assert [record.replicas_per_device for record in tuner.history[:2]] == [1, 2]
    assert len(tuner.history) >= 6
    assert {record.replicas_per_device for record in tuner.history[2:]} == {2}
