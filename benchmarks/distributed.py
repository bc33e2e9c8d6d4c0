"""Crossbow across processes against Lightning's DDPStrategy: samples/s, and what each step communicates.

Two CPU processes (gloo), launched by Lightning itself: crossbow with k replicas of per-replica batch b
per process against DDP with batch k*b per process, the same total batch per step. Configurations
alternate within one launch, so the ratio is measured side by side on this (shared, noisy) machine.

Per timed step it reports the collectives each process calls and the bytes they carry: every
``torch.distributed`` collective called from Python is counted (crossbow's SMA all-reduce, and anything
Lightning adds), and DDP's gradient buckets through a communication hook that makes DDP call it too. For crossbow it also
reports the wall time spent inside the collectives (gloo runs them synchronously).

    python benchmarks/distributed.py            # 2 processes x k=4, b=16; 3 repetitions
    python benchmarks/distributed.py --quick    # 1 repetition, fewer steps
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.throughput import StepTimer, bare_trainer, results_dir, save_result
from examples.models import Classifier, conv1d_net
from lightning_crossbow import CrossbowStrategy

WORLD_SIZE = 2
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
    "broadcast_object_list", "reduce_scatter_tensor", "barrier",
)


@dataclass
class CommCount:
    """Collectives called by this process while ``active``: calls, tensor bytes and seconds inside them."""

    active: bool = False
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def reset(self, active: bool) -> None:
        self.active, self.calls, self.bytes, self.seconds = active, 0, 0, 0.0

    def record(self, tensors: list[torch.Tensor], seconds: float) -> None:
        if self.active:
            self.calls += 1
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
            self.seconds += seconds


COUNT = CommCount()


def _counting(collective: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(collective)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        result = collective(*args, **kwargs)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        COUNT.record(tensors, time.perf_counter() - started)
        return result

    return wrapper


for _name in COLLECTIVES:
    setattr(dist, _name, _counting(getattr(dist, _name)))


def counting_allreduce_hook(process_group, bucket):  # type: ignore[no-untyped-def]
    """DDP's own all-reduce of a gradient bucket, made through the Python API so that it is counted.

    ``allreduce_hook`` calls ``torch.distributed.all_reduce(..., async_op=True)``, which is counted above;
    its time overlaps the backward, so it is not reported as time in communication. Unannotated: DDP checks the annotations' objects, which ``from __future__ import annotations`` turns
    into strings.
    """
    return default_hooks.allreduce_hook(process_group, bucket)


class CountTimedSteps(L.Callback):
    """Counts the collectives of the steps that ``StepTimer`` times (after ``warmup``).

    Lightning registers DDP communication hooks on CUDA only, so the counting hook is registered here.
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = trainer.strategy.model
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model.register_comm_hook(None, counting_allreduce_hook)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.warmup:
            COUNT.reset(active=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        COUNT.active = False


def run(strategy: Any, k: int, batch_size: int, steps: int, warmup: int) -> dict[str, float]:
    """Trains ``warmup + steps`` steps on every process; returns samples/s over all processes and comm per step."""
    torch.manual_seed(0)
    n = (warmup + steps) * k * batch_size * WORLD_SIZE
    data = TensorDataset(torch.randn(n, 40), torch.randint(0, 10, (n,)))
    timer = StepTimer(warmup)
    trainer = bare_trainer(strategy, devices=WORLD_SIZE, callbacks=[timer, CountTimedSteps(warmup)])
    trainer.fit(Classifier(conv1d_net(40, 10), lr=0.01), DataLoader(data, batch_size=batch_size))
    elapsed = timer.end - timer.start
    return {
        "samples_per_sec": timer.steps * k * batch_size * WORLD_SIZE / elapsed,
        "collectives_per_step": COUNT.calls / timer.steps,
        "bytes_per_step": COUNT.bytes / timer.steps,
        "comm_ms_per_step": 1e3 * COUNT.seconds / timer.steps,
        "step_ms": 1e3 * elapsed / timer.steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", type=Path, help="default: benchmarks/out/distributed.json (out/quick/ with --quick)")
    args = parser.parse_args()
    repeats, steps, warmup = (1, 30, 5) if args.quick else (3, 60, 10)
    k, b = args.replicas, args.batch_size
    configs: dict[str, tuple[Callable[[], Any], int, int]] = {
        f"crossbow k={k} b={b}": (lambda: CrossbowStrategy(k, engine="fused"), k, b),
        f"ddp b={k * b}": (lambda: DDPStrategy(), 1, k * b),
    }
    measured: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    for _ in range(repeats):
        for name, (strategy, replicas, batch) in configs.items():
            measured[name].append(run(strategy(), replicas, batch, steps, warmup))
    if dist.get_rank() != 0:
        return
    parameters = sum(p.numel() for p in conv1d_net(40, 10).parameters())
    crossbow, ddp = measured[f"crossbow k={k} b={b}"], measured[f"ddp b={k * b}"]
    ratio = statistics.median(c["samples_per_sec"] / d["samples_per_sec"] for c, d in zip(crossbow, ddp))
    print(f"\n{WORLD_SIZE} CPU processes (gloo), {torch.get_num_threads()} threads each, model {parameters} parameters"
          f" ({4 * parameters} bytes fp32); medians of {repeats} alternating runs of {steps} timed steps")
    print(f"  {'configuration':<22}{'samples/s':>10}{'step ms':>9}{'collectives/step':>18}{'bytes/step':>12}{'comm ms/step':>14}")
    summary = {}
    for name, runs in measured.items():
        median = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        summary[name] = median
        comm = f"{median['comm_ms_per_step']:.2f}" if name.startswith("crossbow") else "overlapped"
        print(f"  {name:<22}{median['samples_per_sec']:>10.0f}{median['step_ms']:>9.2f}"
              f"{median['collectives_per_step']:>18.2f}{median['bytes_per_step']:>12.0f}{comm:>14}")
    print(f"crossbow / ddp samples/s (median of paired runs): {ratio:.2f}")
    command = "python benchmarks/distributed.py" + (" --quick" if args.quick else "")
    save_result(
        args.out or results_dir(args.quick) / "distributed.json", command, repeats=repeats, timed_steps=steps, runs=measured, median=summary, crossbow_over_ddp=ratio
    )


if __name__ == "__main__":
    main()
