"""Example models: an ordinary LightningModule classifier around a small network."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torchmetrics
from torch import Tensor, nn


def conv1d_net(in_features: int = 40, num_classes: int = 10, channels: int = 25) -> nn.Module:
    """The MNIST-1D paper's CNN (Greydanus, 2020): three stride-2 convolutions with ReLU, then a linear layer."""
    length = in_features
    for kernel in (5, 3, 3):  # output length of a stride-2 convolution with padding 1
        length = (length + 2 - kernel) // 2 + 1
    return nn.Sequential(
        nn.Unflatten(1, (1, in_features)),
        nn.Conv1d(1, channels, 5, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv1d(channels, channels, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv1d(channels, channels, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(channels * length, num_classes),
    )


def mlp(in_features: int = 40, num_classes: int = 10, hidden: int = 128, depth: int = 2) -> nn.Module:
    """A ReLU multi-layer perceptron."""
    layers: list[nn.Module] = []
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    return nn.Sequential(*layers, nn.Linear(width, num_classes))


def lenet5(num_classes: int = 10) -> nn.Module:
    """LeNet-5 for 28x28 grey images (LeCun et al., 1998, with ReLU and max pooling): two 5x5 convolutions of 6 and 16
    channels, each followed by 2x2 max pooling, then three linear layers (61 k parameters)."""
    return nn.Sequential(
        nn.Conv2d(1, 6, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 5 * 5, 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, num_classes),
    )


class _BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual connection (He et al., 2016)."""

    def __init__(self, channels_in: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels, 1, stride=stride, bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet20(num_classes: int = 10) -> nn.Module:
    """ResNet-20 for 32x32 images (He et al., 2016, section 4.2): three stages of three basic blocks with
    16, 32 and 64 channels, then global average pooling and a linear layer (0.27 M parameters)."""
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
    channels_in = 16
    for channels, stride in ((16, 1), (32, 2), (64, 2)):
        for block in range(3):
            layers.append(_BasicBlock(channels_in, channels, stride if block == 0 else 1))
            channels_in = channels
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes))


class Classifier(L.LightningModule):
    """Cross-entropy classification with SGD (momentum) and an optional step LR schedule.

    Nothing here knows about crossbow: this is the module a user already has.
    """

    def __init__(
        self,
        net: nn.Module,
        num_classes: int = 10,
        lr: float = 0.01,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        lr_milestones: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["net"])
        self.net = net
        self.val_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
        self.test_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_accuracy(logits, y)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", self.val_accuracy, prog_bar=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.test_accuracy(self(x), y)
        self.log("test_acc", self.test_accuracy)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        optimizer = torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
        if not hp.lr_milestones:
            return optimizer
        scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=list(hp.lr_milestones), gamma=0.1)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}
