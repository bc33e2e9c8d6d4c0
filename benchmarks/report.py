"""Writes benchmarks/RESULTS.md and the PNG plots in benchmarks/plots/ from the JSON in benchmarks/out/.

python benchmarks/report.py           # after hardware.py, accuracy.py, throughput.py, distributed.py, tuner.py,
                                      # heterogeneous.py
python benchmarks/report.py --quick   # after their --quick runs (JSON in benchmarks/out/quick/):
                                      # benchmarks/out/quick/RESULTS.md, so the committed results stay as they are
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"


#: Where the benchmarks' JSON is read from: ``benchmarks/out/``, or ``benchmarks/out/quick/`` with ``--quick``.
SOURCE = OUT


def _load(name: str) -> Optional[dict[str, Any]]:
    path = SOURCE / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _fmt(value: Optional[float], digits: int = 1) -> str:
    return "not reached" if value is None else f"{value:.{digits}f}"


def _spread(values: list[Optional[float]], digits: int = 1) -> str:
    """`` (min-max[, n not reached])`` over the runs that reached the target; empty when none did."""
    reached = [v for v in values if v is not None]
    if not reached:
        return ""
    missing = len(values) - len(reached)
    text = f"{min(reached):.{digits}f}-{max(reached):.{digits}f}"
    return f" ({text}" + (f", {missing} not reached)" if missing else ")")


def hardware_section(data: dict[str, Any], plots: Path) -> list[str]:
    lines = [
        "## 1. Hardware efficiency (samples/s, one process)",
        "",
        f"`{data['command']}`: median of {data['repeats']} interleaved repetitions of {data['timed_steps']} timed steps;"
        " ratios are medians of per-repetition ratios.",
        "",
        "| k | b | engine | samples/s | / plain b | / plain k*b |",
        "|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['k']} | {r['b']} | {r['engine']} | {r['samples_per_sec']:.0f} | {r['over_plain_b']:.2f} | {r['over_plain_kb']:.2f} |"
        )
    figure, axis = plt.subplots(figsize=(6, 4))
    for b in sorted({r["b"] for r in data["rows"]}):
        for engine in ("fused", "sequential"):
            rows = [
                r for r in data["rows"] if r["b"] == b and r["engine"] in (engine, "fused" if r["k"] == 1 else engine)
            ]
            rows = sorted({r["k"]: r for r in rows}.values(), key=lambda r: r["k"])
            axis.plot(
                [r["k"] for r in rows], [r["samples_per_sec"] for r in rows], "o-", label=f"crossbow {engine}, b={b}"
            )
        plain = sorted({r["k"]: r for r in data["rows"] if r["b"] == b}.values(), key=lambda r: r["k"])
        axis.plot(
            [r["k"] for r in plain], [r["plain_kb"] for r in plain], "k--", alpha=0.5, label=f"plain, batch k*{b}"
        )
    axis.set(xscale="log", xlabel="replicas per device k", ylabel="samples/s", title="Throughput against k")
    axis.set_xticks([1, 2, 4, 8, 16], labels=["1", "2", "4", "8", "16"])
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(plots / "throughput_vs_k.png", dpi=100)
    plt.close(figure)
    lines += ["", "![throughput against k](plots/throughput_vs_k.png)", ""]
    return lines


#: The accuracy plots show these configurations (the table has them all).
PLOTTED = (
    "plain b",
    "plain 8b, lr x8 + warm-up",
    "crossbow k=2",
    "crossbow k=4",
    "crossbow k=8",
    "crossbow k=8, sma (Crossbow's rule)",
    "crossbow k=8, gossip",
    "crossbow auto (throughput)",
)


def accuracy_section(data: dict[str, Any], plots: Path) -> list[str]:
    lines = [
        "## 2. Statistical efficiency and time to accuracy",
        "",
        f"`{data['command']}`. Epochs and training wall time (evaluation excluded) until the test accuracy"
        " first reaches the target; median over seeds (a run that never reached it counts as the slowest),"
        " range in brackets. Learning rates are the user's, tuned for plain Lightning at b=16;"
        f' nothing is re-tuned per k. "plain {data["scale"]}b" uses {data["scale"]}x the batch.',
        "",
        *(
            [
                "Configurations run again afterwards, replacing their rows (their wall times come from another run,"
                " so compare them only with rows of the same run): " + "; ".join(f"`{c}`" for c in data["reruns"]),
                "",
            ]
            if data.get("reruns")
            else []
        ),
        "The crossbow rows at k=8 compare every averaging rule and outer learning rate with the default"
        " (scaled averaging, gain measured on the learners' steps, smoothing 0.9). Tried during development"
        " and not kept, so not re-run here (same seeds 0-2, median, the gain's smoothing then 0.99): the"
        " gain measured on the replicas' gradients, AdaScale's own definition, needed 23 epochs on MNIST-1D"
        " and 5 on the digits, against 19 and 4 for the gain measured on the steps (a likely reason, not"
        " verified: with SGD momentum a step averages its gradients' noise over past steps, and only the"
        " step-based gain sees the step the optimizer actually takes).",
        "",
        "Not run: Lightning's DDPStrategy with post-local SGD. It needs a DDP communication hook, and"
        " Lightning registers those on CUDA only; this machine has no GPU.",
        "",
    ]
    for name, workload in data["workloads"].items():
        configs = workload["configs"]
        plain = configs.get("plain b", {}).get("median_seconds")
        plain_epochs = configs.get("plain b", {}).get("median_epochs")
        lines += [
            f"### {name}: target {workload['target']:.0%} test accuracy, lr {workload['lr']}, at most {workload['max_epochs']} epochs",
            "",
            "| configuration | epochs to target | epochs / plain b | seconds to target | time / plain b | reached | best test acc |",
            "|---|---|---|---|---|---|---|",
        ]
        for config_name, row in configs.items():
            epochs = [r["epochs_to_target"] for r in row["runs"]]
            seconds = [r["seconds_to_target"] for r in row["runs"]]
            ratio = f"{row['median_seconds'] / plain:.2f}" if plain and row["median_seconds"] else "-"
            epoch_ratio = f"{row['median_epochs'] / plain_epochs:.2f}" if plain_epochs and row["median_epochs"] else "-"
            lines.append(
                f"| {config_name} | {_fmt(row['median_epochs'], 0)} {_spread(epochs, 0)} | {epoch_ratio}"
                f" | {_fmt(row['median_seconds'])}"
                f" {_spread(seconds)} | {ratio} | {row['reached']}/{len(row['runs'])} | {row['median_best_acc']:.3f} |"
            )
        lines += _tuned_against_best_fixed(configs)
        figure, (by_time, by_epoch) = plt.subplots(1, 2, figsize=(11, 4))
        for config_name, row in configs.items():
            if config_name not in PLOTTED:
                continue
            curve = row["runs"][0]["curve"]
            by_time.plot([p["wall_s"] for p in curve], [p["test_acc"] for p in curve], label=config_name)
            by_epoch.plot([p["epoch"] for p in curve], [p["test_acc"] for p in curve], label=config_name)
        for axis, label in ((by_time, "training wall time (s)"), (by_epoch, "epoch")):
            axis.axhline(workload["target"], color="k", linestyle=":", linewidth=1)
            axis.set(xlabel=label, ylabel="test accuracy", title=f"{name} (seed 0)")
        by_epoch.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(plots / f"accuracy_{name}.png", dpi=100)
        plt.close(figure)
        lines += ["", f"![{name} accuracy](plots/accuracy_{name}.png)", ""]
    return lines


def _tuned_against_best_fixed(configs: dict[str, Any], tuned: str = "crossbow auto (throughput)") -> list[str]:
    """The auto-tuned run's seconds to target over the fastest fixed k's (by median), seed by seed (median of the
    per-seed ratios; a run that never reached the target is left out), when both rows hold the same seeds."""
    fixed = {n: row for n, row in configs.items() if n.startswith("crossbow k=") and n[len("crossbow k=") :].isdigit()}
    fixed = {n: row for n, row in fixed.items() if row["median_seconds"] is not None}
    if tuned not in configs or not fixed:
        return []
    best_name = min(fixed, key=lambda n: fixed[n]["median_seconds"])
    pairs = {r["seed"]: r["seconds_to_target"] for r in fixed[best_name]["runs"]}
    tuned_runs = configs[tuned]["runs"]
    if sorted(pairs) != sorted(r["seed"] for r in tuned_runs):
        return []
    ratios = [
        r["seconds_to_target"] / pairs[r["seed"]] for r in tuned_runs if r["seconds_to_target"] and pairs[r["seed"]]
    ]
    if not ratios:
        return []
    return [
        "",
        f"{tuned} / {best_name} (the fastest fixed k by median), seconds to target seed by seed: median"
        f" {statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} seeds).",
    ]


def overhead_section(data: dict[str, Any], plots: Path) -> list[str]:
    lines = [
        "## 3. Overhead and the core comparisons",
        "",
        f"`{data['command']}`: median samples/s of {data['repeats']} interleaved runs of {data['timed_steps']} timed steps.",
        "",
        "| configuration | samples/s |",
        "|---|---|",
    ]
    lines += [f"| {name} | {value:.0f} |" for name, value in data["median"].items()]
    lines += ["", "| ratio | paired | of medians |", "|---|---|---|"]
    lines += [f"| {name} | {v['paired']:.2f} | {v['of_medians']:.2f} |" for name, v in data["ratios"].items()]
    if any(name.startswith("kernels alone") for name in data["median"]):
        lines += [
            "",
            "The kernels-alone rows time the bare forward, backward and SGD step outside Lightning (no data loading,"
            " logging or averaging): vmap over k models, with the fused engine's layers, against one model at k*b."
            " Their ratio is what the kernels allow fused / plain to reach; Lightning's own per-step work, the same in"
            " both, pulls the ratio inside Lightning towards 1, and crossbow's (grouping the batches, averaging) away"
            " from it.",
        ]
    return lines + [""]


def distributed_section(data: dict[str, Any], plots: Path) -> list[str]:
    lines = [
        "## 4. Two CPU processes: crossbow against DDP",
        "",
        f"`{data['command']}`: 2 gloo processes, same total batch per step; medians of {data['repeats']} alternating"
        f" runs of {data['timed_steps']} timed steps.",
        "",
        "| configuration | samples/s | step ms | collectives/step | bytes/step | comm ms/step |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in data["median"].items():
        comm = f"{m['comm_ms_per_step']:.2f}" if name.startswith("crossbow") else "overlapped with backward"
        lines.append(
            f"| {name} | {m['samples_per_sec']:.0f} | {m['step_ms']:.2f} | {m['collectives_per_step']:.2f}"
            f" | {m['bytes_per_step']:.0f} | {comm} |"
        )
    lines += [
        "",
        f"crossbow / DDP samples/s: {data['crossbow_over_ddp']:.2f} (median of paired runs). Crossbow's one collective"
        " per step is its all-reduce of the summed corrections, which also carries each process's SIGTERM vote"
        " (`lightning_crossbow/sigterm.py`); DDP's two are Lightning's broadcast at every batch (its SIGTERM check)"
        " and the gradient bucket.",
        "",
    ]
    return lines


def tuner_section(data: dict[str, Any], plots: Path) -> list[str]:
    fixed = {int(k): v for k, v in data["fixed"].items()}
    lines = [
        "## 5. ReplicaAutoTuner against fixed k",
        "",
        f'`{data["command"]}`: crossbow at every fixed k, and a run tuned from k=1 (objective "throughput")'
        " measured after the tuner chose; per-replica batch 16.",
        "",
        "| k | samples/s (median) |",
        "|---|---|",
    ]
    lines += [f"| {k} | {statistics.median(v):.0f} |" for k, v in fixed.items()]
    lines += [
        f"| tuned (chose {', '.join(str(c) for c in data['chosen'])}) | {statistics.median(data['tuned']):.0f} |",
        "",
        f"Tuned / best fixed k in the same repetition (median): {data['tuned_over_best_fixed']:.2f};"
        f" best fixed k by median: {data['best_fixed_k']}.",
        "",
    ]
    if data.get("replayed_searches"):
        lines += [
            "The search replayed 1,000 times on the measured curve (the medians above), every window's rate with"
            " Gaussian noise of the spread measured between repetitions, or twice that:",
            "",
            "| noise | climb | look ahead | holds within 10% of the best | median held / best | windows (mean) |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['noise']:.3f} | {r['climb']} | {'yes' if r['look_ahead'] else 'no'} | {r['within_10_percent']:.0%}"
            f" | {r['median_ratio']:.2f} | {r['mean_windows']:.1f} |"
            for r in data["replayed_searches"]
        ]
        lines.append("")
    return lines


def heterogeneous_section(data: dict[str, Any], plots: Path) -> list[str]:
    lines = [
        "## 6. Devices of different speed: heterogeneous against uniform mode",
        "",
        "Two CPU processes, 1 thread each; rank 1 is throttled to half speed (it sleeps as long as its forward and"
        " backward took). Crossbow's default rule; the balancer measures every 20 steps.",
        "",
    ]
    for run in (data, _load("heterogeneous_b64")):
        if run is None:
            continue
        medians = run["median_samples_per_sec"]
        splits = sorted({tuple(r["heterogeneous"]["split"]) for r in run["runs"]})
        lines += [
            f"`{run['command']}`: k={run['replicas_per_device']} per device (K={2 * run['replicas_per_device']}),"
            f" per-replica batch {run['batch_size']}, {run['timed_steps']} timed steps after"
            f" {run.get('warmup_steps', 45)} steps in which the balancer settles (3-4 windows of 20);"
            f" medians of {len(run['runs'])} alternating repetitions.",
            "",
            "| configuration | samples/s |",
            "|---|---|",
            f"| uniform mode (k={run['replicas_per_device']} on each) | {medians['uniform']:.0f} |",
            f"| heterogeneous mode (final splits {', '.join(str(s) for s in splits)}) | {medians['heterogeneous']:.0f} |",
            f"| fast process alone, at its split's k | {medians['alone_fast']:.0f} |",
            f"| slow process alone, at its split's k | {medians['alone_slow']:.0f} |",
        ]
        if "side_by_side_fast" in medians:
            lines += [
                f"| fast process alone, side by side with the slow one (not synchronised) | {medians['side_by_side_fast']:.0f} |",
                f"| slow process alone, side by side with the fast one (not synchronised) | {medians['side_by_side_slow']:.0f} |",
                "",
                "Heterogeneous / sum of the two alone side by side, each ratio within one repetition:"
                f" **{run['median_heterogeneous_over_sum_side_by_side']:.2f}** (goal 0.9): the machine as busy as in the"
                " two-process runs, so this isolates what waiting for each other costs.",
            ]
        lines += [
            "",
            f"Heterogeneous / sum of the two alone, one at a time: **{run['median_heterogeneous_over_sum_alone']:.2f}**;"
            f" heterogeneous / uniform: **{run['median_heterogeneous_over_uniform']:.2f}**. Without any throttle, two"
            f" equal processes reach {run['median_unthrottled_two_over_twice_alone']:.2f} of twice one alone: what two"
            " processes that synchronise every step cost on this 2-core machine (communication, and two busy processes"
            " sharing it), whatever the balance.",
            "",
        ]
        if run.get("accuracy"):
            lines += [
                "Time to 90% MNIST-1D test accuracy (b=16, lr 0.02, rank 1 throttled; median of seeds, evaluation not"
                " counted):",
                "",
                "| mode | epochs | seconds | reached |",
                "|---|---|---|---|",
            ]
            for mode, row in run["accuracy"].items():
                epochs = [r["epochs_to_target"] for r in row["runs"]]
                seconds = [r["seconds_to_target"] for r in row["runs"]]
                lines.append(
                    f"| {mode} | {_fmt(row['median_epochs'], 0)}{_spread(epochs, 0)} | {_fmt(row['median_seconds'])}"
                    f"{_spread(seconds)} | {row['reached']}/{len(row['runs'])} |"
                )
            lines.append("")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    global SOURCE
    quick = parser.parse_args().quick
    SOURCE = OUT / "quick" if quick else OUT
    where = OUT / "quick" if quick else HERE
    results, plots = where / "RESULTS.md", where / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    sections = {
        "hardware": hardware_section,
        "accuracy": accuracy_section,
        "throughput": overhead_section,
        "distributed": distributed_section,
        "tuner": tuner_section,
        "heterogeneous": heterogeneous_section,
    }
    loaded = {name: _load(name) for name in sections}
    machine = next((d["machine"] for d in loaded.values() if d and "machine" in d), {})
    lines = [
        "# Benchmark results",
        "",
        "Written by `make bench` (`benchmarks/report.py`); `make bench-quick` runs a reduced version.",
        "",
        "Machine: " + ", ".join(f"{key} {value}" for key, value in machine.items()),
        "",
    ]
    for name, section in sections.items():
        data = loaded[name]
        lines += section(data, plots) if data else [f"## {name}: not run", ""]
    results.write_text("\n".join(lines))
    print(f"wrote {results} and {plots}/")


if __name__ == "__main__":
    main()
