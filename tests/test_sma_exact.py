"""Crossbow inside Lightning reproduces an independent SMA reference loop, value for value."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_crossbow import CrossbowStrategy
from tests.helpers import (
    Classifier,
    ReplicaSnapshot,
    assert_one_replica_is_plain_lightning,
    loader,
    make_data,
    make_net,
    make_optimizer,
    reference_sma,
    trainer,
)

CASES = [
    # k, optimizer, alpha, central_momentum, engine
    (1, "sgd", None, 0.9, "auto"),
    (2, "sgd", None, 0.9, "fused"),
    (2, "sgd", None, 0.9, "sequential"),
    (4, "sgd", None, 0.9, "fused"),
    (4, "sgd", 0.1, 0.5, "sequential"),
    (4, "adam", None, 0.9, "fused"),
    (4, "adam", 0.3, 0.0, "sequential"),
    (2, "sgd_nesterov_wd", 0.2, 0.7, "fused"),
]


@pytest.mark.parametrize(("k", "optimizer", "alpha", "mu", "engine"), CASES)
def test_matches_reference_across_epochs(k: int, optimizer: str, alpha, mu: float, engine: str) -> None:
    dataset = make_data(num_samples=80)  # 10 batches of 8: with k=4 two batches per epoch are skipped
    epochs = 2
    model = Classifier(optimizer=optimizer)
    snapshot = ReplicaSnapshot()
    strategy = CrossbowStrategy(algorithm="sma", replicas_per_device=k, alpha=alpha, central_momentum=mu, engine=engine)
    trainer(strategy=strategy, max_epochs=epochs, callbacks=[snapshot]).fit(model, loader(dataset))

    batches = list(loader(dataset))
    z, learners = reference_sma(
        make_net(),
        batches,
        k,
        epochs,
        lambda params: make_optimizer(optimizer, params, 0.1),
        alpha=alpha if alpha is not None else 1.0 / k,
        mu=mu,
    )
    for (name, param), expected in zip(model.net.named_parameters(), z):
        torch.testing.assert_close(param.detach(), expected, msg=f"z differs in {name}")
    for index, (name, stacked) in enumerate(snapshot.params.items()):
        for j in range(k):
            torch.testing.assert_close(stacked[j], learners[j][index], msg=f"replica {j} differs in {name}")


def test_an_optimizer_asking_for_fused_kernels_matches_the_reference_with_a_warning() -> None:
    """PyTorch's fused kernels step the stacked (non-contiguous) parameters wrongly: at k > 1 crossbow runs the
    optimizer without them, and says so; the reference steps each learner's own contiguous tensors, fused."""
    dataset, k = make_data(num_samples=48), 3
    model, snapshot = Classifier(optimizer="adam_fused"), ReplicaSnapshot()
    strategy = CrossbowStrategy(algorithm="sma", replicas_per_device=k)
    with pytest.warns(UserWarning, match=r"Adam\(fused=True\) steps non-contiguous parameters wrongly"):
        trainer(strategy=strategy, max_epochs=2, callbacks=[snapshot]).fit(model, loader(dataset))
    batches = list(loader(dataset))
    z, learners = reference_sma(
        make_net(), batches, k, 2, lambda params: make_optimizer("adam_fused", params, 0.1), alpha=1.0 / k, mu=0.9
    )
    for (name, param), expected in zip(model.net.named_parameters(), z):
        torch.testing.assert_close(param.detach(), expected, msg=f"z differs in {name}")
    for index, (name, stacked) in enumerate(snapshot.params.items()):
        for j in range(k):
            torch.testing.assert_close(stacked[j], learners[j][index], msg=f"replica {j} differs in {name}")
    assert_one_replica_is_plain_lightning(lambda: Classifier(optimizer="adam_fused"), dataset)  # (fused kept)


class _AsksForFusedKernels(Classifier):
    def __init__(self, optimizer: str, fused: bool) -> None:
        super().__init__()
        self.kind, self.fused = optimizer, fused

    def configure_optimizers(self) -> Any:
        if self.kind == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, fused=self.fused)
        return torch.optim.Adam(self.parameters(), lr=0.01, fused=self.fused)


