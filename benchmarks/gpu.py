"""Throughput and memory on one CUDA GPU: crossbow's engines against plain Lightning.

For every model, per-replica batch b and replicas k: samples/s of crossbow with the fused, streams and
sequential engines and with ``engine="auto"`` (which keeps the faster of fused and streams), and of
plain Lightning at batch b and at k*b; peak GPU memory of every run, and memory per replica (the slope
of the peak over k). Models: ResNet-20 on
CIFAR-shaped random data (3x32x32) and the MNIST-1D CNN on MNIST-1D-shaped data (40 values). Runs are
interleaved by repetition, and ratios are taken within a repetition.

    python benchmarks/gpu.py                  # k in 1,2,4,8,16 x b in 16,32,64, 3 repetitions: writes benchmarks/GPU.md
    python benchmarks/gpu.py --quick          # k in 1,4,16 x b in 16,64, 1 repetition (out/quick/)
    python benchmarks/gpu.py --device cpu --quick   # a smoke run of the script without a GPU (no streams)
"""

from __future__ import annotations

import argparse
import gc
import shlex
import statistics
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.throughput import machine, results_dir, samples_per_second, save_result  # noqa: E402
from examples.models import conv1d_net, resnet20  # noqa: E402
from lightning_crossbow import CrossbowStrategy  # noqa: E402

#: name -> (network, input shape of one sample)
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "resnet20 (3x32x32)": (resnet20, (3, 32, 32)),
    "mnist1d cnn (40)": (conv1d_net, (40,)),
}


class ChosenEngine(L.Callback):
    """Which engine ``engine="auto"`` kept (read before teardown drops the engine)."""

    chosen: str = ""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.chosen = getattr(getattr(trainer.strategy, "engine", None), "chosen", None) or ""


def measure(strategy: Any, k: int, b: int, model: str, steps: int, warmup: int, device: str) -> dict[str, Any]:
    """samples/s, peak memory (bytes, CUDA only) and, for ``engine="auto"``, the engine kept, of one run."""
    net, shape = MODELS[model]
    if device == "cuda":
        gc.collect()  # the last run's trainer and stacked replicas, so that the peak is this run's alone
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    spy = ChosenEngine()
    try:
        rate = samples_per_second(
            strategy, k, b, steps, warmup, net=net, input_shape=shape, accelerator=device, callbacks=(spy,)
        )
    except Exception:  # one failing configuration must not cost the rest of a GPU lease
        traceback.print_exc(limit=-6)
        return {"samples_per_sec": float("nan"), "peak_bytes": float("nan"), "chosen": "failed"}
    peak = float(torch.cuda.max_memory_allocated()) if device == "cuda" else float("nan")
    return {"samples_per_sec": rate, "peak_bytes": peak, "chosen": spy.chosen}


