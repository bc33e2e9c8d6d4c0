"""Heterogeneous devices: two CPU processes, one throttled to half speed, uniform against heterogeneous mode.

Rank 1 stands for a device of half the speed: in every step, once its forward and backward are done,
it sleeps as long as they took (``Throttle``), so the same work takes it twice as long; while it
sleeps its core is idle, as a slower device's would be to the other one. Each process runs 1 torch
thread on its own core of this 2-core machine.

1. Samples/s on the MNIST-1D CNN, b=16: uniform mode (k per device), heterogeneous mode (K = 2k split
   by measured speed), and each process alone (one process with the k heterogeneous mode gave it, rank
   1's alone with the throttle), one at a time and side by side (both at once, unsynchronised: the
   machine as busy as in the two-process runs). Goal: heterogeneous >= 0.9 x the sum of the two alone.
   Runs alternate, each ratio is taken within one repetition, and the median over repetitions is reported.
   For scale, the same without any throttle: two equal processes (uniform) against twice one alone,
   which is what synchronising every step costs on this machine whatever the balance.
2. Time to 90% MNIST-1D test accuracy, uniform against heterogeneous mode, both with rank 1 throttled
   (median of seeds; evaluation not counted).

Every measurement is its own launch (``--phase``), so "alone" really is one process.

    python benchmarks/heterogeneous.py            # k=6 per device; 3 repetitions, 3 seeds
    python benchmarks/heterogeneous.py --quick    # 1 repetition, 1 seed
    python benchmarks/heterogeneous.py --replicas 48 --averaging-period 4   # local SGD: every 4th step averages
    python benchmarks/heterogeneous.py --max-batch-scale 2   # the fast rank's learners may take up to 2b samples
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.accuracy import WORKLOADS, _median, train_to_target  # noqa: E402
from benchmarks.throughput import StepTimer, bare_trainer, results_dir, save_result  # noqa: E402
from examples.models import Classifier, conv1d_net  # noqa: E402
from lightning_crossbow import CrossbowStrategy, SpeedBalancer  # noqa: E402
from lightning_crossbow.balancing import StepTime  # noqa: E402

SLOW_RANK, SLOWDOWN = 1, 2.0
BATCH = int(os.environ.get("CROSSBOW_BENCH_BATCH", 16))  # per-replica batch (set by --batch-size)
QUICK = False  # --quick, passed on to every phase
REPLICAS = 6  # --replicas, passed on to every phase
PERIOD = 1  # --averaging-period, passed on to every phase
MAX_BATCH_SCALE = 1.0  # --max-batch-scale, passed on to every phase
LR_FOLLOWS_BATCH = False  # --lr-follows-batch, passed on to every phase


class Throttle(L.Callback):
    """Makes this process a device ``slowdown`` times slower: after forward and backward (the strategy's
    ``backward``, wrapped), it sleeps ``slowdown - 1`` times as long as they took. (Not from a hook that runs
    between backward and the optimizer step: one there tells crossbow that a callback reads gradients, and it
    then forms their mean over the replicas on the throttled process alone, which slowed it further.)"""

    def __init__(self, slowdown: float) -> None:
        self.slowdown = slowdown
        self._started = 0.0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        strategy, backward = trainer.strategy, trainer.strategy.backward

        def throttled_backward(*args: Any, **kwargs: Any) -> Any:
            result = backward(*args, **kwargs)
            time.sleep((self.slowdown - 1.0) * (time.perf_counter() - self._started))
            return result

        strategy.backward = throttled_backward  # type: ignore[method-assign]

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        vars(trainer.strategy).pop("backward", None)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._started = time.perf_counter()


class SplitRecorder(L.Callback):
    """The learners per rank and their batch sizes at the end of training, the samples of the steps from ``warmup``
    on over all ranks, the balancer's layouts over time and its fitted models."""

    split: Optional[tuple[int, ...]] = None
    batch_sizes: Optional[tuple[int, ...]] = None
    history: Optional[list] = None
    models_ms: Optional[list] = None

    def __init__(self, warmup: int = 0) -> None:
        self.warmup = warmup
        self.timed_samples = 0.0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step > self.warmup:  # (the steps StepTimer times: each step's own layout)
            self.timed_samples += trainer.strategy.samples_per_step * trainer.world_size

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        balancer = getattr(strategy, "balancer", None)
        if balancer is not None:
            (self.split, self.batch_sizes), self.history = strategy.layout, balancer.history
            self.models_ms = [(1e3 * m.fixed, 1e3 * m.per_learner) for m in balancer.step_times() or ()]


