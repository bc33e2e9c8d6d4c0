"""An ordinary Lightning script; the only crossbow changes are the two lines marked CROSSBOW.

    python examples/drop_in.py                      # Trainer(strategy="crossbow")
    python examples/drop_in.py fit --trainer.strategy crossbow --trainer.max_epochs 2   # via LightningCLI
"""

from __future__ import annotations

import sys

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split

import lightning_crossbow  # noqa: F401  CROSSBOW (1/2): registers strategy="crossbow"


class DigitsModel(L.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class DigitsData(L.LightningDataModule):
    def __init__(self, batch_size: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage=None):
        x, y = load_digits(return_X_y=True)
        data = TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y))
        self.train, self.val = random_split(data, [1500, len(data) - 1500], generator=torch.Generator().manual_seed(0))

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=256)


def main() -> None:
    if len(sys.argv) > 1:  # LightningCLI: python examples/drop_in.py fit --trainer.strategy crossbow
        LightningCLI(DigitsModel, DigitsData)
        return
    L.seed_everything(0)
    trainer = L.Trainer(strategy="crossbow", max_epochs=5, logger=False, enable_checkpointing=False)  # CROSSBOW (2/2)
    model = DigitsModel()
    trainer.fit(model, DigitsData())
    print(f"RESULT val_acc={float(trainer.callback_metrics['val_acc']):.4f}")


if __name__ == "__main__":
    main()
