"""Train a model from the Hydra configs in conf/ and print one result line.

python examples/train.py                                   # MNIST-1D CNN, crossbow k=4
python examples/train.py strategy.replicas_per_device=8 data.batch_size=16 trainer.max_epochs=10
python examples/train.py strategy=single                   # plain Lightning baseline
python examples/train.py -m strategy.replicas_per_device=1,2,4,8   # a sweep, results in one table
python examples/train.py --cfg job                         # print the composed config
python examples/train.py '~logger' callbacks.lr_monitor=null   # no logger (LearningRateMonitor needs one)

Every run writes into its Hydra output folder (outputs/<date>/<time>/, or multirun/...): result.json, the
logs, checkpoints and the tuner's plot. The RESULT line's wall_s is fit's wall time, set-up, validation and
checkpoints included, and samples_per_sec the training samples over it (end to end, not the step rate).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make `examples` importable for Hydra targets

import hydra  # noqa: E402
import lightning as L  # noqa: E402
import torch  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.utils import instantiate  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import lightning_crossbow  # noqa: E402,F401  (registers strategy="crossbow")
from lightning_crossbow import CrossbowStrategy  # noqa: E402
from lightning_crossbow.data import ReplicaGroup  # noqa: E402


class SamplesTrained(L.Callback):
    """Training samples this process took (a crossbow step hands over k batches, and k may change)."""

    def __init__(self) -> None:
        self.samples = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        for x, _ in batch if isinstance(batch, ReplicaGroup) else [batch]:
            self.samples += len(x)


def build(cfg: DictConfig) -> tuple[L.Trainer, L.LightningModule, L.LightningDataModule]:
    """Builds every component from its config group; raises on any bad value before training starts."""
    datamodule = instantiate(cfg.data)
    dims = {"in_features": datamodule.num_features, "num_classes": datamodule.num_classes}
    model = instantiate(cfg.model, net=dims, num_classes=datamodule.num_classes)
    strategy: Any = instantiate(cfg.strategy) if "_target_" in cfg.strategy else cfg.strategy.name
    callbacks = [instantiate(c) for c in cfg.callbacks.values() if c is not None]
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    root = {"default_root_dir": run_dir()} if "default_root_dir" not in cfg.trainer and run_dir() else {}
    trainer = L.Trainer(
        **cfg.trainer, **root, strategy=strategy, callbacks=[*callbacks, SamplesTrained()], logger=logger
    )
    return trainer, model, datamodule


def run_dir() -> str | None:
    """This Hydra run's output folder (None outside a Hydra run): without a logger, checkpoints and the tuner's plot
    go there too, not into the current folder."""
    if not HydraConfig.initialized():
        return None
    return HydraConfig.get().runtime.get("output_dir")


def run(cfg: DictConfig) -> dict[str, Any]:
    """Trains (and tests) as ``cfg`` says; returns the RESULT line's numbers, over every process (samples summed, the
    slowest one's wall time), and whether this process is the first (``global_zero``), which reports them."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    trainer, model, datamodule = build(cfg)
    start = time.perf_counter()
    trainer.fit(model, datamodule=datamodule)
    wall = time.perf_counter() - start
    test_acc = None
    if cfg.test:
        test_acc = trainer.test(model, datamodule=datamodule, verbose=False)[0]["test_acc"]
    strategy = trainer.strategy
    k = strategy.replicas_per_device if isinstance(strategy, CrossbowStrategy) else 1
    counted = next(c for c in trainer.callbacks if isinstance(c, SamplesTrained)).samples
    counted_here = torch.tensor(float(counted), device=strategy.root_device)  # (NCCL reduces CUDA tensors only)
    samples = float(strategy.reduce(counted_here, reduce_op="sum"))  # over the processes
    wall = float(strategy.reduce(torch.tensor(wall, device=strategy.root_device), reduce_op="max"))  # the slowest's
    return {
        "global_zero": trainer.is_global_zero,
        "strategy": type(strategy).__name__,
        "replicas_per_device": k,
        "batch_size": datamodule.batch_size,
        "epochs": trainer.current_epoch,
        "test_acc": test_acc,
        "wall_s": round(wall, 2),
        "samples_per_sec": round(samples / wall, 1) if wall > 0 else None,
    }


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    result = run(cfg)
    if not result.pop("global_zero"):  # (one result per run: the first process's, its numbers over all of them)
        return
    out = Path(HydraConfig.get().runtime.output_dir)
    (out / "result.json").write_text(json.dumps({**result, "overrides": list(HydraConfig.get().overrides.task)}))
    acc = "n/a" if result["test_acc"] is None else f"{result['test_acc']:.4f}"
    print(
        f"RESULT test_acc={acc} wall_s={result['wall_s']:.1f} replicas_per_device={result['replicas_per_device']}"
        f" samples_per_sec={result['samples_per_sec']} epochs={result['epochs']} strategy={result['strategy']}"
    )


if __name__ == "__main__":
    main()