def balance_bound(split: list[int], batch_sizes: list[int], models_ms: list[tuple[float, float]]) -> float:
    """What the layout allows by its balance alone, were synchronising free: samples/s of a synchronous step of the
    slowest rank's busy time over the sum of each rank's alone at its k and batch, by the balancer's fitted models
    ``T_r(u) = fixed_r + per_learner_r u`` (``u = k b_r / b``): ``(sum_r n_r / max_r T_r) / sum_r (n_r / T_r)`` with
    ``n_r = k_r b_r`` samples a step."""
    samples = [k * b for k, b in zip(split, batch_sizes, strict=True)]
    times = [StepTime(*model)(n / BATCH) for n, model in zip(samples, models_ms, strict=True)]
    return (sum(samples) / max(times)) / sum(n / t for n, t in zip(samples, times))


def _strategy(mode: str, k: int) -> CrossbowStrategy:
    balancer = (
        SpeedBalancer(max_batch_scale=MAX_BATCH_SCALE, lr_follows_batch=LR_FOLLOWS_BATCH)
        if mode == "heterogeneous"
        else False
    )
    return CrossbowStrategy(k, heterogeneous=balancer, averaging_period=PERIOD)


def _throttled(rank: int) -> list[L.Callback]:
    slowdown = float(os.environ.get("CROSSBOW_BENCH_SLOWDOWN", SLOWDOWN))  # (1 for a check without throttling)
    return [Throttle(slowdown)] if rank == SLOW_RANK and slowdown != 1.0 else []


def throughput_phase(
    mode: str, k: int, devices: int, rank_alone: int, steps: int, warmup: int, batch: int = BATCH
) -> dict[str, Any]:
    """samples/s over all processes of ``steps`` steps after ``warmup`` (which covers the balancer's first windows);
    ``batch``: the DataLoader's batch size (a rank alone at the larger batch heterogeneous mode gave it)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    n = (warmup + steps + 1) * k * devices * batch * int(MAX_BATCH_SCALE + 1)
    data = TensorDataset(torch.randn(n, 40), torch.randint(0, 10, (n,)))
    timer, splits = StepTimer(warmup), SplitRecorder(warmup)
    trainer = bare_trainer(_strategy(mode, k), devices=devices, callbacks=[timer, splits], max_steps=warmup + steps)
    rank = rank_alone if devices == 1 else int(os.environ.get("LOCAL_RANK", 0))
    trainer.callbacks.extend(_throttled(rank))
    trainer.fit(Classifier(conv1d_net(40, 10), lr=0.01), DataLoader(data, batch_size=batch))
    assert splits.timed_samples > 0 and timer.end is not None and timer.start is not None
    return {
        "samples_per_sec": splits.timed_samples / (timer.end - timer.start),
        "split": splits.split,
        "batch_sizes": splits.batch_sizes,
        "splits": splits.history,
        "step_models_ms": splits.models_ms,
    }


def accuracy_phase(mode: str, k: int, seed: int, max_epochs: int) -> dict[str, Any]:
    """Epochs and training seconds to 90% MNIST-1D test accuracy on 2 processes, rank 1 throttled."""
    torch.set_num_threads(1)
    splits = SplitRecorder()
    config = {
        "strategy": lambda: _strategy(mode, k),
        "devices": 2,
        "callbacks": lambda: [splits, *_throttled(int(os.environ.get("LOCAL_RANK", 0)))],
        "batch": 1,
        "lr": 1.0,
    }
    result = train_to_target(WORKLOADS["mnist1d"], config, seed, max_epochs, b=BATCH)
    return {**result, "split": splits.split, "splits": splits.history}


def _start(out: Path, *phase: str, throttle: bool = True) -> subprocess.Popen:
    command = [sys.executable, __file__, "--phase", *phase, "--result", str(out), "--replicas", str(REPLICAS)]
    command += ["--averaging-period", str(PERIOD), "--max-batch-scale", str(MAX_BATCH_SCALE)]
    command += ["--lr-follows-batch"] if LR_FOLLOWS_BATCH else []
    command += ["--quick"] if QUICK else []
    env = {key: value for key, value in os.environ.items() if key not in ("LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["CROSSBOW_BENCH_BATCH"] = str(BATCH)
    if not throttle:
        env["CROSSBOW_BENCH_SLOWDOWN"] = "1"
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _launch(out: Path, *phase: str, throttle: bool = True) -> dict[str, Any]:
    """Runs one phase in a fresh launch (Lightning starts the second process itself) and returns rank 0's result."""
    if _start(out, *phase, throttle=throttle).wait() != 0:
        raise RuntimeError(f"benchmark phase {phase} failed")
    return json.loads(out.read_text())


