"""ReplicaAutoTuner against fixed k: the throughput the tuner settles on, next to the best fixed k's.

One process, the MNIST-1D paper's CNN on MNIST-1D-shaped data, per-replica batch 16. Each repetition
runs crossbow with every fixed k, then a tuned run from k=1 (objective "throughput"), whose
samples/s is measured over the steps after the tuner has chosen. Repetitions alternate.

It then replays the throughput search on the measured curve (the median samples/s of each fixed k), with
Gaussian noise of the spread measured between repetitions (and twice that) on every window, 1,000 times
per climb, with and without the look ahead: how often the search holds a k within 10% of the best.

    python benchmarks/tuner.py            # k = 1..8, 3 repetitions
    python benchmarks/tuner.py --quick    # k = 1..4, 1 repetition
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.throughput import bare_trainer, results_dir, samples_per_second, save_result  # noqa: E402
from examples.models import Classifier, conv1d_net  # noqa: E402
from lightning_crossbow import CrossbowStrategy, ReplicaAutoTuner  # noqa: E402
from lightning_crossbow.tuner import TuningRecord  # noqa: E402


class AfterChoice(L.Callback):
    """Samples/s over the steps run at the tuner's chosen k: each interval from one such step's end to the
    next's (the windows in which the tuner explores again, ``recheck_every``, are left out)."""

    def __init__(self, tuner: ReplicaAutoTuner) -> None:
        self.tuner = tuner
        self.start: Optional[float] = None  # the first step end at the chosen k
        self.last: Optional[float] = None
        self.samples = 0
        self.seconds = 0.0

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.tuner.chosen is None or trainer.strategy.replicas_per_device != self.tuner.chosen:
            self.last = None
            return
        now = time.perf_counter()
        if self.start is None:
            self.start = now
        if self.last is not None:
            self.samples += trainer.strategy.samples_per_step
            self.seconds += now - self.last
        self.last = now


def tuned_samples_per_second(
    batch_size: int, max_replicas: int, steps_after: int, window: int, accelerator: str = "cpu"
) -> tuple[float, Optional[int]]:
    torch.manual_seed(0)
    n = 4000 * batch_size  # more than the tuner and the measurement need: the run stops by max_steps
    data = TensorDataset(torch.randn(n, 40), torch.randint(0, 10, (n,)))
    tuner = ReplicaAutoTuner(objective="throughput", max_replicas=max_replicas, window=window, plot=False)
    after = AfterChoice(tuner)
    steps = 0

    class StopAfter(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            nonlocal steps
            steps += 1
            if after.start is not None and after.samples >= steps_after * trainer.strategy.samples_per_step:
                trainer.should_stop = True

    trainer = bare_trainer(CrossbowStrategy(1), accelerator=accelerator, callbacks=[tuner, after, StopAfter()])
    trainer.fit(Classifier(conv1d_net(40, 10), lr=0.01), DataLoader(data, batch_size=batch_size))
    rate = after.samples / after.seconds if after.seconds > 0 else float("nan")
    return rate, tuner.chosen


def replayed_searches(
    curve: dict[int, float], noise: float, climb: str, look_ahead: bool, trials: int = 1000
) -> dict[str, float]:
    """The tuner's throughput search (its own ``_decide``) on ``curve``, each window's rate drawn as
    ``curve[k] * (1 + noise * N(0, 1))``: the share of searches that hold within 10% of the best k's rate, the
    median of held rate / best rate, and the mean number of windows."""
    best, rng = max(curve.values()), random.Random(0)
    device = SimpleNamespace(replica_ceiling=None, stack=None, replicas_fitting_an_epoch=lambda: None)
    ratios, windows = [], []
    for _ in range(trials):
        tuner = ReplicaAutoTuner(climb=climb, look_ahead=look_ahead, max_replicas=max(curve), plot=False)
        k = min(curve)
        while tuner.chosen is None:
            tuner.history.append(TuningRecord(len(tuner.history), k, curve[k] * (1 + noise * rng.gauss(0, 1))))
            k = tuner._decide(k, device)
        ratios.append(curve[tuner.chosen] / best)
        windows.append(len(tuner.history))
    return {
        "within_10_percent": sum(r >= 0.9 for r in ratios) / trials,
        "median_ratio": statistics.median(ratios),
        "mean_windows": statistics.fmean(windows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--window", type=int, default=20, help="the tuner's window (steps per measurement)")
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", type=Path, help="default: benchmarks/out/tuner.json (out/quick/ with --quick)")
    args = parser.parse_args()
    # (every k up to the largest: the replayed searches take the curve at each k their climb visits)
    ks, repeats, steps = (list(range(1, 5)), 1, 30) if args.quick else (list(range(1, 9)), 3, 60)
    b = 16
    fixed: dict[int, list[float]] = {k: [] for k in ks}
    tuned: list[float] = []
    chosen: list[Optional[int]] = []
    for _ in range(repeats):
        for k in ks:
            fixed[k].append(
                samples_per_second(CrossbowStrategy(k, engine="fused"), k, b, steps, 5, accelerator=args.accelerator)
            )
        rate, k_chosen = tuned_samples_per_second(b, max(ks), steps, args.window, args.accelerator)
        tuned.append(rate)
        chosen.append(k_chosen)
    best_k = max(ks, key=lambda k: statistics.median(fixed[k]))
    curve = {k: statistics.median(fixed[k]) for k in ks}
    spread = statistics.median(statistics.pstdev(v) / statistics.fmean(v) for v in fixed.values())
    replayed = [
        {"noise": noise, "climb": climb, "look_ahead": look, **replayed_searches(curve, noise, climb, look)}
        for noise in (spread, 2 * spread)
        for climb in ("linear", "doubling")
        for look in (True, False)
    ]
    ratio = statistics.median(t / max(fixed[k][i] for k in ks) for i, t in enumerate(tuned))
    save_result(
        args.out or results_dir(args.quick) / "tuner.json",
        "python benchmarks/tuner.py"
        + (" --quick" if args.quick else "")
        + f" --window {args.window}"
        + (f" --accelerator {args.accelerator}" if args.accelerator != "cpu" else ""),
        fixed={str(k): v for k, v in fixed.items()},
        tuned=tuned,
        chosen=chosen,
        best_fixed_k=best_k,
        tuned_over_best_fixed=ratio,
        replayed_searches=replayed,
    )
    for k in ks:
        print(f"fixed k={k}: {statistics.median(fixed[k]):.0f} samples/s")
    print(
        f"tuned: {statistics.median(tuned):.0f} samples/s, chose k = {chosen}; best fixed k = {best_k};"
        f" tuned / best fixed (median of per-repetition ratios) = {ratio:.2f}"
    )
    for r in replayed:
        print(
            f"replayed search, noise {r['noise']:.3f}, {r['climb']}, look_ahead={r['look_ahead']}: within 10% of"
            f" the best in {r['within_10_percent']:.0%}, median {r['median_ratio']:.2f}, {r['mean_windows']:.1f} windows"
        )


if __name__ == "__main__":
    main()
