"""Unchanged LightningModules keep working: data, schedulers, checkpoints, logging, metrics, layers."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import warnings
from typing import Any, Optional

import lightning as L
import pytest
import torch
import torchmetrics
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, SequentialSampler, TensorDataset

from lightning_crossbow import CrossbowStrategy
from lightning_crossbow.data import ReplicaBatchLoader, ReplicaGroup
from lightning_crossbow.engines import FusedEngine, MetricSnapshots, NotFusableError, SequentialEngine, _stack_batches
from lightning_crossbow.log_capture import LogCapture
from lightning_crossbow.optim import clip_grad_norm_per_replica_
from lightning_crossbow.replicas import ReplicaStack
from tests.helpers import (
    BranchesOnTheData,
    Classifier,
    ReplicaSnapshot,
    assert_one_replica_is_plain_lightning,
    loader,
    make_data,
    trainer,
)


# ------------------------------------------------------------------------------------------ data
def test_replica_batch_loader_groups_consecutive_batches_and_drops_an_incomplete_group() -> None:
    grouped = ReplicaBatchLoader(list(range(10)), 4)
    assert list(grouped) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(grouped) == 2 and grouped.dropped_batches() == 2


def test_one_process_keeps_the_users_loader_and_sampler() -> None:
    model = Classifier()
    t = trainer(strategy=CrossbowStrategy(replicas_per_device=2), max_steps=1)
    t.fit(model, loader(make_data()))
    assert isinstance(t.train_dataloader, ReplicaBatchLoader)
    assert isinstance(t.train_dataloader.loader.sampler, SequentialSampler)
    assert t.num_training_batches == 5  # 10 batches / k=2


def test_an_incomplete_last_group_is_announced() -> None:
    with pytest.warns(UserWarning, match=r"10 batches, not a multiple of replicas_per_device=4; the last 2"):
        trainer(strategy=CrossbowStrategy(replicas_per_device=4), max_steps=1).fit(Classifier(), loader(make_data()))


def test_a_ragged_last_batch_runs_sequentially_in_the_fused_engine() -> None:
    dataset = make_data(num_samples=60)  # batches of 8: the 8th has 4 samples
    model, snapshot = Classifier(), ReplicaSnapshot()
    trainer(strategy=CrossbowStrategy(replicas_per_device=4, engine="fused"), callbacks=[snapshot]).fit(
        model, loader(dataset)
    )
    assert model.trainer.global_step == 2 and torch.isfinite(next(model.parameters())).all()


@pytest.mark.parametrize("kind", [tuple, list])
def test_tuple_and_list_batches_of_tensors_stack_per_position_into_the_same_kind(kind: type) -> None:
    batches = [kind((torch.randn(4, 3), torch.randint(0, 5, (4,)), torch.randn(2))) for _ in range(3)]
    stacked = _stack_batches(batches)
    assert type(stacked) is kind
    for position, column in enumerate(stacked):
        assert column.shape == (3, *batches[0][position].shape)
        for replica, batch in enumerate(batches):
            assert torch.equal(column[replica], batch[position])


@pytest.mark.parametrize(
    "other",
    [
        (torch.randn(5, 3), torch.zeros(4, dtype=torch.long)),  # another shape
        (torch.randn(4, 3), torch.zeros(4, dtype=torch.int32)),  # another dtype
        [torch.randn(4, 3), torch.zeros(4, dtype=torch.long)],  # a list beside tuples
        (torch.randn(4, 3),),  # fewer tensors
    ],
    ids=["shape", "dtype", "kind", "length"],
)
def test_batches_that_differ_do_not_stack(other: Any) -> None:
    first = (torch.randn(4, 3), torch.zeros(4, dtype=torch.long))
    assert _stack_batches([first, other]) is None


def test_a_tuple_batch_with_a_shared_non_tensor_value_stacks_its_tensors_and_shares_the_value() -> None:
    batches = [(torch.randn(4, 3), "tag"), (torch.randn(4, 3), "tag")]
    x, tag = _stack_batches(batches)
    assert torch.equal(x, torch.stack([b[0] for b in batches])) and tag == "tag"
    assert _stack_batches([(torch.randn(4, 3), "tag"), (torch.randn(4, 3), "other")]) is None


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_group_of_tuple_or_list_batches_moves_as_lightnings_default_hook_moves_it(device: str) -> None:
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=2), max_steps=1)
    fit.fit(Classifier(), loader(make_data(num_samples=16)))
    for kind in (tuple, list):
        group = ReplicaGroup(kind((torch.randn(3, 2), torch.arange(3))) for _ in range(2))
        moved = fit.strategy.batch_to_device(group, torch.device(device))
        expected = move_data_to_device(group, torch.device(device))
        assert type(moved) is ReplicaGroup and len(moved) == 2
        for batch, batch_expected in zip(moved, expected, strict=True):
            assert type(batch) is kind
            for tensor, tensor_expected in zip(batch, batch_expected, strict=True):
                assert tensor.device == tensor_expected.device and tensor.dtype == tensor_expected.dtype
                if device == "cpu":
                    assert torch.equal(tensor, tensor_expected)


class _TransferHooks(Classifier):
    """Batch-transfer hooks that change the batch; each records the batch it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, Any]] = []

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y = batch
        self.seen.append(("before", tuple(x.shape)))
        return x * 2, y

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        x, y = batch
        self.seen.append(("transfer", tuple(x.shape)))
        return x.to(device), y.to(device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y = batch
        self.seen.append(("after", tuple(x.shape)))
        return x + 1, y


def test_batch_transfer_hooks_see_one_batch_at_a_time() -> None:
    """As in plain Lightning, each hook gets one (x, y) batch, the three of them batch by batch in plain Lightning's
    order, and training sees what the hooks return."""
    model, hooked = _TransferHooks(), ReplicaSnapshot()
    trainer(strategy=CrossbowStrategy(replicas_per_device=2, algorithm="sma"), callbacks=[hooked]).fit(
        model, loader(make_data())
    )
    plain_lightning = _TransferHooks()
    trainer().fit(plain_lightning, loader(make_data()))
    assert model.seen == plain_lightning.seen == [("before", (8, 6)), ("transfer", (8, 6)), ("after", (8, 6))] * 10
    assert "_on_before_batch_transfer" not in vars(model)  # the fit's per-batch dispatch is gone afterwards
    data = make_data()
    transformed, plain = TensorDataset(data.tensors[0] * 2 + 1, data.tensors[1]), ReplicaSnapshot()
    trainer(strategy=CrossbowStrategy(replicas_per_device=2, algorithm="sma"), callbacks=[plain]).fit(
        Classifier(), loader(transformed)
    )
    for name, value in plain.params.items():
        assert torch.equal(hooked.params[name], value), name


class _HookedData(L.LightningDataModule):
    """A datamodule whose batch-transfer hooks record the batches they are given."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, Any]] = []

    def train_dataloader(self) -> DataLoader:
        return loader(make_data())

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.seen.append(("before", tuple(batch[0].shape)))
        return batch

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.seen.append(("after", tuple(batch[0].shape)))
        return batch


def test_a_datamodules_batch_transfer_hooks_see_one_batch_at_a_time() -> None:
    data = _HookedData()
    trainer(strategy=CrossbowStrategy(replicas_per_device=2), max_steps=2).fit(Classifier(), datamodule=data)
    assert data.seen == [("before", (8, 6)), ("after", (8, 6))] * 4  # (plain Lightning's order, batch by batch)


@dataclasses.dataclass
class _Batch:
    """A batch as a dataclass, which Lightning moves to the device and which PyTorch's tree utilities do not open."""

    x: torch.Tensor
    y: torch.Tensor


def _collate_to_dataclass(samples: list[Any]) -> _Batch:
    return _Batch(*torch.utils.data.default_collate(samples))


class _DataclassBatches(Classifier):
    def training_step(self, batch: _Batch, batch_idx: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self(batch.x), batch.y)


def test_a_dataclass_batch_runs_each_group_sequentially_under_the_fused_engine_without_a_fallback() -> None:
    """The fused engine cannot stack a batch it cannot open, nor compare it as one value: those groups run through
    the sequential engine, step by step, and engine="auto" does not blame the training_step."""
    results = {}
    for engine in ("fused", "auto", "sequential"):
        model = _DataclassBatches()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            trainer(strategy=CrossbowStrategy(replicas_per_device=2, engine=engine)).fit(
                model, DataLoader(make_data(), batch_size=8, collate_fn=_collate_to_dataclass)
            )
        assert not [w for w in record if "Falling back" in str(w.message)]
        results[engine] = [p.detach() for p in model.parameters()]
    for engine in ("fused", "auto"):
        for a, b in zip(results[engine], results["sequential"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


class _DictBatches(Classifier):
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        (x,), y = batch["inputs"], batch["meta"]["target"]
        loss = nn.functional.cross_entropy(self(x), y)
        return {"loss": loss, "scaled": 2 * loss.detach()}


class _DictDataset(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.data = make_data()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, Any]:
        x, y = self.data[i]
        return {"inputs": [x], "meta": {"target": y, "tag": "same"}}


@pytest.mark.parametrize("engine", ["fused", "sequential"])
def test_nested_dict_list_batches_and_dict_outputs(engine: str) -> None:
    results = {}
    for name in ("fused", engine):
        model = _DictBatches()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            trainer(strategy=CrossbowStrategy(replicas_per_device=2, engine=name)).fit(
                model, DataLoader(_DictDataset(), batch_size=8)
            )
        assert not [w for w in record if "Falling back" in str(w.message)]
        results[name] = [p.detach() for p in model.parameters()]
    for a, b in zip(results["fused"], results[engine]):
        torch.testing.assert_close(a, b)


class _ReturnsPlainNumbers(Classifier):
    """Returns, beside the loss, plain numbers (a count, None, a list and a dict of them) and a tensor; with
    ``other``, also a value that is neither (a string made from the labels, or a tensor inside a list)."""

    def __init__(self, other: Optional[str] = None) -> None:
        super().__init__()
        self.other = other
        self.outputs: list[dict[str, Any]] = []

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        output = {"loss": loss, "n": len(y), "none": None, "sizes": [len(y), 2], "meta": {"k": None}, "y": y}
        if self.other is not None:
            output["other"] = str(y[:3]) if self.other == "string" else [y]
        return output

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.outputs.append({key: value for key, value in outputs.items() if key != "loss"})


def test_a_dict_output_with_plain_numbers_runs_fused_and_gives_each_replicas_value_as_sequential_does() -> None:
    outputs = {}
    for engine in ("fused", "sequential"):
        model = _ReturnsPlainNumbers()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            trainer(strategy=CrossbowStrategy(replicas_per_device=2, engine=engine), max_steps=2).fit(
                model, loader(make_data())
            )
        assert not [w for w in record if "Falling back" in str(w.message)]
        outputs[engine] = model.outputs
    for fused, sequential in zip(outputs["fused"], outputs["sequential"], strict=True):
        assert list(fused) == list(sequential) == ["n", "none", "sizes", "meta", "y"]  # (in the order returned)
        assert fused["n"] == sequential["n"] == [8, 8] and fused["none"] == sequential["none"] == [None, None]
        assert fused["sizes"] == [[8, 2], [8, 2]] and fused["meta"] == [{"k": None}] * 2
        assert fused["meta"][0] is not fused["meta"][1]  # (each replica's own, as sequential gives)
        for a, b in zip(fused["y"], sequential["y"], strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("other", ["string", "nested tensor"])
def test_a_dict_output_with_other_values_falls_back_and_gives_each_replicas_own(other: str) -> None:
    """A string can be made from a replica's data under vmap (``str(y)`` shows every replica's); a tensor in a list
    cannot leave vmap: both run sequentially, with the reason."""
    model = _ReturnsPlainNumbers(other)
    with pytest.warns(UserWarning, match="values that are neither tensors nor plain numbers"):
        trainer(strategy=CrossbowStrategy(replicas_per_device=2), max_steps=1).fit(model, loader(make_data()))
    replica_1_labels = make_data()[8:16][1]
    expected = str(replica_1_labels[:3]) if other == "string" else [replica_1_labels]
    assert str(model.outputs[0]["other"][1]) == str(expected)


# ------------------------------------------------------------------------------ schedulers
class _ReplicaSpread(Classifier):
    """Records, at the first step of every epoch, how far the replicas are from z (sequential engine)."""

    spread: dict[int, float]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 0:
            bucket = self.trainer.strategy.stack.buckets[0]
            self.spread = getattr(self, "spread", {})
            self.spread.setdefault(self.current_epoch, float((bucket.replicas - bucket.center).abs().max()))
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(("reset", "algorithm"), [(True, "sma"), (False, "sma"), (True, "gossip"), (False, "gossip")])
def test_replicas_reset_to_z_when_the_learning_rate_drops(reset: bool, algorithm: str) -> None:
    model = _ReplicaSpread(scheduler="step")
    k = 3 if algorithm == "gossip" else 2  # (two gossiping learners are always equal)
    strategy = CrossbowStrategy(algorithm=algorithm, replicas_per_device=k, engine="sequential", reset_on_lr_drop=reset)
    trainer(strategy=strategy, max_epochs=3).fit(model, loader(make_data()))
    assert model.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    assert model.spread[0] == 0.0  # replicas start as copies of z
    if reset:
        assert model.spread[1] == 0.0 and model.spread[2] == 0.0
    else:
        assert model.spread[1] > 0.0 and model.spread[2] > 0.0


def test_an_lr_drop_is_a_fall_to_at_most_nine_tenths_after_a_plateau() -> None:
    from lightning_crossbow.strategy import lr_dropped

    assert lr_dropped([0.05], [0.1], [0.1]) and lr_dropped([0.09], [0.1], [0.1])  # a plateau, then a drop
    assert lr_dropped([0.1, 0.0], [0.1, 0.1], [0.1, 0.1])  # (in any param group)
    assert not lr_dropped([0.095], [0.1], [0.1]) and not lr_dropped([0.2], [0.1], [0.1])
    assert not lr_dropped([0.0], [0.0], [0.0])  # a warm-up starting at 0, or a schedule that holds 0
    assert not lr_dropped([0.05], [0.1], [0.15])  # the steep tail of a cosine: the lr changed the step before too
    assert not lr_dropped([0.05], [0.1], None)  # a fit's second step: no plateau seen yet (a per-step decay?)


class _StepSpread(Classifier):
    """Records, at the first micro-batch of every optimizer step, how far the replicas are from z (0: reset)."""

    def __init__(self, scheduler: Any) -> None:
        super().__init__(lr=0.2)
        self.make_scheduler, self.spread = scheduler, {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        bucket = self.trainer.strategy.stack.buckets[0]
        self.spread.setdefault(self.trainer.global_step, float((bucket.replicas - bucket.center).abs().max()))
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": self.make_scheduler(optimizer), "interval": "step"},
        }


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_replicas_reset_only_at_an_lr_drop_after_a_plateau_with_or_without_accumulation(accumulate: int) -> None:
    """A per-step decay (20% a step) never resets the replicas, also at a fit's second step and with gradients
    accumulated over several batches; a step schedule resets them once, at the first optimizer step after its drop."""
    runs = {}
    for name, scheduler in {
        "per-step decay": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8),
        "drop after step 3": lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[3], gamma=0.5),
    }.items():
        model = _StepSpread(scheduler)
        strategy = CrossbowStrategy(replicas_per_device=2, algorithm="sma", engine="sequential")
        trainer(strategy=strategy, accumulate_grad_batches=accumulate, max_steps=6).fit(
            model, loader(make_data(num_samples=2 * 8 * accumulate * 6))
        )
        runs[name] = model.spread
    assert list(runs["per-step decay"]) == list(range(6))
    assert runs["per-step decay"][0] == 0.0  # replicas start as copies of z
    assert all(spread > 0.0 for step, spread in runs["per-step decay"].items() if step > 0)
    assert [step for step, spread in runs["drop after step 3"].items() if spread == 0.0] == [0, 3]


class _Plateau(Classifier):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.1, threshold=10.0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val_loss"}}


class _PerStep(Classifier):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_plateau_and_per_step_schedulers_drive_every_replica() -> None:
    model = _Plateau()
    trainer(strategy=CrossbowStrategy(replicas_per_device=2), max_epochs=2).fit(
        model, loader(make_data()), loader(make_data(seed=1))
    )
    assert model.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-4)
    model = _PerStep()
    trainer(strategy=CrossbowStrategy(replicas_per_device=2), max_epochs=1).fit(model, loader(make_data()))
    assert model.trainer.global_step == 5
    assert model.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 / 6)


