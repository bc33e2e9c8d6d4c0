"""Example data, generated or loaded offline: MNIST-1D (mnist1d.make_dataset) and scikit-learn's digits."""

from __future__ import annotations

from typing import Optional

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset


class ArrayDataModule(L.LightningDataModule):
    """Train / validation / test splits of arrays, standardised with the training statistics."""

    num_features: int
    num_classes: int

    def __init__(self, batch_size: int = 16, val_fraction: float = 0.1, shuffle: bool = True, seed: int = 0) -> None:
        super().__init__()
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"data.batch_size must be a positive int, got {batch_size!r}.")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {val_fraction!r}.")
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.shuffle = shuffle
        self.seed = seed
        self._splits: Optional[dict[str, TensorDataset]] = None

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(x_train, y_train, x_test, y_test)."""
        raise NotImplementedError

    def setup(self, stage: Optional[str] = None) -> None:
        if self._splits is not None:
            return
        x, y, x_test, y_test = self.arrays()
        order = np.random.default_rng(self.seed).permutation(len(x))
        n_val = int(len(x) * self.val_fraction)
        val, train = order[:n_val], order[n_val:]
        mean, std = x[train].mean(0), x[train].std(0) + 1e-8  # (the training split's alone: no validation leaks in)
        tensors = lambda a, b: TensorDataset(  # noqa: E731
            torch.as_tensor((a - mean) / std, dtype=torch.float32), torch.as_tensor(b, dtype=torch.long)
        )
        self._splits = {"train": tensors(x[train], y[train]), "val": tensors(x[val], y[val]), "test": tensors(x_test, y_test)}

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self._splits["train"], batch_size=self.batch_size, shuffle=self.shuffle, generator=generator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._splits["val"], batch_size=256)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self._splits["test"], batch_size=256)


class MNIST1D(ArrayDataModule):
    """MNIST-1D (Greydanus 2020), generated offline by the mnist1d package: 4000 train, 1000 test, 40 features."""

    num_features, num_classes = 40, 10

    def __init__(self, num_samples: int = 5000, data_seed: int = 42, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_samples = num_samples
        self.data_seed = data_seed

    def arrays(self):
        from mnist1d.data import get_dataset_args, make_dataset

        args = get_dataset_args()
        args.num_samples, args.seed = self.num_samples, self.data_seed
        data = make_dataset(args)
        return data["x"], data["y"], data["x_test"], data["y_test"]


class Digits(ArrayDataModule):
    """scikit-learn's bundled 8x8 digits (1797 images, 64 features), 20% held out for testing."""

    num_features, num_classes = 64, 10

    def arrays(self):
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        order = np.random.default_rng(1234).permutation(len(x))
        n_test = len(x) // 5
        test, train = order[:n_test], order[n_test:]
        return x[train], y[train], x[test], y[test]