@pytest.mark.parametrize(
    "accelerator",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_fused_kernels_turned_off_under_a_gradient_scaler_train_as_an_optimizer_without_them(
    optimizer: str, accelerator: str
) -> None:
    """Under float16 mixed precision the gradient scaler hands its scale to an optimizer with fused kernels, and
    unscales the gradients itself for any other (whose step refuses a scale). With ``fused=True`` turned off at
    k > 1, the run is the run of an optimizer that never asked for fused kernels. (On CPU, Lightning's
    ``precision="16-mixed"`` becomes bf16 without a scaler: the plugin is given its CPU scaler here.)"""
    runs = {}
    for fused in (True, False):
        snapshot = ReplicaSnapshot()
        scaler = torch.amp.GradScaler(accelerator)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit = trainer(
                accelerator=accelerator,
                strategy=CrossbowStrategy(replicas_per_device=3),
                plugins=[MixedPrecision("16-mixed", accelerator, scaler=scaler)],
                max_epochs=2,
                callbacks=[snapshot],
            )
            fit.fit(_AsksForFusedKernels(optimizer, fused), loader(make_data(num_samples=96)))
        assert [group["fused"] for group in fit.optimizers[0].param_groups] == [False]
        assert scaler.get_scale() > 1.0  # the scaler was at work
        runs[fused] = snapshot.params
    for name, value in runs[False].items():
        assert torch.isfinite(value).all(), name
        torch.testing.assert_close(runs[True][name], value, rtol=0, atol=0, msg=f"replicas differ in {name}")


def test_a_checkpoint_asking_for_fused_kernels_resumes_without_them(tmp_path: Path) -> None:
    plain = trainer(max_epochs=1)
    plain.fit(Classifier(optimizer="adam_fused"), loader(make_data(num_samples=48)))
    plain.save_checkpoint(tmp_path / "plain.ckpt")
    resumed = trainer(strategy=CrossbowStrategy(replicas_per_device=3), max_epochs=2)
    with pytest.warns(UserWarning, match=r"Adam\(fused=True\) steps non-contiguous"):
        resumed.fit(
            Classifier(optimizer="adam_fused"), loader(make_data(num_samples=48)), ckpt_path=tmp_path / "plain.ckpt"
        )
    assert [group["fused"] for group in resumed.optimizers[0].param_groups] == [False]
    resumed.save_checkpoint(tmp_path / "crossbow.ckpt")  # (over the module's parameters: as the user made it)
    saved = torch.load(tmp_path / "crossbow.ckpt", weights_only=False)["optimizer_states"][0]
    assert [group["fused"] for group in saved["param_groups"]] == [True]


class _ReplicasAfterFirstStep(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.replicas = {n: p.detach().clone() for n, p in trainer.strategy.stack.params.items()}


def test_alpha_one_over_k_without_momentum_makes_z_the_mean_of_pre_step_replicas() -> None:
    """The sum-not-mean property of the rule: with alpha=1/K, mu=0, z_next = mean_j w_j (pre-step)."""
    dataset = make_data(num_samples=64)  # 8 batches of 8 = two steps of k=4
    model = Classifier()
    initial = [p.detach().clone() for p in model.net.parameters()]
    capture = _ReplicasAfterFirstStep()
    strategy = CrossbowStrategy(algorithm="sma", replicas_per_device=4, central_momentum=0.0)
    trainer(strategy=strategy, max_steps=2, callbacks=[capture]).fit(model, loader(dataset))
    assert model.trainer.global_step == 2
    for (name, param), before in zip(model.net.named_parameters(), initial):
        assert not torch.equal(param.detach(), before)
        torch.testing.assert_close(param.detach(), capture.replicas["net." + name].mean(0))


def _tied_net() -> torch.nn.Module:
    torch.manual_seed(0)
    first, second = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)
    second.weight = first.weight  # one tensor under two names: net.0.weight and net.2.weight
    return torch.nn.Sequential(first, torch.nn.Tanh(), second, torch.nn.Tanh(), torch.nn.Linear(6, 3))


class _TiedClassifier(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net = _tied_net()


@pytest.mark.parametrize("engine", ["fused", "sequential"])
def test_tied_weights_stay_one_tensor_per_replica(engine: str) -> None:
    """A parameter shared by two layers is one learner parameter: both layers read replica j's copy."""
    dataset = make_data(num_samples=32)
    model = _TiedClassifier()
    strategy = CrossbowStrategy(algorithm="sma", replicas_per_device=2, engine=engine)
    trainer(strategy=strategy, max_epochs=1).fit(model, loader(dataset))
    assert model.net[0].weight is model.net[2].weight

    z, _ = reference_sma(
        _tied_net(), list(loader(dataset)), 2, 1, lambda params: make_optimizer("sgd", params, 0.1), alpha=0.5, mu=0.9
    )
    for (name, param), expected in zip(model.net.named_parameters(), z, strict=True):
        torch.testing.assert_close(param.detach(), expected, msg=f"z differs in {name}")
