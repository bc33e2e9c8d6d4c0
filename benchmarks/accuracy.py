"""Statistical efficiency and time to accuracy: epochs and wall time until the test accuracy reaches a target.

Two workloads, each with the learning rate a user tuned for batch b on one learner:

- ``mnist1d``: the MNIST-1D paper's CNN on MNIST-1D (4000 train / 1000 test), b=16, lr 0.02, target 90%
  (of 0.01, 0.02 and 0.05, 0.02 reached 90% first for plain Lightning at b=16: epoch 14, seed 0);
- ``digits``: an MLP on scikit-learn's 8x8 digits (1438 / 359), b=16, lr 0.05, target 95%.

Configurations: plain Lightning at b (the tuned setting); plain at 8b with the same lr; plain at 8b
with the linear scaling rule and a 5-epoch linear warm-up (Goyal et al. 2017); crossbow k=2, 4, 8
at b with the lr unchanged (the default rule: scaled averaging with the measured gain); at k=8,
every other rule and outer learning rate (Crossbow's SMA, EASGD, gossip, plain averaging, the
linear and square-root rules), an outer heavy-ball momentum on z, the gain per parameter tensor, and
the gain's smoothing; crossbow with ``replicas_per_device="auto"``.
No per-k re-tuning of the user's hyper-parameters.
Test accuracy is measured after every epoch; evaluation time is not counted as training time. The
configurations run interleaved, seed by seed, so that a drift in the machine's speed falls on all alike.

    python benchmarks/accuracy.py                 # both workloads, 3 seeds
    python benchmarks/accuracy.py --quick         # 1 seed, 5 configurations, fewer epochs
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.throughput import bare_trainer, machine, results_dir  # noqa: E402
from examples.data import MNIST1D, ArrayDataModule, Digits  # noqa: E402
from examples.models import Classifier, conv1d_net, mlp  # noqa: E402
from lightning_crossbow import CrossbowStrategy, ReplicaAutoTuner  # noqa: E402
from lightning_crossbow.algorithms import ScaledAveraging, gain_ratio, noise_and_signal  # noqa: E402
from lightning_crossbow.sma import update_center_  # noqa: E402

OUT = Path(__file__).with_name("out")
SCALE = 8  # the large-batch baselines use SCALE x b


@dataclass
class Workload:
    name: str
    data: Callable[[int, int], ArrayDataModule]  # (batch size, seed) -> data module
    net: Callable[[], torch.nn.Module]
    lr: float
    target: float
    max_epochs: int


WORKLOADS = {
    "mnist1d": Workload(
        "mnist1d",
        lambda b, seed: MNIST1D(batch_size=b, val_fraction=0.0, seed=seed),
        lambda: conv1d_net(40, 10),
        0.02,
        0.90,
        40,
    ),
    "digits": Workload(
        "digits", lambda b, seed: Digits(batch_size=b, val_fraction=0.0, seed=seed), lambda: mlp(64, 10), 0.05, 0.95, 40
    ),
}


class WarmupClassifier(Classifier):
    """The same classifier with Goyal et al.'s linear learning-rate warm-up: from ``start`` times its lr (the
    user's lr, before the linear scaling rule) up to its lr over ``warmup_steps`` optimizer steps, by a constant
    amount each step, ``lr_t = lr (start + (1 - start) min(1, t / warmup_steps))``."""

    def __init__(self, net: torch.nn.Module, warmup_steps: int, start: float, **kwargs: Any) -> None:
        super().__init__(net, **kwargs)
        self.warmup_steps, self.start = warmup_steps, start

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        warmup = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: self.start + (1.0 - self.start) * min(1.0, step / self.warmup_steps)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


class TestAccuracyCurve(L.Callback):
    """After every training epoch: test accuracy of the module (z under crossbow), and training wall time so far."""

    def __init__(self, test_loader: Any, target: float) -> None:
        self.test_loader, self.target = test_loader, target
        self.curve: list[dict[str, float]] = []
        self._train_seconds = 0.0
        self._epoch_started = 0.0

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_started = time.perf_counter()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._train_seconds += time.perf_counter() - self._epoch_started
        strategy = trainer.strategy
        if hasattr(strategy, "sync_center"):
            strategy.sync_center()
        was_training = pl_module.training
        pl_module.eval()
        correct = total = 0
        with torch.no_grad():
            for x, y in self.test_loader:
                correct += int((pl_module(x).argmax(1) == y).sum())
                total += len(y)
        pl_module.train(was_training)
        accuracy = correct / total
        self.curve.append(
            {
                "epoch": trainer.current_epoch + 1,
                "wall_s": self._train_seconds,
                "test_acc": accuracy,
                "replicas_per_device": getattr(strategy, "replicas_per_device", 1),
            }
        )
        if accuracy >= self.target:
            trainer.should_stop = True


class PerTensorGain(ScaledAveraging):
    r"""An experiment (one process, no learner left out): scaled averaging with AdaScale's gain measured and applied
    per parameter tensor ``i`` ("corrections scaled per layer"), ``z_next[i] = z[i] + eta_i mean_j d_j[i]``, with
    ``eta_i = gain_ratio(sigma_i^2, |g_i|^2, K)`` from the spread and mean of the ``K`` steps' ``d_j[i]``, each
    averaged over steps with weight ``smoothing`` on the past, as the library's rule does over all tensors at once."""

    def __init__(self) -> None:
        super().__init__()
        self.per_tensor: dict[str, tuple[float, float]] = {}

    def after_local_step(self, buckets: Any, context: Any) -> bool:
        learners, beta, etas = context.num_learners, self.smoothing, []
        for bucket in buckets:
            steps = bucket.replicas - bucket.center  # (K, N): d_j
            mean = steps.mean(0)
            for name, start, end, _ in bucket.slices():
                segment, mean_segment = steps[:, start:end], mean[start:end]
                mean_square = float((segment * segment).sum()) / learners
                noise, signal = noise_and_signal(mean_square, float(mean_segment @ mean_segment), learners)
                past_noise, past_signal = self.per_tensor.get(name, (0.0, 0.0))
                noise, signal = beta * past_noise + (1 - beta) * noise, beta * past_signal + (1 - beta) * signal
                self.per_tensor[name] = (noise, signal)
                eta = gain_ratio(noise, signal, learners)
                mean_segment.mul_(eta)
                etas.append(eta)
            update_center_(bucket.center, bucket.center_prev, mean, self.central_momentum)
        self.last_eta = statistics.fmean(etas)
        return True


