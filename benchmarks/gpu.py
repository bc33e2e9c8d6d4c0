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
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def measure(strategy: Any, k: int, b: int, model: str, steps: int, warmup: int, device: str) -> dict[str, float]:
    """samples/s and peak memory (bytes, CUDA only) of one run."""
    net, shape = MODELS[model]
    if device == "cuda":
        gc.collect()  # the last run's trainer and stacked replicas, so that the peak is this run's alone
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    rate = samples_per_second(strategy, k, b, steps, warmup, net=net, input_shape=shape, accelerator=device)
    peak = float(torch.cuda.max_memory_allocated()) if device == "cuda" else float("nan")
    return {"samples_per_sec": rate, "peak_bytes": peak}


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
    parser.add_argument("--out", type=Path, help="default: benchmarks/out/gpu.json (out/quick/ with --quick)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py measures a CUDA GPU and found none; --device cpu runs it as a smoke test.")
    # 20 warm-up steps: engine="auto" times fused against streams over its first 14 steps.
    ks, bs, repeats, steps, warmup = (
        ([1, 4, 16], [16, 64], 1, 20, 20) if args.quick else ([1, 2, 4, 8, 16], [16, 32, 64], 3, 50, 20)
    )
    repeats, ks, bs = args.repeats or repeats, args.ks or ks, args.bs or bs
    engines = ["fused", "streams", "sequential", "auto"] if args.device == "cuda" else ["fused", "sequential", "auto"]
    runs: dict[str, dict[str, dict[str, dict[str, list[float]]]]] = {}  # model -> "k,b" -> config -> metric -> values
    for model in args.models:
        runs[model] = {}
        for b in bs:
            plain_b = {"samples_per_sec": [], "peak_bytes": []}
            for k in ks:
                runs[model][f"{k},{b}"] = {
                    name: {"samples_per_sec": [], "peak_bytes": []} for name in configurations(k, b, engines)
                }
            for _ in range(repeats):
                for key, value in measure("auto", 1, b, model, steps, warmup, args.device).items():
                    plain_b[key].append(value)
                for k in ks:
                    for name, (strategy, replicas, batch) in configurations(k, b, engines).items():
                        result = measure(strategy(), replicas, batch, model, steps, warmup, args.device)
                        for key, value in result.items():
                            runs[model][f"{k},{b}"][name][key].append(value)
                        print(f"{model} k={k} b={b} {name}: {result['samples_per_sec']:.0f} samples/s", flush=True)
            for k in ks:
                runs[model][f"{k},{b}"]["plain b"] = plain_b
    table = summarize(runs, ks, bs, engines)
    print(table)
    quick = args.quick or args.device == "cpu"
    command = (
        "python benchmarks/gpu.py"
        + (" --quick" if args.quick else "")
        + (" --device cpu" if args.device == "cpu" else "")
    )
    save_result(args.out or results_dir(quick) / "gpu.json", command, repeats=repeats, timed_steps=steps, runs=runs)
    if not quick:
        gpu = machine()["cuda"]
        header = (
            f"# Crossbow on one CUDA GPU: {gpu}\n\n"
            f"`{command}`; median of {repeats} interleaved runs of {steps} timed steps.\n\n"
        )
        Path(__file__).with_name("GPU.md").write_text(header + table + "\n")


def summarize(runs: dict[str, Any], ks: list[int], bs: list[int], engines: list[str]) -> str:
    """A Markdown table per model: samples/s per (k, b) and configuration, and memory per replica."""
    median = lambda values: statistics.median(values) if values else float("nan")  # noqa: E731
    names = [f"crossbow {engine}" for engine in engines] + ["plain b", "plain k*b"]
    lines: list[str] = []
    for model, per_kb in runs.items():
        lines += [
            f"\n## {model}: samples/s (median)\n",
            "| k | b | " + " | ".join(names) + " | best crossbow / plain k*b |",
        ]
        lines.append("|" + "---|" * (len(names) + 3))
        for b in bs:
            for k in ks:
                row = per_kb[f"{k},{b}"]
                rates = {name: median(row[name]["samples_per_sec"]) for name in names}
                best = max(rates[f"crossbow {engine}"] for engine in engines)
                cells = " | ".join(f"{rates[name]:.0f}" for name in names)
                lines.append(f"| {k} | {b} | {cells} | {best / rates['plain k*b']:.2f} |")
        lines += [f"\n## {model}: GPU memory per replica (MiB; slope of the peak from k={ks[0]} to k={ks[-1]})\n"]
        lines += [
            "| b | " + " | ".join(f"crossbow {engine}" for engine in engines) + " |",
            "|" + "---|" * (len(engines) + 1),
        ]
        for b in bs:
            cells = []
            for engine in engines:
                low = median(per_kb[f"{ks[0]},{b}"][f"crossbow {engine}"]["peak_bytes"])
                high = median(per_kb[f"{ks[-1]},{b}"][f"crossbow {engine}"]["peak_bytes"])
                cells.append(f"{(high - low) / (ks[-1] - ks[0]) / 2**20:.1f}")
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
