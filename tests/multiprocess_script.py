"""Runs crossbow on 2 CPU processes (gloo) and saves what every rank ends with; driven by test_multiprocess.py.

usage: python tests/multiprocess_script.py OUT_DIR {popen,spawn} K [--mismatch] [--epochs N] [--resume CKPT] [--save CKPT]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Subset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_crossbow import CrossbowStrategy  # noqa: E402
from tests.helpers import Classifier, make_data  # noqa: E402

WORLD_SIZE = 2


class Sharded(L.LightningDataModule):
    """Rank r trains on samples r, r+2, r+4, ... in order (the user's own per-rank loader)."""

    def train_dataloader(self) -> DataLoader:
        rank = self.trainer.global_rank
        dataset = make_data(num_samples=96)
        return DataLoader(Subset(dataset, range(rank, len(dataset), WORLD_SIZE)), batch_size=8)


class SaveFinalState(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        torch.save(
            {
                "z": [p.detach().clone() for p in pl_module.parameters()],
                "replicas": {n: p.detach().clone() for n, p in strategy.stack.params.items()},
                "world_size": trainer.world_size,
                "global_step": trainer.global_step,
            },
            self.out / f"rank{trainer.global_rank}.pt",
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("launcher", choices=["popen", "spawn"])
    parser.add_argument("k", type=int)
    parser.add_argument("--mismatch", action="store_true")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--resume")
    parser.add_argument("--save")
    args = parser.parse_args()
    k = args.k + (int(os.environ.get("LOCAL_RANK", 0)) if args.mismatch else 0)
    strategy = CrossbowStrategy(replicas_per_device=k, start_method=args.launcher)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD_SIZE,
        strategy=strategy,
        max_epochs=args.epochs,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SaveFinalState(args.out)],
    )
    trainer.fit(Classifier(), datamodule=Sharded(), ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)


if __name__ == "__main__":
    main()