def _crossbow(k: int, smoothing: Optional[float] = None, **kwargs: Any) -> Callable[[], CrossbowStrategy]:
    def make() -> CrossbowStrategy:
        strategy = CrossbowStrategy(k, **kwargs)
        if smoothing is not None:  # the adaptive gain's moving-average weight (0.9 by default)
            strategy.averaging.smoothing = smoothing
        return strategy

    return make


def _per_tensor_gain(k: int) -> Callable[[], CrossbowStrategy]:
    def make() -> CrossbowStrategy:
        strategy = CrossbowStrategy(k)
        strategy.averaging = PerTensorGain()
        return strategy

    return make


def configurations(quick: bool) -> dict[str, dict[str, Any]]:
    """name -> how to train: strategy factory, batch multiple, lr multiple, warm-up epochs."""
    plain = lambda: "auto"  # noqa: E731
    configs = {
        "plain b": {"strategy": plain, "batch": 1, "lr": 1.0},
        f"plain {SCALE}b, same lr": {"strategy": plain, "batch": SCALE, "lr": 1.0},
        f"plain {SCALE}b, lr x{SCALE} + warm-up": {
            "strategy": plain,
            "batch": SCALE,
            "lr": float(SCALE),
            "warmup_epochs": 5,
        },
        "crossbow k=2": {"strategy": _crossbow(2), "batch": 1, "lr": 1.0},
        "crossbow k=4": {"strategy": _crossbow(4), "batch": 1, "lr": 1.0},
        "crossbow k=8": {"strategy": _crossbow(8), "batch": 1, "lr": 1.0},
        "crossbow k=16": {"strategy": _crossbow(16), "batch": 1, "lr": 1.0},
        "crossbow k=8, gain smoothing 0.5": {"strategy": _crossbow(8, smoothing=0.5), "batch": 1, "lr": 1.0},
        "crossbow k=8, gain smoothing 0.99": {"strategy": _crossbow(8, smoothing=0.99), "batch": 1, "lr": 1.0},
        "crossbow k=8, outer lr linear (8)": {"strategy": _crossbow(8, outer_lr="linear"), "batch": 1, "lr": 1.0},
        "crossbow k=8, outer lr linear + 5-epoch warm-up": {
            "strategy": _crossbow(8, outer_lr="linear", warmup_epochs=5),
            "batch": 1,
            "lr": 1.0,
        },
        "crossbow k=8, outer lr sqrt(8)": {"strategy": _crossbow(8, outer_lr=SCALE**0.5), "batch": 1, "lr": 1.0},
        "crossbow k=8, outer lr 1 (plain averaging)": {"strategy": _crossbow(8, outer_lr=1.0), "batch": 1, "lr": 1.0},
        "crossbow k=8, gain per tensor": {"strategy": _per_tensor_gain(8), "batch": 1, "lr": 1.0},
        "crossbow k=8, outer momentum 0.3": {"strategy": _crossbow(8, central_momentum=0.3), "batch": 1, "lr": 1.0},
        "crossbow k=8, outer momentum 0.6": {"strategy": _crossbow(8, central_momentum=0.6), "batch": 1, "lr": 1.0},
        "crossbow k=8, averaging period 2": {"strategy": _crossbow(8, averaging_period=2), "batch": 1, "lr": 1.0},
        "crossbow k=8, averaging period 4": {"strategy": _crossbow(8, averaging_period=4), "batch": 1, "lr": 1.0},
        "crossbow k=8, SlowMo (period 3, outer lr 1, momentum 0.5)": {
            "strategy": _crossbow(8, averaging_period=3, outer_lr=1.0, central_momentum=0.5),
            "batch": 1,
            "lr": 1.0,
        },
        "crossbow k=8, SlowMo (period 3, outer lr 1, momentum 0.7)": {
            "strategy": _crossbow(8, averaging_period=3, outer_lr=1.0, central_momentum=0.7),
            "batch": 1,
            "lr": 1.0,
        },
        "crossbow k=8, sma (Crossbow's rule)": {"strategy": _crossbow(8, algorithm="sma"), "batch": 1, "lr": 1.0},
        "crossbow k=8, easgd": {"strategy": _crossbow(8, algorithm="easgd"), "batch": 1, "lr": 1.0},
        "crossbow k=8, gossip": {"strategy": _crossbow(8, algorithm="gossip"), "batch": 1, "lr": 1.0},
        "crossbow auto (throughput)": {"strategy": lambda: CrossbowStrategy("auto"), "batch": 1, "lr": 1.0},
        "crossbow auto, window 10": {
            "strategy": lambda: CrossbowStrategy(1),
            "callbacks": lambda: [ReplicaAutoTuner(window=10, warmup=2, plot=False)],
            "batch": 1,
            "lr": 1.0,
        },
        "crossbow auto, doubling climb": {
            "strategy": lambda: CrossbowStrategy(1),
            "callbacks": lambda: [ReplicaAutoTuner(climb="doubling", plot=False)],
            "batch": 1,
            "lr": 1.0,
        },
        "crossbow auto, progress": {
            "strategy": lambda: CrossbowStrategy(1),
            "callbacks": lambda: [ReplicaAutoTuner(objective="progress", plot=False)],
            "batch": 1,
            "lr": 1.0,
        },
    }
    if quick:
        keep = (
            "plain b",
            f"plain {SCALE}b, lr x{SCALE} + warm-up",
            "crossbow k=8",
            "crossbow k=8, sma (Crossbow's rule)",
            "crossbow auto (throughput)",
        )
        configs = {name: configs[name] for name in keep}
    return configs