def configurations(k: int, b: int, engines: list[str]) -> dict[str, tuple[Callable[[], Any], int, int]]:
    """name -> (strategy factory, replicas, batch size) for one (k, b)."""
    configs: dict[str, tuple[Callable[[], Any], int, int]] = {
        f"crossbow {engine}": ((lambda engine=engine: CrossbowStrategy(k, engine=engine)), k, b) for engine in engines
    }
    configs["plain k*b"] = (lambda: "auto", 1, k * b)
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--repeats", type=int, help="repetitions (default 3, or 1 with --quick)")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--ks", type=int, nargs="+", help="replicas per device to measure (overrides the default)")
    parser.add_argument("--bs", type=int, nargs="+", help="per-replica batch sizes to measure (overrides the default)")
    parser.add_argument("--steps", type=int, help="timed steps per run (default 50, or 20 with --quick)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=20,
        help="untimed steps first (14 or more keep engine=auto's trial steps out of the timing)",
    )
    parser.add_argument("--out", type=Path, help="default: benchmarks/out/gpu.json (out/quick/ with --quick)")
    parser.add_argument("--markdown", type=Path, help="the table (default: benchmarks/GPU.md, full runs on CUDA only)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py measures a CUDA GPU and found none; --device cpu runs it as a smoke test.")
    # 20 warm-up steps: engine="auto" times fused against streams over its first 14 steps.
    ks, bs, repeats, steps = ([1, 4, 16], [16, 64], 1, 20) if args.quick else ([1, 2, 4, 8, 16], [16, 32, 64], 3, 50)
    repeats, ks, bs, steps, warmup = (
        args.repeats or repeats,
        args.ks or ks,
        args.bs or bs,
        args.steps or steps,
        args.warmup,
    )
    quick = args.quick or args.device == "cpu"
    command = shlex.join(["python", "benchmarks/gpu.py", *sys.argv[1:]])
    out = args.out or results_dir(quick) / "gpu.json"
    markdown = args.markdown or (None if quick else Path(__file__).with_name("GPU.md"))
    engines = ["fused", "streams", "sequential", "auto"] if args.device == "cuda" else ["fused", "sequential", "auto"]
    runs: dict[str, dict[str, dict[str, dict[str, list[float]]]]] = {}  # model -> "k,b" -> config -> metric -> values
    for model in args.models:
        runs[model] = {}
        for b in bs:
            plain_b: dict[str, list[Any]] = {"samples_per_sec": [], "peak_bytes": [], "chosen": []}
            for k in ks:
                runs[model][f"{k},{b}"] = {
                    name: {"samples_per_sec": [], "peak_bytes": [], "chosen": []}
                    for name in configurations(k, b, engines)
                }
            for _ in range(repeats):
                for key, value in measure("auto", 1, b, model, steps, warmup, args.device).items():
                    plain_b[key].append(value)
                for k in ks:
                    for name, (strategy, replicas, batch) in configurations(k, b, engines).items():
                        result = measure(strategy(), replicas, batch, model, steps, warmup, args.device)
                        for key, value in result.items():
                            runs[model][f"{k},{b}"][name][key].append(value)
                        chosen = f" (kept {result['chosen']})" if result["chosen"] else ""
                        print(
                            f"{model} k={k} b={b} {name}: {result['samples_per_sec']:.0f} samples/s{chosen}", flush=True
                        )
            for k in ks:
                runs[model][f"{k},{b}"]["plain b"] = plain_b
            # Written after every (model, b): a run cut short (a lease running out) keeps what it measured.
            save_result(out, command, repeats=repeats, timed_steps=steps, warmup_steps=warmup, runs=runs)
            table = summarize(runs, ks, bs, engines)
            if markdown is not None:
                header = (
                    f"# Crossbow on one CUDA GPU: {machine()['cuda']}\n\n"
                    f"`{command}`; median of {repeats} interleaved runs of {steps} timed steps"
                    f" after {warmup} untimed ones.\n"
                )
                markdown.parent.mkdir(parents=True, exist_ok=True)
                markdown.write_text(header + table + "\n")
    print(table)


def summarize(runs: dict[str, Any], ks: list[int], bs: list[int], engines: list[str]) -> str:
    """A Markdown table per model: samples/s per (k, b) and configuration, and memory per replica."""
    median = lambda values: statistics.median(values) if values else float("nan")  # noqa: E731
    names = [f"crossbow {engine}" for engine in engines] + ["plain b", "plain k*b"]
    lines: list[str] = []
    for model, per_kb in runs.items():
        lines += [
            f"\n## {model}: samples/s (median)\n",
            "| k | b | " + " | ".join(names) + " | best crossbow / plain k*b | auto kept |",
        ]
        lines.append("|" + "---|" * (len(names) + 4))
        for b in [b for b in bs if f"{ks[0]},{b}" in per_kb and "plain b" in per_kb[f"{ks[0]},{b}"]]:
            for k in ks:
                row = per_kb[f"{k},{b}"]
                rates = {name: median(row[name]["samples_per_sec"]) for name in names}
                best = max(rates[f"crossbow {engine}"] for engine in engines)
                cells = " | ".join(f"{rates[name]:.0f}" for name in names)
                kept = ", ".join(sorted(set(row.get("crossbow auto", {}).get("chosen", [])))) or "-"
                lines.append(f"| {k} | {b} | {cells} | {best / rates['plain k*b']:.2f} | {kept} |")
        if len(ks) < 2:  # (one k: no slope to give)
            continue
        lines += [f"\n## {model}: GPU memory per replica (MiB; slope of the peak from k={ks[0]} to k={ks[-1]})\n"]
        lines += [
            "| b | " + " | ".join(f"crossbow {engine}" for engine in engines) + " |",
            "|" + "---|" * (len(engines) + 1),
        ]
        for b in [b for b in bs if f"{ks[0]},{b}" in per_kb and "plain b" in per_kb[f"{ks[0]},{b}"]]:
            cells = []
            for engine in engines:
                low = median(per_kb[f"{ks[0]},{b}"][f"crossbow {engine}"]["peak_bytes"])
                high = median(per_kb[f"{ks[-1]},{b}"][f"crossbow {engine}"]["peak_bytes"])
                cells.append(f"{(high - low) / (ks[-1] - ks[0]) / 2**20:.1f}")
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
