"""Small models, data and an independent SMA reference for the tests."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional, Union

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_crossbow  # noqa: F401  (registers "crossbow")
from lightning_crossbow import CrossbowStrategy


def make_data(num_samples: int = 80, features: int = 6, classes: int = 3, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, features, generator=generator)
    y = torch.randint(0, classes, (num_samples,), generator=generator)
    return TensorDataset(x, y)


def make_net(features: int = 6, classes: int = 3, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, 8), nn.Tanh(), nn.Linear(8, classes))


class Classifier(L.LightningModule):
    """A plain LightningModule: what a user has before adding crossbow."""

    def __init__(self, optimizer: str = "sgd", lr: float = 0.1, seed: int = 0, scheduler: Optional[str] = None):
        super().__init__()
        self.save_hyperparameters()
        self.net = make_net(seed=seed)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self) -> Any:
        optimizer = make_optimizer(self.hparams.optimizer, self.parameters(), self.hparams.lr)
        if self.hparams.scheduler == "step":
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}
        return optimizer


class BranchesOnTheData(L.LightningModule):
    """A layer ``extra`` that a batch goes through only where its first input is positive (a branch on the data:
    in one step some replicas use it and others not), trained with momentum and weight decay."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.extra, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor, through_extra: bool) -> Tensor:
        hidden = torch.tanh(self.a(x))
        return self.head(torch.tanh(self.extra(hidden)) if through_extra else hidden)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x, bool(x[0, 0] > 0)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)


def make_optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "sgd_nesterov_wd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, nesterov=True, weight_decay=1e-2)
    if name == "plain_sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr * 0.1)
    if name == "adam_fused":  # (PyTorch's fused kernels: right on contiguous parameters only)
        return torch.optim.Adam(params, lr=lr * 0.1, fused=True)
    raise ValueError(name)


def trainer(**kwargs: Any) -> L.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)


def loader(dataset: TensorDataset, batch_size: int = 8, shuffle: bool = False, **kwargs: Any) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, **kwargs)