def train_to_target(
    workload: Workload, config: dict[str, Any], seed: int, max_epochs: int, b: int = 16
) -> dict[str, Any]:
    L.seed_everything(seed, verbose=False)
    batch = b * config["batch"]
    data = workload.data(batch, seed)
    data.setup("fit")
    lr = workload.lr * config["lr"]
    steps_per_epoch = len(data.train_dataloader())
    if config.get("warmup_epochs"):
        model: Classifier = WarmupClassifier(
            workload.net(), warmup_steps=config["warmup_epochs"] * steps_per_epoch, start=1.0 / config["lr"], lr=lr
        )
    else:
        model = Classifier(workload.net(), lr=lr)
    curve = TestAccuracyCurve(data.test_dataloader(), workload.target)
    trainer = bare_trainer(
        config["strategy"](),
        devices=config.get("devices", 1),
        max_epochs=max_epochs,
        callbacks=[curve, *config.get("callbacks", list)()],
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=OUT / "runs",
    )
    trainer.fit(model, train_dataloaders=data.train_dataloader())
    reached = next((point for point in curve.curve if point["test_acc"] >= workload.target), None)
    return {
        "seed": seed,
        "curve": curve.curve,
        "epochs_to_target": reached["epoch"] if reached else None,
        "seconds_to_target": reached["wall_s"] if reached else None,
        "best_test_acc": max(point["test_acc"] for point in curve.curve),
    }


