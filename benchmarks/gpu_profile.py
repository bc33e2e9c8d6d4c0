"""Where a training step's time goes on one CUDA GPU: host synchronisations, kernel launches, time per step.

For each configuration, inside Lightning on random data: ``--warmup`` untimed steps; 3 steps under
``torch.cuda.set_sync_debug_mode("warn")``, whose synchronising calls are printed with the Python stack that made
them (deduplicated); ``--profiled`` steps under ``torch.profiler`` (CPU and CUDA activities: kernel launches and
synchronisations per step, the device's busy time, the top operators by host time, written to ``--out``); then
``--timed`` steps timed with one ``synchronize`` at their start and one at their end.

    python benchmarks/gpu_profile.py                      # every configuration below
    python benchmarks/gpu_profile.py "fused k8" "plain b128"   # those whose name contains one of these
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.throughput import Classifier, bare_trainer  # noqa: E402
from examples.models import conv1d_net, resnet20  # noqa: E402
from lightning_crossbow import CrossbowStrategy  # noqa: E402

SYNC_STEPS = 3
#: name -> (strategy factory, replicas, per-replica batch, network, input shape of one sample)
CONFIGURATIONS: dict[str, tuple[Callable[[], Any], int, int, Callable[[], torch.nn.Module], tuple[int, ...]]] = {
    "plain b128 cnn": (lambda: "auto", 1, 128, conv1d_net, (40,)),
    "fused k8 b16 cnn": (lambda: CrossbowStrategy(8, engine="fused"), 8, 16, conv1d_net, (40,)),
    "k1 b16 cnn": (lambda: CrossbowStrategy(1), 1, 16, conv1d_net, (40,)),
    "plain b16 cnn": (lambda: "auto", 1, 16, conv1d_net, (40,)),
    "plain b1024 resnet20": (lambda: "auto", 1, 1024, resnet20, (3, 32, 32)),
    "fused k16 b64 resnet20": (lambda: CrossbowStrategy(16, engine="fused"), 16, 64, resnet20, (3, 32, 32)),
}
#: Profiler events counted per step.
COUNTED = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync", "cudaStreamSynchronize", "aten::item")


class StepProbe(L.Callback):
    """Records the synchronising calls' stacks, then profiles, then times, at the step indices given."""

    def __init__(self, warmup: int, profiled: int, timed: int) -> None:
        self.sync_at, self.profile_at = warmup, warmup + SYNC_STEPS
        self.time_at, self.last = self.profile_at + profiled, self.profile_at + profiled + timed - 1
        self.stacks: collections.Counter[str] = collections.Counter()
        self.profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        )
        self.start = self.end = 0.0
        self._shown: Any = None

    def _record_stack(self, message: Any, *args: Any, **kwargs: Any) -> None:
        frames = [frame for frame in traceback.format_stack()[:-1] if "warnings.py" not in frame]
        self.stacks["".join(frames[-6:])] += 1

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, index: int) -> None:
        if index == self.sync_at:
            self._shown, warnings.showwarning = warnings.showwarning, self._record_stack
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        elif index == self.profile_at:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = self._shown
            torch.cuda.synchronize()
            self.profiler.start()
        elif index == self.time_at:
            torch.cuda.synchronize()
            self.profiler.stop()
            torch.cuda.synchronize()
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if args[-1] == self.last:
            torch.cuda.synchronize()
            self.end = time.perf_counter()


def probe(name: str, warmup: int, profiled: int, timed: int, out: Path) -> None:
    """Runs one configuration and prints what :class:`StepProbe` found."""
    strategy, k, b, net, shape = CONFIGURATIONS[name]
    torch.manual_seed(0)
    n = (warmup + SYNC_STEPS + profiled + timed) * k * b
    data = TensorDataset(torch.randn(n, *shape), torch.randint(0, 10, (n,)))
    spy = StepProbe(warmup, profiled, timed)
    bare_trainer(strategy(), accelerator="cuda", callbacks=[spy]).fit(
        Classifier(net(), lr=0.01), DataLoader(data, batch_size=b)
    )
    events = spy.profiler.key_averages()
    counts = {e.key: e.count / profiled for e in events if e.key in COUNTED}
    device_us = sum(  # (kernels and copies; not the user annotations that span them, as the profiler's table counts)
        e.self_device_time_total
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation
    )
    ms = (spy.end - spy.start) / timed * 1e3
    print(
        f"\n===== {name}: {ms:.2f} ms a step ({k * b / ms * 1e3:.0f} samples/s); device busy (profiled)"
        f" {device_us / profiled / 1e3:.2f} ms a step; per step: "
        + ", ".join(f"{key} {v:.1f}" for key, v in counts.items())
    )
    print(f"synchronising calls over {SYNC_STEPS} steps: {sum(spy.stacks.values())}")
    for stack, count in spy.stacks.most_common(8):
        print(f"[{count}x]\n{stack}")
    out.mkdir(parents=True, exist_ok=True)
    table = events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
    (out / f"profile_{name.replace(' ', '_')}.txt").write_text(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="parts of configuration names (default: all)")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--profiled", type=int, default=40)
    parser.add_argument("--timed", type=int, default=150)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("out") / "gpu_profile")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_profile.py profiles a CUDA GPU and found none.")
    for name in CONFIGURATIONS:
        if not args.names or any(part in name for part in args.names):
            probe(name, args.warmup, args.profiled, args.timed, args.out)


if __name__ == "__main__":
    main()