class ResumableLoader(DataLoader):
    """A DataLoader that saves its place in the pass (``state_dict``), as torchdata's ``StatefulDataLoader`` does:
    Lightning saves it in a mid-epoch checkpoint and a resumed fit goes on from the next batch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches_yielded = 0
        self._skip = 0

    def __iter__(self) -> Any:
        batches = super().__iter__()
        for _ in range(self._skip):
            next(batches)
        self.batches_yielded, self._skip = self._skip, 0
        for batch in batches:
            self.batches_yielded += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"batches_yielded": self.batches_yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = state["batches_yielded"]


class BatchesSeen(L.Callback):
    """The inputs of every batch trained, per epoch, in order (a crossbow step's group batch by batch)."""

    def __init__(self) -> None:
        self.epochs: dict[int, list[Tensor]] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        group = batch if isinstance(trainer.strategy, CrossbowStrategy) else [batch]
        self.epochs.setdefault(trainer.current_epoch, []).extend(x for x, _ in group)


class ReplicaSnapshot(L.Callback):
    """Keeps a copy of the strategy's replica state at the end of training (teardown frees it)."""

    state: Optional[dict[str, Any]] = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.state = trainer.strategy.stack.state_dict()
        self.params = {n: p.detach().clone() for n, p in trainer.strategy.stack.params.items()}


#: Per process, the batches of one epoch; or a function of the epoch returning them.
WorldBatches = Union[
    Sequence[Sequence[tuple[Tensor, Tensor]]], Callable[[int], Sequence[Sequence[tuple[Tensor, Tensor]]]]
]


def reference_sma(
    net: nn.Module,
    batches: Sequence[tuple[Tensor, Tensor]],
    k: int,
    epochs: int,
    make_opt: Callable[[Any], torch.optim.Optimizer],
    alpha: float,
    mu: float,
    world_batches: Optional[WorldBatches] = None,
) -> tuple[list[Tensor], list[list[Tensor]]]:
    """Crossbow's SMA written out plainly: K separate models and optimizers, one loop per learner.

    ``world_batches`` (one batch list per process, or a function of the epoch giving them) makes
    ``K = k x len(world_batches)`` learners; the learners of process ``r`` are ``r*k .. r*k+k-1``.
    Returns z and every learner's weights.
    """

    def step(learners, optimizers, step_batches, z, z_prev, epochs_done):  # noqa: ANN001, ANN202
        return reference_sma_step(learners, optimizers, step_batches, z, z_prev, alpha, mu)

    return reference_run(net, batches, k, epochs, make_opt, step, world_batches)


def reference_run(
    net: nn.Module,
    batches: Sequence[tuple[Tensor, Tensor]],
    k: int,
    epochs: int,
    make_opt: Callable[[Any], torch.optim.Optimizer],
    step: Callable[..., tuple[list[Tensor], list[Tensor]]],
    world_batches: Optional[WorldBatches] = None,
) -> tuple[list[Tensor], list[list[Tensor]]]:
    """Runs ``step(learners, optimizers, batches, z, z_prev, epochs_done) -> (z, z_prev)`` over the epochs.

    K separate models and optimizers; learner ``i = r*k + j`` of process ``r`` takes that process's
    ``j``-th batch of each group of ``k``. Returns z and every learner's weights.
    """

    def batches_of(epoch: int) -> Sequence[Sequence[tuple[Tensor, Tensor]]]:
        if world_batches is None:
            return [batches]
        return world_batches(epoch) if callable(world_batches) else world_batches

    per_process = batches_of(0)
    learners = [copy.deepcopy(net) for _ in range(k * len(per_process))]
    optimizers = [make_opt(m.parameters()) for m in learners]
    z = [p.detach().clone() for p in net.parameters()]
    z_prev = [t.clone() for t in z]
    steps_per_epoch = len(per_process[0]) // k
    for epoch in range(epochs):
        per_process = batches_of(epoch)
        for index in range(steps_per_epoch):
            step_batches = [
                per_process[process][index * k + j] for process, j in (divmod(i, k) for i in range(len(learners)))
            ]
            z, z_prev = step(learners, optimizers, step_batches, z, z_prev, epoch + (index + 1) / steps_per_epoch)
    return z, [[p.detach() for p in m.parameters()] for m in learners]


class ReferenceScaledAveraging:
    """Scaled averaging written out plainly, one step at a time; keeps the gain's moving averages.

    Every learner starts the step at z and takes one step of its own optimizer; ``d_i = w_i - z``;
    ``z <- z + eta * mean_i d_i + mu (z - z_prev)``. For ``"adaptive"``, eta is AdaScale's gain
    ``(s2 + g2) / (s2/K + g2)`` clamped to [1, K], from moving averages (weight ``beta``) of the sample
    variance ``s2 = 1/(K-1) sum_i |d_i - mean d|^2`` and of ``g2 = |mean d|^2 - s2/K``.
    """

    def __init__(self, outer_lr: Union[str, float], mu: float = 0.0, warmup_epochs: float = 0.0, beta: float = 0.9):
        self.outer_lr, self.mu, self.warmup_epochs, self.beta = outer_lr, mu, warmup_epochs, beta
        self.s2 = self.g2 = 0.0

    def eta(self, displacements: list[list[Tensor]], epochs_done: float) -> float:
        count = len(displacements)
        if self.outer_lr == "linear":
            target = float(count)
        elif self.outer_lr == "adaptive":
            flat = torch.stack([torch.cat([t.double().flatten() for t in d]) for d in displacements])
            mean = flat.mean(0)
            s2 = float(((flat - mean) ** 2).sum()) / (count - 1) if count > 1 else 0.0
            g2 = float((mean**2).sum()) - s2 / count
            self.s2 = self.beta * self.s2 + (1 - self.beta) * s2
            self.g2 = self.beta * self.g2 + (1 - self.beta) * g2
            g2 = max(self.g2, 0.0)
            target = 1.0 if self.s2 <= 0 else min(max((self.s2 + g2) / (self.s2 / count + g2), 1.0), float(count))
        else:
            target = float(self.outer_lr)
        if self.warmup_epochs > 0:
            target = 1 + (target - 1) * min(1.0, epochs_done / self.warmup_epochs)
        return target

    def __call__(self, learners, optimizers, batches, z, z_prev, epochs_done):  # noqa: ANN001, ANN204
        with torch.no_grad():
            for model in learners:
                for w, zc in zip(model.parameters(), z):
                    w.copy_(zc)
        for model, optimizer, (x, y) in zip(learners, optimizers, batches, strict=True):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        with torch.no_grad():
            displacements = [[w - zc for w, zc in zip(m.parameters(), z)] for m in learners]
            eta = self.eta_used = self.eta(displacements, epochs_done)
            mean = [sum(d[i] for d in displacements) / len(learners) for i in range(len(z))]
            new_z = [zc + eta * m + self.mu * (zc - zp) for zc, m, zp in zip(z, mean, z_prev)]
            for model in learners:
                for w, zc in zip(model.parameters(), new_z):
                    w.copy_(zc)
        return new_z, z


def reference_sma_step(
    learners: Sequence[nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    batches: Sequence[tuple[Tensor, Tensor]],
    z: list[Tensor],
    z_prev: list[Tensor],
    alpha: float,
    mu: float,
) -> tuple[list[Tensor], list[Tensor]]:
    """One SMA step written out: learner i trains on ``batches[i]``; returns the new (z, z_prev)."""
    corrections = [[alpha * (w.detach() - zc) for w, zc in zip(m.parameters(), z)] for m in learners]
    for model, optimizer, (x, y) in zip(learners, optimizers, batches, strict=True):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    with torch.no_grad():
        for model, c in zip(learners, corrections):
            for w, cw in zip(model.parameters(), c):
                w -= cw
        new_z = [zc + sum(c[i] for c in corrections) + mu * (zc - zp) for i, (zc, zp) in enumerate(zip(z, z_prev))]
    return new_z, z


class ReferenceGossip:
    """Gossip written out plainly: each learner steps, then ``w_i <- (w_i + w_{(i+s) mod K}) / 2`` with the
    shift ``s = 1 + (t mod (K-1))`` at step ``t``; z is the learners' mean."""

    def __init__(self) -> None:
        self.t = 0

    def __call__(self, learners, optimizers, batches, z, z_prev, epochs_done):  # noqa: ANN001, ANN204
        for model, optimizer, (x, y) in zip(learners, optimizers, batches, strict=True):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        count = len(learners)
        shift = 1 + self.t % (count - 1)
        self.t += 1
        with torch.no_grad():
            old = [[w.clone() for w in m.parameters()] for m in learners]
            for i, model in enumerate(learners):
                for w, mine, peer in zip(model.parameters(), old[i], old[(i + shift) % count]):
                    w.copy_((mine + peer) / 2)
            mean = [sum(ws) / count for ws in zip(*(list(m.parameters()) for m in learners))]
        return mean, z


@contextmanager
def seed_environment_kept() -> Iterator[None]:
    """``seed_everything`` inside the block sets ``PL_GLOBAL_SEED`` (and ``PL_SEED_WORKERS``) in ``os.environ``, where
    later tests' processes would read it (Lightning's DistributedSampler seeds from it): they are as before after."""
    saved = {name: os.environ.get(name) for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def assert_one_replica_is_plain_lightning(
    make_model: Callable[[], L.LightningModule],
    dataset: TensorDataset,
    epochs: int = 2,
    callbacks: Callable[[], list] = list,
    seed: Optional[int] = None,
    shuffle: bool = False,
    **trainer_kwargs: Any,
) -> None:
    """Trains ``make_model()`` with plain Lightning and with crossbow at k=1 on ``dataset`` (each with its own
    ``callbacks()`` and the same ``trainer_kwargs``; with ``seed``, ``seed_everything(seed)`` right before the model
    is made); the two end with bitwise the same parameters."""
    models = []
    with seed_environment_kept():
        for strategy in ("auto", CrossbowStrategy(replicas_per_device=1)):
            if seed is not None:
                L.seed_everything(seed, verbose=False)
            model = make_model()
            trainer(strategy=strategy, max_epochs=epochs, callbacks=callbacks(), **trainer_kwargs).fit(
                model, loader(dataset, shuffle=shuffle)
            )
            models.append(model)
    plain, crossbow = models
    for a, b in zip(plain.parameters(), crossbow.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
