"""Hardware efficiency grid: samples/s of crossbow k x b (fused, sequential) against plain Lightning at b and k*b.

One process, the MNIST-1D paper's CNN on MNIST-1D-shaped data; every configuration of one repetition
runs back to back, repetitions are interleaved, and ratios are medians of per-repetition ratios.

    python benchmarks/hardware.py            # k in 1 2 4 8 16, b in 16 64, 3 repetitions
    python benchmarks/hardware.py --quick    # k in 1 4 16, b = 16, 1 repetition
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.throughput import results_dir, samples_per_second, save_result  # noqa: E402
from lightning_crossbow import CrossbowStrategy  # noqa: E402


def grid(ks: list[int], batch_sizes: list[int]) -> dict[str, tuple[Any, int, int]]:
    """name -> (strategy factory, replicas, per-replica batch)."""
    configs: dict[str, tuple[Any, int, int]] = {}
    for b in batch_sizes:
        configs[f"plain b={b}"] = (lambda: "auto", 1, b)
        for k in ks:
            if k > 1:
                configs[f"plain b={k * b}"] = (lambda: "auto", 1, k * b)
            for engine in ("fused", "sequential"):
                if k > 1 or engine == "fused":  # with k=1 both engines are the same loop
                    configs[f"crossbow k={k} b={b} {engine}"] = (lambda k=k, e=engine: CrossbowStrategy(k, engine=e), k, b)
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        ks, batch_sizes, repeats, steps, warmup = [1, 4, 16], [16], 1, 20, 5
    else:
        ks, batch_sizes, repeats, steps, warmup = [1, 2, 4, 8, 16], [16, 64], 3, 40, 5
    configs = grid(ks, batch_sizes)
    measured: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(repeats):
        for name, (strategy, k, b) in configs.items():
            measured[name].append(samples_per_second(strategy(), k, b, steps, warmup))
    rows = []
    for b in batch_sizes:
        for k in ks:
            for engine in ("fused", "sequential"):
                name = f"crossbow k={k} b={b} {engine}"
                if name not in measured:
                    continue
                plain_b, plain_kb = measured[f"plain b={b}"], measured[f"plain b={k * b}"]
                rows.append({
                    "k": k, "b": b, "engine": engine,
                    "samples_per_sec": statistics.median(measured[name]),
                    "plain_b": statistics.median(plain_b),
                    "plain_kb": statistics.median(plain_kb),
                    "over_plain_b": statistics.median(x / y for x, y in zip(measured[name], plain_b)),
                    "over_plain_kb": statistics.median(x / y for x, y in zip(measured[name], plain_kb)),
                })
    command = "python benchmarks/hardware.py" + (" --quick" if args.quick else "")
    save_result(results_dir(args.quick) / "hardware.json", command, repeats=repeats, timed_steps=steps, rows=rows)
    print(f"{'k':>3} {'b':>3} {'engine':<10} {'samples/s':>10} {'/ plain b':>10} {'/ plain k*b':>12}")
    for r in rows:
        print(f"{r['k']:>3} {r['b']:>3} {r['engine']:<10} {r['samples_per_sec']:>10.0f} {r['over_plain_b']:>10.2f} {r['over_plain_kb']:>12.2f}")


if __name__ == "__main__":
    main()