def _alone_side_by_side(scratch: Path, split: list[int], batch_sizes: list[int]) -> list[float]:
    """Each rank's configuration as its own one-process run, both at once and not synchronised: the machine as
    busy as in the two-process runs, without the wait for each other. Returns each one's samples/s."""
    outs = [scratch / f"side_by_side_{rank}.json" for rank in range(2)]
    started = [
        _start(out, "throughput", "uniform", "1", str(rank), str(split[rank]), str(batch_sizes[rank]))
        for rank, out in enumerate(outs)
    ]
    if any(process.wait() != 0 for process in started):
        raise RuntimeError("a side-by-side benchmark phase failed")
    return [json.loads(out.read_text())["samples_per_sec"] for out in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--replicas", type=int, default=6, help="k per device (K = 2k learners in all)")
    parser.add_argument("--batch-size", type=int, default=16, help="per-replica batch size")
    parser.add_argument("--averaging-period", type=int, default=1, help="optimizer steps between two averagings")
    parser.add_argument("--max-batch-scale", type=float, default=1.0, help="SpeedBalancer's, heterogeneous mode's")
    parser.add_argument("--lr-follows-batch", action="store_true", help="SpeedBalancer's: lr x b_r / b")
    parser.add_argument("--throughput-only", action="store_true", help="skip the time-to-accuracy runs")
    parser.add_argument("--repeats", type=int, help="throughput repetitions (default 3; 1 with --quick)")
    parser.add_argument("--phase", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help="default: benchmarks/out/heterogeneous.json (out/quick/ with --quick)")
    args = parser.parse_args()
    global BATCH, QUICK, REPLICAS, PERIOD, MAX_BATCH_SCALE, LR_FOLLOWS_BATCH
    BATCH = args.batch_size if not args.phase else BATCH
    QUICK, REPLICAS, PERIOD, MAX_BATCH_SCALE = args.quick, args.replicas, args.averaging_period, args.max_batch_scale
    LR_FOLLOWS_BATCH = args.lr_follows_batch
    k = args.replicas
    steps, warmup = (60, 80) if args.quick else (150, 80)  # the warm-up covers the balancer settling (3-4 windows)
    if args.phase:  # inside one launch
        kind, mode, *rest = args.phase
        if kind == "throughput":
            devices, rank_alone, split_k = int(rest[0]), int(rest[1]), int(rest[2])
            batch = int(rest[3]) if len(rest) > 3 else BATCH
            result = throughput_phase(mode, split_k if devices == 1 else k, devices, rank_alone, steps, warmup, batch)
        else:
            result = accuracy_phase(mode, k, seed=int(rest[0]), max_epochs=15 if args.quick else 40)
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            args.result.write_text(json.dumps(result))
        return

    repeats, seeds = (1, [0]) if args.quick else (3, [0, 1, 2])
    repeats = args.repeats or repeats
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "result.json"
        for repeat in range(repeats):
            heterogeneous = _launch(out, "throughput", "heterogeneous", "2", "0", "0")
            split, batch_sizes = heterogeneous["split"], heterogeneous["batch_sizes"]
            run = {
                "heterogeneous": heterogeneous,
                "uniform": _launch(out, "throughput", "uniform", "2", "0", "0"),
                "alone": [
                    _launch(out, "throughput", "uniform", "1", str(rank), str(split[rank]), str(batch_sizes[rank]))[
                        "samples_per_sec"
                    ]
                    for rank in range(2)
                ],
            }
            run["alone_side_by_side"] = _alone_side_by_side(Path(scratch), split, batch_sizes)
            run["heterogeneous_over_sum_alone"] = heterogeneous["samples_per_sec"] / sum(run["alone"])
            run["heterogeneous_over_sum_side_by_side"] = heterogeneous["samples_per_sec"] / sum(
                run["alone_side_by_side"]
            )
            run["heterogeneous_over_uniform"] = heterogeneous["samples_per_sec"] / run["uniform"]["samples_per_sec"]
            if heterogeneous["step_models_ms"]:
                run["balance_bound"] = balance_bound(split, batch_sizes, heterogeneous["step_models_ms"])
            equal_pair = _launch(out, "throughput", "uniform", "2", "0", "0", throttle=False)["samples_per_sec"]
            equal_alone = _launch(out, "throughput", "uniform", "1", "0", str(k), throttle=False)["samples_per_sec"]
            run["unthrottled"] = {"two_processes": equal_pair, "one_alone": equal_alone}
            run["unthrottled_two_over_twice_alone"] = equal_pair / (2 * equal_alone)
            runs.append(run)
            print(
                f"repeat {repeat}: split {split}, batch sizes {batch_sizes},"
                f" samples/s heterogeneous {heterogeneous['samples_per_sec']:.0f},"
                f" uniform {run['uniform']['samples_per_sec']:.0f}, alone {run['alone'][0]:.0f} + {run['alone'][1]:.0f};"
                f" heterogeneous / sum alone {run['heterogeneous_over_sum_alone']:.2f}, / sum side by side"
                f" {run['heterogeneous_over_sum_side_by_side']:.2f},"
                f" / uniform {run['heterogeneous_over_uniform']:.2f}; unthrottled, 2 processes / twice one alone"
                f" {run['unthrottled_two_over_twice_alone']:.2f}; the split's balance alone allows"
                f" {run.get('balance_bound', float('nan')):.2f} of the sum alone",
                flush=True,
            )
        accuracy: dict[str, Any] = {}
        for mode in () if args.throughput_only else ("uniform", "heterogeneous"):
            results = [_launch(out, "accuracy", mode, str(seed)) for seed in seeds]
            accuracy[mode] = {
                "runs": results,
                "median_epochs": _median([r["epochs_to_target"] for r in results]),
                "median_seconds": _median([r["seconds_to_target"] for r in results]),
                "reached": sum(r["epochs_to_target"] is not None for r in results),
            }
            print(
                f"to 90% MNIST-1D, {mode}: epochs {accuracy[mode]['median_epochs']},"
                f" seconds {accuracy[mode]['median_seconds']}, reached {accuracy[mode]['reached']}/{len(seeds)}",
                flush=True,
            )
    command = "python benchmarks/heterogeneous.py" + (" --quick" if args.quick else "")
    if args.batch_size != 16:
        command += f" --batch-size {args.batch_size}"
    if args.replicas != 6:
        command += f" --replicas {args.replicas}"
    if args.averaging_period != 1:
        command += f" --averaging-period {args.averaging_period}"
    if args.max_batch_scale != 1:
        command += f" --max-batch-scale {args.max_batch_scale:g}"
    if args.lr_follows_batch:
        command += " --lr-follows-batch"
    if args.throughput_only:
        command += " --throughput-only"
    if args.repeats:
        command += f" --repeats {args.repeats}"
    save_result(
        args.out or results_dir(args.quick) / "heterogeneous.json",
        command,
        replicas_per_device=k,
        averaging_period=PERIOD,
        max_batch_scale=MAX_BATCH_SCALE,
        lr_follows_batch=LR_FOLLOWS_BATCH,
        batch_size=BATCH,
        slowdown=SLOWDOWN,
        timed_steps=steps,
        warmup_steps=warmup,
        runs=runs,
        median_heterogeneous_over_sum_alone=statistics.median(r["heterogeneous_over_sum_alone"] for r in runs),
        median_heterogeneous_over_sum_side_by_side=statistics.median(
            r["heterogeneous_over_sum_side_by_side"] for r in runs
        ),
        median_heterogeneous_over_uniform=statistics.median(r["heterogeneous_over_uniform"] for r in runs),
        median_unthrottled_two_over_twice_alone=statistics.median(r["unthrottled_two_over_twice_alone"] for r in runs),
        median_samples_per_sec={
            "heterogeneous": statistics.median(r["heterogeneous"]["samples_per_sec"] for r in runs),
            "uniform": statistics.median(r["uniform"]["samples_per_sec"] for r in runs),
            "alone_fast": statistics.median(r["alone"][0] for r in runs),
            "alone_slow": statistics.median(r["alone"][1] for r in runs),
            "side_by_side_fast": statistics.median(r["alone_side_by_side"][0] for r in runs),
            "side_by_side_slow": statistics.median(r["alone_side_by_side"][1] for r in runs),
        },
        accuracy=accuracy,
    )


if __name__ == "__main__":
    main()