# ----------------------------------------------------------------------------- checkpoints
def test_checkpoint_has_the_plain_keys_and_loads_in_plain_lightning(tmp_path) -> None:
    model = Classifier()
    t = trainer(strategy=CrossbowStrategy(replicas_per_device=2), max_epochs=1)
    t.fit(model, loader(make_data()))
    path = tmp_path / "z.ckpt"
    t.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    assert list(checkpoint["state_dict"]) == list(Classifier().state_dict())
    restored = Classifier.load_from_checkpoint(path)
    for a, b in zip(restored.parameters(), model.parameters()):
        assert torch.equal(a, b)
    plain = trainer(strategy="auto").validate(restored, loader(make_data(seed=1)), verbose=False)
    ours = t.validate(model, loader(make_data(seed=1)), verbose=False)
    assert plain[0]["val_loss"] == pytest.approx(ours[0]["val_loss"], abs=1e-6)


@pytest.mark.parametrize(("optimizer", "engine"), [("sgd", "fused"), ("adam", "sequential")])
def test_resume_continues_the_same_trajectory_bitwise(tmp_path, optimizer: str, engine: str) -> None:
    def run(epochs: int, ckpt_path=None, save_to=None):
        model, snapshot = Classifier(optimizer=optimizer, scheduler="step"), ReplicaSnapshot()
        strategy = CrossbowStrategy(replicas_per_device=2, engine=engine)
        t = trainer(strategy=strategy, max_epochs=epochs, callbacks=[snapshot])
        t.fit(model, loader(make_data()), ckpt_path=ckpt_path)
        if save_to:
            t.save_checkpoint(save_to)
        return model, snapshot

    straight, straight_snapshot = run(4)
    run(2, save_to=tmp_path / "half.ckpt")
    resumed, resumed_snapshot = run(4, ckpt_path=tmp_path / "half.ckpt")
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    for name in straight_snapshot.params:
        assert torch.equal(straight_snapshot.params[name], resumed_snapshot.params[name])