def _median(values: list[Optional[float]]) -> Optional[float]:
    """Median where a run that never reached the target counts as infinitely slow (None if it is such a run); of an
    even number, the mean of the two middle ones (None if either is such a run)."""
    ordered = sorted(values, key=lambda v: float("inf") if v is None else v)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    low, high = ordered[middle - 1], ordered[middle]
    return None if low is None or high is None else (low + high) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--seeds", type=int, help="number of seeds (default 3, or 1 with --quick)")
    parser.add_argument("--configs", nargs="+", help="run only these configurations, keeping the others' results")
    args = parser.parse_args()
    unknown = sorted(set(args.configs or ()) - set(configurations(args.quick)))
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; the configurations: {list(configurations(args.quick))}")
    seeds = list(range(args.seeds or (1 if args.quick else 3)))
    results: dict[str, Any] = {
        "machine": machine(),
        "command": "python " + " ".join(shlex.quote(arg) for arg in sys.argv),
        "scale": SCALE,
        "workloads": {},
    }
    out = results_dir(args.quick) / "accuracy.json"
    previous = json.loads(out.read_text()) if args.configs and out.exists() else None
    if previous is not None:  # keep the other configurations' results, and say which were run again
        results["workloads"] = previous["workloads"]
        results["command"] = previous["command"]
        rerun = (
            f"python benchmarks/accuracy.py --workloads {' '.join(args.workloads)}"
            + (f" --seeds {args.seeds}" if args.seeds else "")
            + " --configs "
            + " ".join(f"'{name}'" for name in args.configs)
        )
        results["reruns"] = list(dict.fromkeys([*previous.get("reruns", []), rerun]))  # (once per command)
    for name in args.workloads:
        workload = WORKLOADS[name]
        max_epochs = 15 if args.quick else workload.max_epochs
        table: dict[str, Any] = results["workloads"].get(name, {}).get("configs", {})
        chosen = {n: c for n, c in configurations(args.quick).items() if not args.configs or n in args.configs}
        # Interleaved, seed by seed: a drift in the machine's speed falls on every configuration alike.
        measured: dict[str, list[dict[str, Any]]] = {config_name: [] for config_name in chosen}
        for seed in seeds:
            for config_name, config in chosen.items():
                measured[config_name].append(train_to_target(workload, config, seed, max_epochs))
        for config_name, runs in measured.items():
            table[config_name] = {
                "runs": runs,
                "median_epochs": _median([r["epochs_to_target"] for r in runs]),
                "median_seconds": _median([r["seconds_to_target"] for r in runs]),
                "reached": sum(r["epochs_to_target"] is not None for r in runs),
                "median_best_acc": statistics.median(r["best_test_acc"] for r in runs),
            }
            row = table[config_name]
            print(
                f"{name:<8} {config_name:<32} epochs {row['median_epochs']}  seconds {row['median_seconds']}"
                f"  reached {row['reached']}/{len(runs)}  best acc {row['median_best_acc']:.3f}",
                flush=True,
            )
        results["workloads"][name] = {
            "target": workload.target,
            "lr": workload.lr,
            "max_epochs": max_epochs,
            "configs": table,
        }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
