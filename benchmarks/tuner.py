"""ReplicaAutoTuner against fixed k: the throughput the tuner settles on, next to the best fixed k's.

One process, the MNIST-1D paper's CNN on MNIST-1D-shaped data, per-replica batch 16. Each repetition
runs crossbow with every fixed k, then a tuned run from k=1 (objective "throughput"), whose
samples/s is measured over the steps after the tuner has chosen. Repetitions alternate.

    python benchmarks/tuner.py            # k = 1..8, 3 repetitions
    python benchmarks/tuner.py --quick    # k = 1, 2, 4, 8, 1 repetition
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.throughput import bare_trainer, results_dir, samples_per_second, save_result  # noqa: E402
from examples.models import Classifier, conv1d_net  # noqa: E402
from lightning_crossbow import CrossbowStrategy, ReplicaAutoTuner  # noqa: E402


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
    batch_size: int, max_replicas: int, steps_after: int, window: int
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

    trainer = bare_trainer(CrossbowStrategy(1), callbacks=[tuner, after, StopAfter()])
    trainer.fit(Classifier(conv1d_net(40, 10), lr=0.01), DataLoader(data, batch_size=batch_size))
    rate = after.samples / after.seconds if after.seconds > 0 else float("nan")
    return rate, tuner.chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--window", type=int, default=20, help="the tuner's window (steps per measurement)")
    args = parser.parse_args()
    ks, repeats, steps = ([1, 2, 4, 8], 1, 30) if args.quick else (list(range(1, 9)), 3, 60)
    b = 16
    fixed: dict[int, list[float]] = {k: [] for k in ks}
    tuned: list[float] = []
    chosen: list[Optional[int]] = []
    for _ in range(repeats):
        for k in ks:
            fixed[k].append(samples_per_second(CrossbowStrategy(k, engine="fused"), k, b, steps, 5))
        rate, k_chosen = tuned_samples_per_second(b, max(ks), steps, args.window)
        tuned.append(rate)
        chosen.append(k_chosen)
    best_k = max(ks, key=lambda k: statistics.median(fixed[k]))
    ratio = statistics.median(t / max(fixed[k][i] for k in ks) for i, t in enumerate(tuned))
    save_result(
        results_dir(args.quick) / "tuner.json",
        "python benchmarks/tuner.py" + (" --quick" if args.quick else "") + f" --window {args.window}",
        fixed={str(k): v for k, v in fixed.items()},
        tuned=tuned,
        chosen=chosen,
        best_fixed_k=best_k,
        tuned_over_best_fixed=ratio,
    )
    for k in ks:
        print(f"fixed k={k}: {statistics.median(fixed[k]):.0f} samples/s")
    print(f"tuned: {statistics.median(tuned):.0f} samples/s, chose k = {chosen}; best fixed k = {best_k};"
          f" tuned / best fixed (median of per-repetition ratios) = {ratio:.2f}")


if __name__ == "__main__":
    main()