def test_resume_with_another_k_reseeds_from_z_with_a_warning(tmp_path) -> None:
    model = Classifier()
    t = trainer(strategy=CrossbowStrategy(replicas_per_device=2), max_epochs=1)
    t.fit(model, loader(make_data()))
    t.save_checkpoint(tmp_path / "k2.ckpt")
    with pytest.warns(UserWarning, match="replicas_per_device=2 x world_size=1 with replicas_per_device=4"):
        trainer(strategy=CrossbowStrategy(replicas_per_device=4), max_epochs=2).fit(
            Classifier(), loader(make_data()), ckpt_path=tmp_path / "k2.ckpt"
        )


# ----------------------------------------------------------------------------- logging, metrics
class _LogsBatchMean(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.log("x_mean", x.mean())
        self.log_dict({"x_max": x.max(), "const": 3.0})
        return nn.functional.cross_entropy(self(x), y)


@pytest.mark.parametrize("engine", ["fused", "sequential"])
def test_logged_values_are_the_mean_over_replicas(engine: str) -> None:
    dataset = make_data(num_samples=32)
    model = _LogsBatchMean()
    t = trainer(strategy=CrossbowStrategy(replicas_per_device=4, engine=engine), max_steps=1)
    t.fit(model, loader(dataset))
    batches = [x for x, _ in loader(dataset)]
    torch.testing.assert_close(t.callback_metrics["x_mean"], torch.stack([x.mean() for x in batches]).mean())
    torch.testing.assert_close(t.callback_metrics["x_max"], torch.stack([x.max() for x in batches]).mean())
    assert float(t.callback_metrics["const"]) == 3.0


class _LogsEpochReductions(Classifier):
    """Logs epoch sums, maxima and minima of statistics of the batch alone (not of the weights)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.log("samples", float(len(y)), on_step=False, on_epoch=True, reduce_fx="sum")
        self.log("label_sum", y.sum().float(), on_step=False, on_epoch=True, reduce_fx=torch.sum)
        self.log("x_max", x.max(), on_step=False, on_epoch=True, reduce_fx="max")
        self.log("x_min", x.min(), on_step=False, on_epoch=True, reduce_fx="min")
        self.log("x_mean", x.mean(), on_step=False, on_epoch=True)
        return nn.functional.cross_entropy(self(x), y)


@pytest.mark.parametrize(("k", "engine"), [(1, "fused"), (2, "fused"), (2, "sequential"), (4, "fused")])
def test_epoch_sums_maxima_and_minima_are_over_every_batch_as_in_plain_lightning(k: int, engine: str) -> None:
    dataset = make_data(num_samples=64)  # 8 batches of 8
    metrics = {}
    for name, strategy in (("plain", "auto"), ("crossbow", CrossbowStrategy(replicas_per_device=k, engine=engine))):
        fit = trainer(strategy=strategy)
        fit.fit(_LogsEpochReductions(), loader(dataset))
        metrics[name] = {key: float(value) for key, value in fit.callback_metrics.items() if "crossbow" not in key}
    x, y = dataset.tensors
    assert metrics["plain"]["samples"] == metrics["crossbow"]["samples"] == 64
    assert metrics["plain"]["label_sum"] == metrics["crossbow"]["label_sum"] == float(y.sum())
    assert metrics["plain"]["x_max"] == metrics["crossbow"]["x_max"] == float(x.max())
    assert metrics["plain"]["x_min"] == metrics["crossbow"]["x_min"] == float(x.min())
    assert metrics["crossbow"]["x_mean"] == pytest.approx(metrics["plain"]["x_mean"], rel=1e-6)


class _SkipsSomeBatchesBeforeLogging(Classifier):
    """Skips (returns None, logging nothing) the batches whose first input is above 0.5; logs the others' mean."""

    def training_step(self, batch: Any, batch_idx: int) -> Optional[torch.Tensor]:
        x, y = batch
        if bool(x[0, 0] > 0.5):
            return None
        self.log("x_mean", x.mean(), on_step=False, on_epoch=True)
        return nn.functional.cross_entropy(self(x), y)


@pytest.mark.parametrize("k", [2, 4])
def test_an_epoch_mean_weighs_a_step_by_the_replicas_that_logged_it(k: int) -> None:
    """Where some replicas skip a step before logging, the step's mean counts for the batches that logged: the
    epoch mean is plain Lightning's mean over every batch that logged."""
    dataset = make_data(num_samples=64)
    x, _ = dataset.tensors
    batches = x.split(8)
    logged = [batch.mean() for batch in batches if not bool(batch[0, 0] > 0.5)]
    assert 0 < len(logged) < len(batches)  # (some batches skip, some log)
    means = {}
    for name, strategy in (
        ("plain", "auto"),
        ("crossbow", CrossbowStrategy(replicas_per_device=k, engine="sequential")),
    ):
        fit = trainer(strategy=strategy)
        fit.fit(_SkipsSomeBatchesBeforeLogging(), loader(dataset))
        means[name] = float(fit.callback_metrics["x_mean"])
    assert means["plain"] == pytest.approx(float(torch.stack(logged).mean()), rel=1e-6)
    assert means["crossbow"] == pytest.approx(means["plain"], rel=1e-6)


class _LogsInputMean(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.log("x_mean", x.mean(), on_epoch=True)
        return nn.functional.cross_entropy(self(x), y)


@pytest.mark.parametrize("engine", ["fused", "sequential"])
def test_an_epoch_mean_weighs_each_batch_of_a_group_by_its_size_as_plain_lightning(engine: str) -> None:
    """60 samples in batches of 8: the last of the 8 batches has 4, in the last group of k=2. Plain Lightning's
    epoch mean weighs each batch by its size (the mean over every sample); so does crossbow's."""
    dataset = make_data(num_samples=60)
    means = {}
    for name, strategy in (("plain", "auto"), ("crossbow", CrossbowStrategy(replicas_per_device=2, engine=engine))):
        fit = trainer(strategy=strategy)
        fit.fit(_LogsInputMean(), loader(dataset))
        means[name] = float(fit.callback_metrics["x_mean_epoch"])
    assert means["plain"] == pytest.approx(float(dataset.tensors[0].mean()), rel=1e-5)
    assert means["crossbow"] == pytest.approx(means["plain"], rel=1e-6)


class _LogsWithBatchSize(Classifier):
    """Logs each batch's mean input with a ``batch_size=`` of its own: the batch's length, or a count that differs
    from batch to batch (tokens that count, say: here the rows whose first feature is positive, plus one)."""

    def __init__(self, size: str) -> None:
        super().__init__()
        self.size = size

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.log("x_mean", x.mean(), on_step=False, on_epoch=True, batch_size=_logged_size(x, self.size))
        return nn.functional.cross_entropy(self(x), y)


def _logged_size(x: Tensor, size: str) -> int:
    return len(x) if size == "length" else int((x[:, 0] > 0).sum()) + 1


@pytest.mark.parametrize(
    ("size", "engine"), [("length", "fused"), ("length", "sequential"), ("count", "sequential"), ("count", "auto")]
)
def test_an_epoch_mean_weighs_each_replica_by_the_batch_size_it_logs_with(size: str, engine: str) -> None:
    """``self.log(..., batch_size=n)`` with the n of each replica's own batch: a short last batch (60 samples in
    batches of 8, the last of 4, in the last group of k=4), or a count that differs from batch to batch. Plain
    Lightning's epoch mean is ``sum_i n_i m_i / sum_i n_i`` over the batches; crossbow's weighed every replica of a
    step by the first one's n."""
    dataset = make_data(num_samples=60)
    batches = [batch for batch, _ in loader(dataset)]
    weights = torch.tensor([float(_logged_size(batch, size)) for batch in batches])
    expected = float((torch.stack([batch.mean() for batch in batches]) * weights).sum() / weights.sum())
    means = {}
    for name, strategy in (
        ("plain", "auto"),
        ("crossbow", CrossbowStrategy(replicas_per_device=4, engine=engine)),
    ):
        fit = trainer(strategy=strategy, max_epochs=1)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "crossbow: the training_step cannot run fused")  # (int() under vmap)
            fit.fit(_LogsWithBatchSize(size), loader(dataset))
        means[name] = float(fit.callback_metrics["x_mean"])
    assert means["plain"] == pytest.approx(expected, rel=1e-5)
    assert means["crossbow"] == pytest.approx(means["plain"], rel=1e-6)


def test_a_replayed_mean_weighs_by_the_replica_values_it_averages_with_an_integer_batch_size() -> None:
    """Every process's running count of a mean keeps Lightning's integer dtype (a float on one process alone would
    break ``sync_dist``'s all-reduce of it), whether all k replicas logged or fewer."""
    logged: list[tuple[str, Any, dict[str, Any]]] = []

    class Recorder(nn.Module):
        def log(self, name: str, value: Any, **kwargs: Any) -> None:
            logged.append((name, value, kwargs))

    module, capture = Recorder(), LogCapture()
    for replica in range(3):  # three replicas log "all"; two of them "some", one with its own batch_size
        with capture.recording(module) as calls:
            module.log("all", torch.tensor(float(replica)), on_epoch=True)
            if replica < 2:
                module.log("some", torch.tensor(1.0), batch_size=5, on_epoch=True)
            module.log("total", torch.tensor(1.0), reduce_fx="sum", on_epoch=True)
            module.log("step_only", torch.tensor(1.0))
        capture.add(calls)
    capture.replay(module, batch_size=lambda: 4)
    by_name = {name: (value, kwargs) for name, value, kwargs in logged}
    assert by_name["all"][1]["batch_size"] == 12 and type(by_name["all"][1]["batch_size"]) is int
    assert float(by_name["all"][0]) == 1.0
    assert by_name["some"][1]["batch_size"] == 10 and type(by_name["some"][1]["batch_size"]) is int
    assert "batch_size" not in by_name["total"][1] and float(by_name["total"][0]) == 3.0
    assert "batch_size" not in by_name["step_only"][1]  # (no epoch mean: Lightning infers nothing for it either)


class _SkipsEveryThirdBatch(Classifier):
    """Logs per-batch epoch aggregates, and skips (returns None from) every third batch."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.log("batch_idx", float(batch_idx), on_step=False, on_epoch=True)
        self.log("logged", 1.0, on_step=False, on_epoch=True, reduce_fx="sum")
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % 3 == 0 else loss


def test_epoch_aggregates_count_skipped_and_trained_steps_alike() -> None:
    """A step whose replicas all return None logs as a trained one does (as one value of training_step's):
    at k=1 the epoch aggregates are plain Lightning's."""
    results = []
    for strategy in (CrossbowStrategy(replicas_per_device=1), "auto"):
        fit = trainer(strategy=strategy)
        fit.fit(_SkipsEveryThirdBatch(), loader(make_data(num_samples=96)))  # 12 batches
        results.append({key: float(value) for key, value in fit.callback_metrics.items() if "/" not in key})
    assert results[0] == results[1]
    assert (results[1]["batch_idx"], results[1]["logged"]) == (5.5, 12.0)


class _WithMetric(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.samples = torchmetrics.SumMetric()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.samples.update(torch.ones_like(y).sum())
        self.log("samples", self.samples, on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)


def test_torchmetrics_in_training_step_falls_back_to_sequential_once_and_counts_every_replica() -> None:
    model = _WithMetric()
    strategy = CrossbowStrategy(replicas_per_device=2)
    with pytest.warns(UserWarning, match=r"cannot run fused under torch.func.vmap \(.+\)\. Falling back") as record:
        trainer(strategy=strategy, max_epochs=1).fit(model, loader(make_data()))
    assert sum("Falling back" in str(w.message) for w in record) == 1
    assert float(model.trainer.callback_metrics["samples"]) == 80  # every replica's samples, counted once

    class WithAccuracy(Classifier):  # (an update that runs under vmap, keeping per-replica state)
        def __init__(self) -> None:
            super().__init__()
            self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=3, validate_args=False)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.accuracy.update(self(batch[0]), batch[1])
            return super().training_step(batch, batch_idx)

    with pytest.raises(RuntimeError, match="updates the torchmetrics metric MulticlassAccuracy, whose state cannot"):
        trainer(strategy=CrossbowStrategy(replicas_per_device=2, engine="fused"), max_steps=1).fit(
            WithAccuracy(), loader(make_data())
        )


class _CountsThenFallsBack(Classifier):
    """Counts its samples with a SumMetric whose update runs under vmap (a number, not the batch, changing the state
    in place), then updates one whose state cannot be batched: engine="auto" falls back at the first step."""

    def __init__(self) -> None:
        super().__init__()
        self.samples = torchmetrics.SumMetric()
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.samples.update(torch.tensor(float(len(y))))
        self.accuracy.update(self(x), y)
        self.log("samples", self.samples, on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)


def test_a_metric_state_changed_in_place_by_the_failed_fused_attempt_is_given_back() -> None:
    """The fallback gives back the state of the metrics as it was: 64 samples counted once each, as
    engine="sequential" counts them (the fused attempt's in-place 8 was kept: 72)."""
    counted = {}
    for engine in ("auto", "sequential"):
        fit = trainer(strategy=CrossbowStrategy(replicas_per_device=4, engine=engine), max_epochs=1)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "crossbow: the training_step cannot run fused")
            fit.fit(_CountsThenFallsBack(), loader(make_data(num_samples=64)))
        counted[engine] = float(fit.callback_metrics["samples"])
    assert counted == {"auto": 64.0, "sequential": 64.0}


def test_a_metric_the_fused_attempt_does_not_use_is_not_copied_and_one_it_uses_is_given_back() -> None:
    """The fallback's snapshot of a metric is taken at its first update or forward within the attempt: a metric
    used in validation alone (a large confusion matrix, say) costs nothing at a training step."""
    used, unused = torchmetrics.SumMetric(), torchmetrics.SumMetric()
    used.update(torch.tensor(1.0))
    own_update = vars(used)["update"]  # (torchmetrics' wrapped update, an instance attribute)
    snapshots = MetricSnapshots([used, unused])
    with snapshots.taken_at_first_use():
        used.update(torch.tensor(5.0))
        used(torch.tensor(2.0))
    assert [metric for metric, _ in snapshots.saved.values()] == [used]
    assert vars(used)["update"] is own_update and "forward" not in vars(used)
    assert float(used.compute()) == 8.0
    snapshots.restore()
    assert float(used.compute()) == 1.0


class _StepMetric(Classifier):
    """Logs a MeanMetric's forward (this batch's mean input) on step and its epoch value; keeps each batch's mean."""

    def __init__(self) -> None:
        super().__init__()
        self.mean_input = torchmetrics.MeanMetric()
        self.batch_means: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.mean_input(x.mean())
        self.log("mean_input", self.mean_input, on_step=True, on_epoch=True)
        self.batch_means.append(float(x.mean()))
        return super().training_step(batch, batch_idx)


class _StepValues(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.values.append(float(trainer.callback_metrics["mean_input_step"]))


def test_a_metric_logged_on_step_logs_the_mean_of_the_replicas_own_values() -> None:
    model, steps = _StepMetric(), _StepValues()
    trainer(strategy=CrossbowStrategy(replicas_per_device=2, engine="sequential"), callbacks=[steps]).fit(
        model, loader(make_data())
    )
    expected = [(a + b) / 2 for a, b in zip(model.batch_means[::2], model.batch_means[1::2], strict=True)]
    assert steps.values == pytest.approx(expected, rel=1e-6)
    epoch = float(model.trainer.callback_metrics["mean_input_epoch"])
    assert epoch == pytest.approx(sum(model.batch_means) / len(model.batch_means), rel=1e-6)  # every replica's


class _BatchNormNet(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def test_batchnorm_statistics_per_replica_and_their_mean_in_z() -> None:
    model, snapshot = _BatchNormNet(), ReplicaSnapshot()
    trainer(strategy=CrossbowStrategy(replicas_per_device=2), callbacks=[snapshot]).fit(model, loader(make_data()))
    stacked_mean = snapshot.state["buffers"]["net.1.running_mean"]
    assert not torch.allclose(stacked_mean[0], stacked_mean[1])
    torch.testing.assert_close(model.net[1].running_mean, stacked_mean.mean(0))
    torch.testing.assert_close(model.net[1].running_var, snapshot.state["buffers"]["net.1.running_var"].mean(0))


class _BuffersSeen(L.Callback):
    """z's buffers as callbacks see them after every step and at every epoch's end, and the replicas' mean then."""

    def __init__(self) -> None:
        self.seen: list[dict[str, torch.Tensor]] = []
        self.replicas_mean: list[dict[str, torch.Tensor]] = []

    def _record(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.seen.append({n: b.clone() for n, b in pl_module.named_buffers()})
        stack = getattr(trainer.strategy, "stack", None)
        if stack is not None:
            self.replicas_mean.append({n: b.float().mean(0) for n, b in stack.buffers.items()})

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._record(trainer, pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record(trainer, pl_module)


def test_callbacks_see_z_s_buffers_as_the_replicas_mean_after_every_step() -> None:
    """Not only at validation or checkpoints: after every step z's BatchNorm statistics are the replicas' mean (and
    with k=1 exactly plain Lightning's, step by step)."""
    model, seen = _BatchNormNet(), _BuffersSeen()
    trainer(strategy=CrossbowStrategy(replicas_per_device=2), max_epochs=2, callbacks=[seen]).fit(
        model, loader(make_data())
    )
    assert len(seen.seen) == 2 * (5 + 1)  # two epochs of five steps (10 batches, k=2), and each epoch's end
    for z, mean in zip(seen.seen, seen.replicas_mean, strict=True):
        torch.testing.assert_close(z["net.1.running_mean"], mean["net.1.running_mean"], rtol=0, atol=0)
        torch.testing.assert_close(z["net.1.running_var"], mean["net.1.running_var"], rtol=0, atol=0)
    assert not torch.equal(seen.seen[0]["net.1.running_mean"], seen.seen[1]["net.1.running_mean"])
    runs = {}
    for name, strategy in {"plain": "auto", "crossbow k=1": CrossbowStrategy(replicas_per_device=1)}.items():
        runs[name] = _BuffersSeen()
        trainer(strategy=strategy, max_epochs=2, callbacks=[runs[name]]).fit(_BatchNormNet(), loader(make_data()))
    assert len(runs["plain"].seen) == len(runs["crossbow k=1"].seen) == 2 * (10 + 1)
    for plain, ours in zip(runs["plain"].seen, runs["crossbow k=1"].seen, strict=True):
        for name in plain:
            assert torch.equal(plain[name], ours[name]), name


class _ScalarAndEmptyBuffers(_BatchNormNet):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inputs_seen", torch.zeros(()))  # a scalar, updated by every replica
        self.register_buffer("nothing", torch.zeros(0))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.inputs_seen.add_(batch[0].mean())
        return super().training_step(batch, batch_idx)


def test_scalar_and_empty_buffers_are_averaged_with_the_others() -> None:
    model, seen = _ScalarAndEmptyBuffers(), _BuffersSeen()
    trainer(strategy=CrossbowStrategy(replicas_per_device=2), callbacks=[seen]).fit(model, loader(make_data()))
    for z, mean in zip(seen.seen, seen.replicas_mean, strict=True):
        assert z["inputs_seen"].shape == () and z["nothing"].shape == (0,)
        torch.testing.assert_close(z["inputs_seen"], mean["inputs_seen"], rtol=0, atol=0)
        torch.testing.assert_close(z["net.1.running_mean"], mean["net.1.running_mean"], rtol=0, atol=0)
    assert seen.seen[-1]["inputs_seen"] != 0


def test_a_weight_averaging_callback_keeps_its_averaged_buffers_at_the_end() -> None:
    """Lightning's EMA callback writes its averaged model into the module at on_train_end, which Lightning calls
    before the strategy's own: with k=1 the final model is plain Lightning's, buffers included."""
    callbacks = pytest.importorskip("lightning.pytorch.callbacks")
    if not hasattr(callbacks, "EMAWeightAveraging"):
        pytest.skip("this Lightning release has no EMAWeightAveraging")
    models = {}
    for name, strategy in {"plain": "auto", "crossbow k=1": CrossbowStrategy(replicas_per_device=1)}.items():
        models[name] = _BatchNormNet()
        trainer(strategy=strategy, max_epochs=2, callbacks=[callbacks.EMAWeightAveraging(decay=0.5)]).fit(
            models[name], loader(make_data())
        )
    plain, ours = models["plain"].state_dict(), models["crossbow k=1"].state_dict()
    assert list(plain) == list(ours)
    for name in plain:
        assert torch.equal(plain[name], ours[name]), name


def test_a_diverged_replica_restarts_from_z_s_buffers_of_the_step_before() -> None:
    x, y = make_data(num_samples=8 * 2 * 4)[:]
    x[8 * 7] = float("nan")  # batch 7 = replica 1 of step 3 (k=2)

    class Probe(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            if trainer.global_step == 3:  # step 2 done
                self.z_before = pl_module.net[1].running_mean.clone()
            if trainer.global_step == 4:  # step 3 done
                self.replicas = trainer.strategy.stack.buffers["net.1.running_mean"].clone()

    probe = Probe()
    with pytest.warns(UserWarning, match="replica 1 on rank 0 has a non-finite loss"):
        trainer(
            strategy=CrossbowStrategy(replicas_per_device=2, engine="sequential"), max_steps=4, callbacks=[probe]
        ).fit(_BatchNormNet(), loader(TensorDataset(x, y)))
    assert probe.z_before.abs().sum() > 0  # (trained statistics, not the initial zeros)
    assert torch.equal(probe.replicas[1], probe.z_before)
    assert torch.isfinite(probe.replicas).all()


class _Dropout(Classifier):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 32), nn.Dropout(p), nn.Linear(32, 3))


@pytest.mark.parametrize("p", [0.0, 0.5])
def test_dropout_draws_differ_per_replica(p: float) -> None:
    x, y = make_data(num_samples=8)[:]
    same_batches = TensorDataset(x.repeat(2, 1), y.repeat(2))  # both replicas get identical batches
    model, snapshot = _Dropout(p), ReplicaSnapshot()
    trainer(
        strategy=CrossbowStrategy(algorithm="sma", replicas_per_device=2, engine="fused"),
        max_steps=1,
        callbacks=[snapshot],
    ).fit(model, loader(same_batches))
    weight = snapshot.params["net.0.weight"]
    assert torch.equal(weight[0], weight[1]) == (p == 0.0)


# ------------------------------------------------------------------------- optimisation knobs
def test_gradient_clipping_applies_per_replica() -> None:
    dataset = make_data(num_samples=16)
    model, snapshot = Classifier(), ReplicaSnapshot()
    initial = {f"net.{n}": p.detach().clone() for n, p in model.net.named_parameters()}
    strategy = CrossbowStrategy(algorithm="sma", replicas_per_device=2)
    trainer(strategy=strategy, max_steps=1, gradient_clip_val=0.01, callbacks=[snapshot]).fit(model, loader(dataset))
    # Independent reference: each replica clips its own gradient, then one SGD step (c_j = 0 at step 1).
    for j, (x, y) in enumerate(loader(dataset)):
        reference = Classifier()
        nn.functional.cross_entropy(reference(x), y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
        for name, p in reference.named_parameters():
            torch.testing.assert_close(snapshot.params[name][j], initial[name] - 0.1 * p.grad)


class _WithTemperature(Classifier):
    """A learnable 0-dim temperature on the scores (CLIP's ``logit_scale``, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x) * self.temperature


def test_gradient_clipping_takes_a_0_dim_parameter_in_each_replicas_norm() -> None:
    """k=1 is plain Lightning bitwise; at k=2 each replica clips its own gradient, the temperature's included (its
    stacked gradient, ``(k,)``, raised "Dimension out of range")."""
    dataset = make_data(num_samples=16)
    ends = []
    for strategy in ("auto", CrossbowStrategy(replicas_per_device=1)):
        model = _WithTemperature()
        trainer(strategy=strategy, max_steps=2, gradient_clip_val=0.01).fit(model, loader(dataset))
        ends.append(model.state_dict())
    assert all(torch.equal(value, ends[1][name]) for name, value in ends[0].items())
    model, snapshot = _WithTemperature(), ReplicaSnapshot()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    strategy = CrossbowStrategy(algorithm="sma", replicas_per_device=2)
    trainer(strategy=strategy, max_steps=1, gradient_clip_val=0.01, callbacks=[snapshot]).fit(model, loader(dataset))
    for j, (x, y) in enumerate(loader(dataset)):  # each replica clips its own gradient, then one SGD step
        reference = _WithTemperature()
        nn.functional.cross_entropy(reference(x), y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
        for name, p in reference.named_parameters():
            torch.testing.assert_close(snapshot.params[name][j], initial[name] - 0.1 * p.grad)


def test_a_gradient_the_replicas_share_counts_in_each_replicas_norm_and_takes_their_mean_scale() -> None:
    stacked = [torch.zeros(3, requires_grad=True), torch.zeros(3, 4, 5, requires_grad=True)]
    shared = torch.zeros(2, requires_grad=True)  # (a tensor the optimizer steps that has no replicas)
    stacked[0].grad, stacked[1].grad, shared.grad = torch.randn(3), torch.randn(3, 4, 5), torch.randn(2)
    before = [t.grad.clone() for t in (*stacked, shared)]
    norms = clip_grad_norm_per_replica_([stacked[0], shared, stacked[1]], stacked, max_norm=2.0)
    for j in range(3):
        squares = float(before[0][j]) ** 2 + float(before[1][j].square().sum()) + float(before[2].square().sum())
        total = math.sqrt(squares)
        assert float(norms[j]) == pytest.approx(total, rel=1e-6)
    scales = [min(1.0, 2.0 / (float(n) + 1e-6)) for n in norms]
    for j, scale in enumerate(scales):
        torch.testing.assert_close(stacked[0].grad[j], before[0][j] * scale)
        torch.testing.assert_close(stacked[1].grad[j], before[1][j] * scale)
    torch.testing.assert_close(shared.grad, before[2] * sum(scales) / 3)


def test_accumulate_grad_batches_accumulates_per_replica() -> None:
    dataset = make_data(num_samples=32)  # 4 batches = 2 groups of k=2 = one optimizer step
    model, snapshot = Classifier(), ReplicaSnapshot()
    initial = {f"net.{n}": p.detach().clone() for n, p in model.net.named_parameters()}
    trainer(
        strategy=CrossbowStrategy(algorithm="sma", replicas_per_device=2),
        accumulate_grad_batches=2,
        callbacks=[snapshot],
    ).fit(model, loader(dataset))
    assert model.trainer.global_step == 1
    batches = list(loader(dataset))
    for j in range(2):
        reference = Classifier()
        for x, y in (batches[j], batches[2 + j]):  # replica j takes the j-th batch of each group
            (nn.functional.cross_entropy(reference(x), y) / 2).backward()
        for name, p in reference.named_parameters():
            torch.testing.assert_close(snapshot.params[name][j], initial[name] - 0.1 * p.grad)


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("engine", ["sequential", "auto"])
def test_a_parameter_a_replicas_loss_does_not_reach_is_not_stepped_for_it_as_plain_lightning_skips_it(
    engine: str, accumulate: int
) -> None:
    """Plain Lightning's optimizer skips a parameter without a gradient (no weight decay, no momentum); so does each
    replica's, for the steps in which its batches did not go through ``extra`` (others' did). Reference: k
    independent modules and optimizers, each starting every step at z, z the mean of their weights after it
    (scaled averaging with outer_lr=1)."""
    k, steps, dataset = 2, 4, make_data(num_samples=8 * 2 * 4 * 2)
    batches = list(loader(dataset))
    through = [bool(x[0, 0] > 0) for x, _ in batches]
    groups = [through[i : i + k * accumulate] for i in range(0, steps * k * accumulate, k * accumulate)]
    assert any(len(set(group)) > 1 for group in groups)  # (the data make replicas differ within a step)
    model = BranchesOnTheData()
    learners = [BranchesOnTheData() for _ in range(k)]
    optimizers = [learner.configure_optimizers() for learner in learners]
    center = [p.detach().clone() for p in model.parameters()]
    for step in range(steps):
        for j, (learner, optimizer) in enumerate(zip(learners, optimizers)):
            with torch.no_grad():
                for p, z in zip(learner.parameters(), center):
                    p.copy_(z)
            optimizer.zero_grad(set_to_none=True)
            for micro in range(accumulate):
                x, y = batches[(step * accumulate + micro) * k + j]
                (learner.training_step((x, y), 0) / accumulate).backward()
            optimizer.step()
        center = [torch.stack(rows).detach().mean(0) for rows in zip(*(list(lr.parameters()) for lr in learners))]
    with pytest.warns(UserWarning, match="Falling back") if engine == "auto" else warnings.catch_warnings():
        trainer(
            strategy=CrossbowStrategy(replicas_per_device=k, engine=engine, outer_lr=1.0),
            max_steps=steps,
            accumulate_grad_batches=accumulate,
        ).fit(model, loader(dataset))
    for (name, p), z in zip(model.named_parameters(), center):
        torch.testing.assert_close(p, z, msg=name)


def test_the_rows_a_backward_reaches_are_noted_per_stack_and_follow_a_change_of_k() -> None:
    """Rows reached by any backward of the step count as reached; after a change of k (kept rows first), new rows are
    reached by no backward so far, and rows dropped are forgotten."""
    stack = ReplicaStack(nn.Linear(2, 1), 2)
    params = [replica for replica, _ in stack.unbind()]  # (one unbind per stack: its node notes the rows reached)
    (params[0]["weight"].sum() + params[1]["bias"].sum()).backward()
    assert stack.rows_reached.unreached() == {"weight": [False, True], "bias": [True, False]}
    stack.resize_(3)
    assert stack.rows_reached.unreached() == {"weight": [False, True, True], "bias": [True, False, True]}
    params = [replica for replica, _ in stack.unbind()]
    (params[2]["weight"].sum() + params[0]["bias"].sum()).backward()
    assert stack.rows_reached.unreached() == {"weight": [False, True, False], "bias": [False, False, True]}
    stack.resize_(1)
    assert stack.rows_reached.unreached() == {}
    stack.resize_(2)
    stack.rows_reached.clear()
    assert stack.rows_reached.unreached() == {}


def test_integer_buffers_of_z_are_the_rounded_mean_over_every_replica_of_every_process() -> None:
    """Two processes' stacks of a BatchNorm, emulated: each one's ``all_reduce_mean`` averages its replicas' mean with
    the other's. Both z's get the same running statistics, their mean over all six replicas, and the same
    ``num_batches_tracked``, the six counts' mean rounded (replica 0's alone differed: 9 on one process, 10 on the
    other)."""
    counts = {"a": [9, 10, 10], "b": [10, 10, 11]}
    stacks, modules, rows = {}, {}, {}
    for rank, rank_counts in counts.items():
        modules[rank] = nn.BatchNorm1d(2)
        stacks[rank] = ReplicaStack(modules[rank], 3)
        stacks[rank].buffers["num_batches_tracked"].copy_(torch.tensor(rank_counts))
        rows[rank] = torch.randn(3, 2)
        stacks[rank].buffers["running_mean"].copy_(rows[rank])
    own_means: dict[str, list[Tensor]] = {"a": [], "b": []}
    for rank in counts:  # (what each process contributes to each all-reduce: its own means, in order)
        stacks[rank].sync_center_buffers_(lambda t, rank=rank: own_means[rank].append(t.clone()) or t)
    for rank, other in (("a", "b"), ("b", "a")):
        calls = iter(own_means[other])
        stacks[rank].sync_center_buffers_(lambda t, calls=calls: (t + next(calls)) / 2)
    every_count = [c for rank_counts in counts.values() for c in rank_counts]
    expected_count = round(sum(every_count) / len(every_count))  # 60 / 6 = 10
    for rank in counts:
        assert modules[rank].num_batches_tracked.dtype == torch.long
        assert int(modules[rank].num_batches_tracked) == expected_count
        torch.testing.assert_close(modules[rank].running_mean, torch.cat([rows["a"], rows["b"]]).mean(0))
    assert int(modules["a"].num_batches_tracked) == int(modules["b"].num_batches_tracked)


class _WithASeed(Classifier):
    """Holds an int64 buffer beyond float64's 2^53 (a hash seed, a packed id), and a step counter."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seed", torch.tensor([2**62 + 12345, -(2**62) + 7]))
        self.register_buffer("steps", torch.tensor(0))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.steps += 1
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("k", [1, 3])
def test_integer_buffers_on_one_process_are_kept_exactly(k: int) -> None:
    """A seed beyond 2^53 stays bitwise what it was (averaged in float64 it lost its last digits); the step counter,
    the same in every replica, counts the steps."""
    model = _WithASeed()
    seed = model.seed.clone()
    trainer(strategy=CrossbowStrategy(replicas_per_device=k), max_steps=2).fit(model, loader(make_data()))
    assert torch.equal(model.seed, seed)
    assert int(model.steps) == 2


class _AutocastProbe(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.autocast_seen = torch.is_autocast_enabled("cpu")
        self.output_dtype = self(batch[0]).dtype
        return super().training_step(batch, batch_idx)


def test_bf16_mixed_autocasts_on_the_cpu() -> None:
    model = _AutocastProbe()
    strategy = CrossbowStrategy(replicas_per_device=2, engine="sequential")
    trainer(strategy=strategy, precision="bf16-mixed", max_steps=2).fit(model, loader(make_data()))
    assert model.autocast_seen and model.output_dtype == torch.bfloat16
    assert torch.isfinite(next(model.parameters())).all()


def test_the_fused_engine_says_that_mixed_precision_under_vmap_is_partial() -> None:
    model = _AutocastProbe()
    strategy = CrossbowStrategy(replicas_per_device=2, engine="fused")
    with pytest.warns(UserWarning, match="autocast leaves some operations in float32"):
        trainer(strategy=strategy, precision="bf16-mixed", max_steps=2).fit(model, loader(make_data()))
    assert model.autocast_seen


def test_callbacks_and_loggers_see_the_central_model(tmp_path) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1)
    t = trainer(
        strategy=CrossbowStrategy(replicas_per_device=2),
        max_epochs=20,
        logger=CSVLogger(tmp_path),
        enable_checkpointing=True,
        callbacks=[checkpoint, EarlyStopping("val_loss", patience=1, min_delta=10.0), LearningRateMonitor()],
    )
    model = Classifier(scheduler="step")
    t.fit(model, loader(make_data()), loader(make_data(seed=1)))
    assert t.current_epoch == 2  # stopped early: no improvement of 10.0
    best = Classifier.load_from_checkpoint(checkpoint.best_model_path)
    assert set(best.state_dict()) == set(model.state_dict())
    metrics = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "lr-SGD" in metrics and "val_loss" in metrics


# --------------------------------------------------------------------------------- robustness
def test_a_non_finite_replica_is_reset_to_z_and_training_continues() -> None:
    x, y = make_data(num_samples=64)[:]
    x[5 * 8] = float("nan")  # batch 5 = replica 1 of step 1 (k=4)
    model, snapshot = Classifier(), ReplicaSnapshot()
    with pytest.warns(UserWarning, match=r"replica 1 on rank 0 has a non-finite loss \(nan\) at step 1"):
        trainer(strategy=CrossbowStrategy(replicas_per_device=4), max_steps=2, callbacks=[snapshot]).fit(
            model, loader(TensorDataset(x, y))
        )
    assert model.trainer.global_step == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for stacked in snapshot.params.values():
        assert torch.isfinite(stacked).all()
    assert torch.equal(snapshot.params["net.0.weight"][1], model.net[0].weight.detach())


def test_one_replica_needs_no_vmap() -> None:
    strategy = CrossbowStrategy(replicas_per_device=1)
    engines = []

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            engines.append(trainer.strategy.engine)

    trainer(strategy=strategy, max_steps=1, callbacks=[Probe()]).fit(Classifier(), loader(make_data()))
    assert type(engines[0]) is SequentialEngine
    strategy = CrossbowStrategy(replicas_per_device=2, engine="fused")
    trainer(strategy=strategy, max_steps=1, callbacks=[Probe()]).fit(Classifier(), loader(make_data()))
    assert type(engines[1]) is FusedEngine


def test_one_process_launches_nothing_and_leaves_the_environment_alone(monkeypatch) -> None:
    for name in ("LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    t = trainer(strategy=CrossbowStrategy(replicas_per_device=2), max_steps=1)
    t.fit(Classifier(), loader(make_data()))
    assert t.strategy.launcher is None
    assert not {"LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"} & set(os.environ)


# ------------------------------------------------------------------------- layers vmap gets wrong
class _Embedded(Classifier):
    """A bag of token embeddings: tokens 1-19 and, at the end of every sequence, the padding token 0."""

    def __init__(self, **embedding: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(20, 8, **embedding)
        self.net = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.embedding(x).mean(1))


def _tokens(num_samples: int = 48) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(1, 20, (num_samples, 5), generator=generator)
    x[:, -1] = 0
    return TensorDataset(x, torch.randint(0, 3, (num_samples,), generator=generator))


class _FunctionalEmbedded(_Embedded):
    """The same bag of embeddings through ``F.embedding`` on a weight of its own (as weight-tied models call it)."""

    def __init__(self, **embedding: Any) -> None:
        super().__init__()
        self.embedding_options = embedding
        self.table = nn.Parameter(self.embedding.weight.detach().clone())
        if embedding.get("padding_idx") is not None:
            with torch.no_grad():
                self.table[embedding["padding_idx"]] = 0.0
        del self.embedding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(nn.functional.embedding(x, self.table, **self.embedding_options).mean(1))

    def embedding_weight(self) -> torch.Tensor:
        return self.table


def _embedding_weight(model: _Embedded) -> torch.Tensor:
    return model.embedding_weight() if isinstance(model, _FunctionalEmbedded) else model.embedding.weight


@pytest.mark.parametrize("form", [_Embedded, _FunctionalEmbedded], ids=["nn.Embedding", "F.embedding"])
def test_an_embedding_with_padding_idx_runs_fused_and_never_trains_the_padding_row(form: type[_Embedded]) -> None:
    """vmap's own rule trains the padding row of every replica but the first; the fused engine's corrected form
    gives what the sequential engine (each replica's own PyTorch call) gives, without falling back."""
    results = {}
    for engine in ("fused", "auto", "sequential"):
        model = form(padding_idx=0)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            trainer(strategy=CrossbowStrategy(replicas_per_device=3, engine=engine), max_steps=4).fit(
                model, loader(_tokens(), batch_size=4)
            )
        assert not [w for w in record if "Falling back" in str(w.message)]
        assert not _embedding_weight(model)[0].any()  # z's padding row: the replicas' steps never moved it
        assert _embedding_weight(model)[1:].ne(_embedding_weight(form(padding_idx=0))[1:]).any()  # the rest trained
        results[engine] = model
    for engine in ("fused", "auto"):
        for a, b in zip(results[engine].parameters(), results["sequential"].parameters(), strict=True):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    ("form", "reason"),
    [
        (_Embedded, r"embedding \(Embedding\) has sparse=True, whose sparse gradients vmap cannot batch"),
        (_FunctionalEmbedded, r"F.embedding\(sparse=True\) on the replicas' weights: vmap cannot batch sparse"),
    ],
    ids=["nn.Embedding", "F.embedding"],
)
def test_a_sparse_embedding_runs_sequentially_under_auto_and_is_refused_by_fused(
    form: type[_Embedded], reason: str
) -> None:
    """Sparse gradients cannot be batched, and PyTorch says so only in the backward: auto falls back before it
    (with a warning that says why) and computes what sequential computes; fused refuses."""
    results = {}
    for engine in ("auto", "sequential"):
        model = form(sparse=True)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            trainer(strategy=CrossbowStrategy(replicas_per_device=3, engine=engine), max_steps=4).fit(
                model, loader(_tokens(), batch_size=4)
            )
        fell_back = [str(w.message) for w in record if "Falling back" in str(w.message)]
        assert len(fell_back) == (engine == "auto")
        assert all(re.search(reason, message) for message in fell_back)
        results[engine] = model
    for a, b in zip(results["auto"].parameters(), results["sequential"].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    refusal = NotFusableError if form is _Embedded else RuntimeError  # (a layer is seen before the step runs)
    with pytest.raises(refusal, match=reason):
        trainer(strategy=CrossbowStrategy(replicas_per_device=3, engine="fused"), max_steps=1).fit(
            form(sparse=True), loader(_tokens(), batch_size=4)
        )


def test_a_layer_that_changes_its_weight_in_the_forward_runs_fused_and_is_refused_by_the_sequential_engine() -> None:
    """nn.Embedding(max_norm=...) renormalises its weight in place: one replica bitwise as plain Lightning; fused,
    several; sequentially, several are refused with the reason and what runs it."""
    assert_one_replica_is_plain_lightning(lambda: _Embedded(max_norm=0.5), _tokens(), epochs=1)
    model = _Embedded(max_norm=0.5)
    trainer(strategy=CrossbowStrategy(replicas_per_device=3, engine="fused"), max_steps=4).fit(
        model, loader(_tokens(), batch_size=4)
    )
    assert model.trainer.global_step == 4
    assert all(torch.isfinite(p).all() for p in model.parameters())
    with pytest.raises(
        RuntimeError, match=r"embedding \(Embedding\) has max_norm=0.5, which renormalises .*\(drop_last=True\)"
    ):
        trainer(strategy=CrossbowStrategy(replicas_per_device=3, engine="sequential"), max_steps=1).fit(
            _Embedded(max_norm=0.5), loader(_tokens(), batch_size=4)
        )


def test_frozen_embeddings_are_not_refused() -> None:
    """A frozen embedding is not replicated and has no gradient: neither its padding row nor its in-place
    renormalisation is a concern, so fused runs padding_idx and sequential runs max_norm at k > 1."""
    for engine, embedding in (("fused", dict(padding_idx=0)), ("sequential", dict(max_norm=0.5))):
        model = _Embedded(**embedding)
        model.embedding.weight.requires_grad_(False)
        trainer(strategy=CrossbowStrategy(replicas_per_device=3, engine=engine), max_steps=2).fit(
            model, loader(_tokens(), batch_size=4)
        )
        assert model.trainer.global_step == 2


class _SkipsLastBatch(_BatchNormNet):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx == 9 else loss


def test_a_last_step_that_every_replica_skips_still_moves_z_s_buffers_as_plain_lightning() -> None:
    buffers = {}
    for name, strategy in {"plain": "auto", "crossbow k=1": CrossbowStrategy(replicas_per_device=1)}.items():
        model = _SkipsLastBatch()
        trainer(strategy=strategy, max_epochs=1).fit(model, loader(make_data()))  # 10 batches: the 10th skipped
        buffers[name] = dict(model.named_buffers())
    for name, value in buffers["plain"].items():
        assert torch.equal(value, buffers["crossbow k=1"][name]), name


def test_a_diverged_gossip_learner_restarts_its_buffers_from_z_s() -> None:
    x, y = make_data(num_samples=64)[:]
    x[9] = float("inf")  # batch 1: replica 1 of step 0 (k=2)
    seen = _BuffersSeen()
    with pytest.warns(UserWarning, match="replica 1 on rank 0 has a non-finite loss"):
        trainer(
            strategy=CrossbowStrategy(replicas_per_device=2, algorithm="gossip"), max_steps=4, callbacks=[seen]
        ).fit(_BatchNormNet(), loader(TensorDataset(x, y)))
    for z, mean in zip(seen.seen, seen.replicas_mean, strict=True):
        assert all(torch.isfinite(value).all() for value in z.values())
        assert all(torch.isfinite(value).all() for value in mean.values())


class _LossOfShape(Classifier):
    """Returns its loss with the given shape: ``(1,)`` (one number, as a learned ``(1,)`` weight in the loss gives
    it), or ``(2,)`` (two numbers: not a loss automatic optimization can backpropagate)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape = shape

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return super().training_step(batch, batch_idx).expand(*self.shape)


@pytest.mark.parametrize("engine", ["fused", "sequential", "auto"])
def test_a_loss_of_one_number_in_shape_one_trains_and_a_diverged_replica_of_it_restarts(
    engine: str, recwarn: pytest.WarningsRecorder
) -> None:
    """A loss of shape ``(1,)`` trains as a 0-dim one does: k=1 bitwise as plain Lightning, and at k=2 each
    replica's loss is one number, so a replica whose loss is NaN is the one reset (not every replica, and no error)."""
    models = {}
    for name, strategy in [("plain", "auto"), ("crossbow k=1", CrossbowStrategy(replicas_per_device=1, engine=engine))]:
        models[name] = _LossOfShape((1,))
        trainer(strategy=strategy, max_steps=3).fit(models[name], loader(make_data()))
    for (name, p), q in zip(models["plain"].named_parameters(), models["crossbow k=1"].parameters()):
        assert torch.equal(p, q), name
    x, y = make_data(num_samples=8 * 2 * 3)[:]
    x[8 * 3] = float("nan")  # batch 3 = replica 1 of step 1 (k=2)
    model = _LossOfShape((1,))
    trainer(strategy=CrossbowStrategy(replicas_per_device=2, engine=engine), max_steps=3).fit(
        model, loader(TensorDataset(x, y))
    )
    diverged = [str(w.message) for w in recwarn if "non-finite loss" in str(w.message)]
    assert len(diverged) == 1 and "replica 1 on rank 0" in diverged[0] and "at step 1" in diverged[0]
    assert not [w for w in recwarn if "Falling back" in str(w.message)]
    assert model.trainer.global_step == 3 and all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("strategy", ["plain", "fused", "sequential", "auto"])
def test_a_loss_of_two_numbers_is_refused_as_plain_lightning_refuses_it(strategy: str) -> None:
    crossbow = None if strategy == "plain" else CrossbowStrategy(replicas_per_device=2, engine=strategy)
    message = "grad can be implicitly created only for scalar outputs" if crossbow is None else "a loss of shape"
    with pytest.raises(RuntimeError, match=message):
        trainer(strategy=crossbow or "auto", max_steps=1).fit(_LossOfShape((2,)), loader(make_data()))
