"""The drop-in contract around the step: what hooks and callbacks see, skipped steps, loaders, checkpoints."""

from __future__ import annotations

import copy
import csv
import gc
import logging
import math
import multiprocessing
import pickle
import random
import sys
import warnings
from collections import deque
from pathlib import Path
from typing import Any, Optional

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BackboneFinetuning, BaseFinetuning, ModelCheckpoint, StochasticWeightAveraging
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import grad_norm
from torch import Tensor, nn
from torch._C._functorch import is_functorch_wrapped_tensor
from torch.utils.data import TensorDataset

from lightning_crossbow import CrossbowStrategy
from lightning_crossbow.engines import NotFusableError
from tests.helpers import (
    BatchesSeen,
    Classifier,
    assert_one_replica_is_plain_lightning,
    loader,
    make_data,
    make_net,
    seed_environment_kept,
    trainer,
)


# ------------------------------------------------------------------ what hooks and callbacks see
class _LossSeen(L.Callback):
    """Records the loss Lightning hands ``on_train_batch_end``, and the mean of the group's losses at z
    (every learner starts the step at z with scaled averaging), computed here from the batches."""

    def __init__(self) -> None:
        self.seen: list[float] = []
        self.expected: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        with torch.no_grad():
            self.expected.append(sum(float(F.cross_entropy(pl_module(x), y)) for x, y in batch) / len(batch))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen.append(float(outputs["loss"]))


@pytest.mark.parametrize("engine", ["fused", "sequential"])
def test_the_loss_callbacks_see_is_the_mean_over_replicas(engine: str) -> None:
    seen = _LossSeen()
    trainer(strategy=CrossbowStrategy(replicas_per_device=4, engine=engine), max_epochs=1, callbacks=[seen]).fit(
        Classifier(), loader(make_data(num_samples=64))
    )
    assert len(seen.seen) == 2
    assert seen.seen == pytest.approx(seen.expected, rel=1e-5)


class _LossOffByTheDataSign(Classifier):
    """Its loss plus ``sign * log(1 / |x|.min())``: finite on ordinary data; ``+inf`` (``sign`` 1) or ``-inf``
    (``sign`` -1) on a batch holding a 0, NaN on one holding a NaN."""

    def __init__(self, sign: float) -> None:
        super().__init__()
        self.sign = sign

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, _ = batch
        return super().training_step(batch, batch_idx) - self.sign * torch.log(x.abs().amin())


@pytest.mark.parametrize("engine", ["fused", "sequential"])
@pytest.mark.parametrize(
    ("sign", "poison", "reported"),
    [(1.0, 0.0, math.inf), (-1.0, 0.0, -math.inf), (1.0, math.nan, math.nan)],
    ids=["inf", "-inf", "nan"],
)
def test_the_loss_callbacks_see_is_the_mean_also_where_one_replica_diverged(
    engine: str, sign: float, poison: float, reported: float
) -> None:
    """A replica whose loss is ``±inf`` makes the replicas' mean ``±inf`` (not ``inf/k - inf``, NaN), one whose
    loss is NaN makes it NaN; the other steps' mean is the mean, and the replica is reset as before."""
    x, y = make_data(num_samples=8 * 4 * 2)[:]
    x[8 * 5] = poison  # batch 5 = replica 1 of step 1 (k=4)
    seen, expected = [], []

    class Seen(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            with torch.no_grad():
                losses = [F.cross_entropy(pl_module(x), y) - sign * torch.log(x.abs().amin()) for x, y in batch]
                expected.append(float(sum(losses)) / len(batch))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            seen.append(float(outputs["loss"]))

    with pytest.warns(UserWarning, match=r"replica 1 on rank 0 has a non-finite loss .* at step 1"):
        trainer(strategy=CrossbowStrategy(replicas_per_device=4, engine=engine), max_epochs=1, callbacks=[Seen()]).fit(
            _LossOffByTheDataSign(sign), loader(TensorDataset(x, y))
        )
    assert math.isfinite(seen[0]) and seen[0] == pytest.approx(expected[0], rel=1e-5)
    assert seen[1] == reported or (math.isnan(reported) and math.isnan(seen[1]))


class _SkipsSecondStep(Classifier):
    """Returns None (skips the step) at batch_idx 1, as a user does for a batch to leave out."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return None if batch_idx == 1 else super().training_step(batch, batch_idx)


def test_a_step_every_replica_skips_is_skipped_as_in_plain_lightning() -> None:
    assert_one_replica_is_plain_lightning(_SkipsSecondStep, make_data(num_samples=48))


class _SkipsTheOptimizerStep(Classifier):
    """Skips the optimizer step as Lightning's docs show: ``optimizer_step`` runs the closure (forward and backward)
    but not the step, on a batch whose loss is not finite (``nan_at``), or at each epoch's step ``skip_at``."""

    def __init__(self, nan_at: int = -1, skip_at: int = -1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.nan_at, self.skip_at = nan_at, skip_at

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx == self.nan_at else loss

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any) -> None:
        loss = optimizer_closure()
        if batch_idx != self.skip_at and torch.isfinite(loss):
            optimizer.step()  # (LightningOptimizer's step: the closure has run)


class _SkipsTheStepByReturningNone(Classifier):
    """The same steps skipped the way that leaves nothing to undo: ``training_step`` returns None."""

    def __init__(self, nan_at: int = -1, skip_at: int = -1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.skipped = (nan_at, skip_at)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return None if batch_idx in self.skipped else super().training_step(batch, batch_idx)


@pytest.mark.parametrize("engine", ["fused", "sequential"])
@pytest.mark.parametrize(
    ("algorithm", "model_kwargs"),
    [("scaled_averaging", {"nan_at": 1}), ("sma", {"skip_at": 3, "scheduler": "step"})],
    ids=["a non-finite loss", "an epoch's last step, before an lr drop"],
)
def test_an_optimizer_step_that_the_module_skips_leaves_nothing_for_the_next_step(
    algorithm: str, model_kwargs: dict[str, Any], engine: str
) -> None:
    """The batches of a skipped optimizer step are not taken for accumulated ones by the next step: their non-finite
    losses do not reset the next step's replicas (as diverged), and the next step is an optimizer step's first (the
    replicas reset at an lr drop there, with ``sma``). So skipping the step trains as returning None does, at k=2,
    and at k=1 as plain Lightning."""
    assert_one_replica_is_plain_lightning(lambda: _SkipsTheOptimizerStep(**model_kwargs), make_data(num_samples=64))
    finals = []
    for model_class in (_SkipsTheOptimizerStep, _SkipsTheStepByReturningNone):
        model = model_class(**model_kwargs)
        strategy = CrossbowStrategy(replicas_per_device=2, engine=engine, algorithm=algorithm)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer(strategy=strategy, max_epochs=3).fit(model, loader(make_data(num_samples=64)))
        assert not [w for w in caught if "non-finite loss" in str(w.message)]
        finals.append(copy.deepcopy(model.state_dict()))
    for name, value in finals[0].items():
        torch.testing.assert_close(value, finals[1][name], rtol=0, atol=0, msg=name)


class _DropoutClassifier(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 3))


@pytest.mark.parametrize("reload", [0, 1], ids=["one loader", "loaders reloaded every epoch"])
def test_one_replica_draws_the_same_random_numbers_as_plain_lightning(reload: int) -> None:
    """seed_everything, then the model, then fit: shuffling and dropout draw as in plain Lightning (which does not
    re-seed on one device, and draws a base seed for every loader iterator it makes)."""
    assert_one_replica_is_plain_lightning(
        _DropoutClassifier,
        make_data(num_samples=48),
        seed=7,
        shuffle=True,
        reload_dataloaders_every_n_epochs=reload,
    )


@pytest.mark.parametrize(
    ("k", "samples", "model_class", "own_generator"),
    [(1, 48, _DropoutClassifier, False), (2, 82, Classifier, False), (2, 82, Classifier, True)],
    ids=["k=1, dropout", "k=2", "k=2, the loader's own generator"],
)
def test_a_second_fit_of_the_same_trainer_goes_on_as_in_plain_lightning(
    k: int, samples: int, model_class: type[Classifier], own_generator: bool
) -> None:
    """Two fits of one trainer (max_epochs raised in between), a shuffle: the second fit trains plain Lightning's
    batches (k=2: those that fill a group; 82 samples leave a short batch out, drawn all the same when the first
    fit ends), and at k=1, with dropout, ends with plain Lightning's parameters. (At k=2 dropout draws a mask per
    replica, so the global RNG and the later shuffles part from plain Lightning's; hence no dropout there.)"""
    runs = {}
    with seed_environment_kept():
        for name, strategy in (("plain", "auto"), ("crossbow", CrossbowStrategy(replicas_per_device=k))):
            L.seed_everything(7, verbose=False)
            model, seen = model_class(), BatchesSeen()
            fit = trainer(strategy=strategy, max_epochs=2, callbacks=[seen])
            generator = torch.Generator().manual_seed(3) if own_generator else None
            data = loader(make_data(num_samples=samples), shuffle=True, generator=generator)
            fit.fit(model, data)
            fit.fit_loop.max_epochs = 4
            fit.fit(model, data)
            runs[name] = (model, seen)
    batches = -(-samples // 8)
    for epoch in range(4):
        plain, crossbow = runs["plain"][1].epochs[epoch], runs["crossbow"][1].epochs[epoch]
        assert len(plain) == batches and len(crossbow) == batches // k * k
        for a, b in zip(crossbow, plain):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    if k == 1:
        for a, b in zip(runs["plain"][0].parameters(), runs["crossbow"][0].parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("samples", [80, 82, 88], ids=["none skipped", "short batch skipped", "full batch skipped"])
def test_a_shuffle_from_the_loaders_own_generator_goes_on_as_in_plain_lightning(samples: int) -> None:
    """Every epoch trains the batches plain Lightning draws, in its order, up to the last one that fills a group
    (k=2): the batches skipped are drawn all the same, so the next epoch's shuffle is plain Lightning's."""
    seen = {}
    for name, strategy in (("plain", "auto"), ("crossbow", CrossbowStrategy(replicas_per_device=2))):
        seen[name] = BatchesSeen()
        data = loader(make_data(num_samples=samples), shuffle=True, generator=torch.Generator().manual_seed(3))
        trainer(strategy=strategy, max_epochs=3, callbacks=[seen[name]]).fit(Classifier(), data)
    batches = -(-samples // 8)
    for epoch in range(3):
        plain, crossbow = seen["plain"].epochs[epoch], seen["crossbow"].epochs[epoch]
        assert len(plain) == batches and len(crossbow) == batches // 2 * 2
        for a, b in zip(crossbow, plain):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


class _Augmented(torch.utils.data.Dataset):
    """``make_data``'s samples with noise from the global random generator added as they are fetched (an
    augmentation): every batch drawn moves the generator, so a batch left undrawn changes the later noise."""

    def __init__(self, data: torch.utils.data.TensorDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        x, y = self.data[index]
        return x + 0.1 * torch.randn_like(x), y


@pytest.mark.parametrize(
    ("reload", "limit"), [(1, 1.0), (0, 0.5), (1, 0.5)], ids=["reloaded every epoch", "half the batches", "both"]
)
def test_batches_that_fill_no_step_are_drawn_also_when_the_loader_is_reloaded_or_limited(
    reload: int, limit: float
) -> None:
    """88 samples: 11 batches; half of them is 5 (Lightning's int(5.5)). At k=2 the last batch fills no step. A loader
    reloaded every epoch (a new crossbow loader each time), or a fraction of it, still draws and fetches it, so the
    next epoch's batches are plain Lightning's (reviewer's case: neither was drawn)."""
    seen = {}
    for name, strategy in (("plain", "auto"), ("crossbow", CrossbowStrategy(replicas_per_device=2))):
        seen[name] = BatchesSeen()
        torch.manual_seed(5)
        model, data = Classifier(), loader(_Augmented(make_data(num_samples=88)), shuffle=True)
        fit = trainer(
            strategy=strategy,
            max_epochs=3,
            callbacks=[seen[name]],
            reload_dataloaders_every_n_epochs=reload,
            limit_train_batches=limit,
        )
        if name == "plain" or limit == 1.0:
            fit.fit(model, data)
        else:
            with pytest.warns(UserWarning, match=r"gives 5 batches an epoch \(limit_train_batches=0.5\), not a mul"):
                fit.fit(model, data)
    batches = int(11 * limit)
    for epoch in range(3):
        plain, crossbow = seen["plain"].epochs[epoch], seen["crossbow"].epochs[epoch]
        assert len(plain) == batches and len(crossbow) == batches // 2 * 2
        for a, b in zip(crossbow, plain):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_loader_without_a_length_says_when_its_pass_leaves_batches_out() -> None:
    """7 batches at k=3: set-up cannot know; the first pass's end says it, once."""
    data = torch.utils.data.DataLoader(_Stream(make_data(num_samples=56)), batch_size=8)
    with pytest.warns(UserWarning, match=r"ended with 1 batch\(es\) that do not fill a step of 3") as warned:
        trainer(strategy=CrossbowStrategy(replicas_per_device=3), max_epochs=2).fit(Classifier(), data)
    assert sum("do not fill a step" in str(w.message) for w in warned) == 1


@pytest.mark.parametrize("limit", [1.0, 0.5], ids=["whole", "a fraction of it"])
def test_an_empty_loader_trains_nothing_as_in_plain_lightning(limit: float) -> None:
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=2), max_epochs=2, limit_train_batches=limit)
    fit.fit(Classifier(), loader(make_data(num_samples=0)))
    assert fit.global_step == 0


def test_max_steps_at_an_epochs_end_draws_its_left_over_batches_for_the_next_fit() -> None:
    """11 batches at k=2: max_steps=5 ends where the epoch ends (plain Lightning: 11). The 11th batch is drawn and
    fetched as plain Lightning fetches it, so a second fit of the same trainer trains plain Lightning's batches
    (reviewer's case: it was not, and the augmentation's noise parted)."""
    seen = {}
    for name, strategy, steps in (("plain", "auto", 11), ("crossbow", CrossbowStrategy(replicas_per_device=2), 5)):
        seen[name] = BatchesSeen()
        torch.manual_seed(5)
        model, data = Classifier(), loader(_Augmented(make_data(num_samples=88)), shuffle=True)
        fit = trainer(strategy=strategy, max_epochs=5, max_steps=steps, callbacks=[seen[name]])
        fit.fit(model, data)
        fit.fit_loop.epoch_loop.max_steps = 2 * steps
        fit.fit(model, data)
    for epoch in range(2):
        plain, crossbow = seen["plain"].epochs[epoch], seen["crossbow"].epochs[epoch]
        assert len(plain) == 11 and len(crossbow) == 10
        for a, b in zip(crossbow, plain):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_no_loader_worker_outlives_fit_when_the_last_group_leaves_batches_out() -> None:
    """5 batches at k=2: the fifth fills no group. The pass's iterator (and so its worker process) is let go when fit
    ends, not kept for a next pass that never comes."""
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=2), max_epochs=2)
    fit.fit(Classifier(), loader(make_data(num_samples=40), num_workers=1))
    gc.collect()
    assert multiprocessing.active_children() == []


class _CenterAt(L.Callback):
    def __init__(self) -> None:
        self.before: dict[int, list[Tensor]] = {}
        self.after: dict[int, list[Tensor]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.before[batch_idx] = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.after[batch_idx] = [p.detach().clone() for p in pl_module.parameters()]


@pytest.mark.parametrize(
    ("algorithm", "engine"), [("scaled_averaging", "fused"), ("scaled_averaging", "auto"), ("sma", "sequential")]
)
def test_a_step_that_every_replica_skips_leaves_z_where_it_was(algorithm: str, engine: str) -> None:
    """Nothing moves, not even by the central momentum (SMA's default 0.9)."""
    center = _CenterAt()
    strategy = CrossbowStrategy(replicas_per_device=2, algorithm=algorithm, engine=engine)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*cannot run fused.*")  # the fused engine skips, no fallback
        trainer(strategy=strategy, max_epochs=1, callbacks=[center]).fit(_SkipsSecondStep(), loader(make_data(64)))
    for before, after in zip(center.before[1], center.after[1], strict=True):
        assert torch.equal(before, after)
    # (SMA moves z by the replicas' spread before a step: after a step that reset them to z, one step later)
    assert any(not torch.equal(b, a) for b, a in zip(center.before[3], center.after[3], strict=True))


class _SkipsLabelZeroFirst(Classifier):
    """Replica-dependent skipping: a batch whose first label is 0 is left out."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return None if int(batch[1][0]) == 0 else super().training_step(batch, batch_idx)


def test_a_replica_that_skips_adds_nothing_to_the_average() -> None:
    """Plain averaging (outer lr 1): z moves by the steps of the replicas that stepped, summed and divided by K."""
    dataset = make_data(num_samples=32)  # 4 batches of 8: one step of k=4
    batches = list(loader(dataset))
    stepped = [j for j, (_, y) in enumerate(batches) if int(y[0]) != 0]
    assert 0 < len(stepped) < 4, "the data must make some replicas skip and others not"
    model = _SkipsLabelZeroFirst(optimizer="plain_sgd")
    z0 = [p.detach().clone() for p in model.parameters()]
    strategy = CrossbowStrategy(replicas_per_device=4, outer_lr=1.0, engine="sequential")
    trainer(strategy=strategy, max_epochs=1).fit(model, loader(dataset))

    reference = make_net()
    steps = [torch.zeros_like(p) for p in reference.parameters()]
    for j in stepped:  # each stepping replica: one SGD step of lr 0.1 from z0
        reference.zero_grad()
        x, y = batches[j]
        F.cross_entropy(reference(x), y).backward()
        for total, p in zip(steps, reference.parameters()):
            total -= 0.1 * p.grad
    for p, start, total in zip(model.parameters(), z0, steps, strict=True):
        torch.testing.assert_close(p.detach(), start + total / 4)


class _SecondReplicaSkipsThirdStep(Classifier):
    """With the sequential engine and k=2, the 6th training_step call is replica 1 of step 2."""

    def __init__(self) -> None:
        super().__init__()  # SGD with momentum 0.9
        self.calls = 0

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.calls += 1
        return None if self.calls == 6 else super().training_step(batch, batch_idx)


class _RowsAroundStep(L.Callback):
    """Replica rows and momentum rows of every stacked parameter, before and after step ``at``."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.rows: dict[str, list[tuple[Tensor, Tensor]]] = {}

    def _take(self, trainer: L.Trainer) -> list[tuple[Tensor, Tensor]]:
        optimizer = trainer.optimizers[0]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return [(p.detach().clone(), optimizer.state[p]["momentum_buffer"].clone()) for p in params]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at:
            self.rows["before"] = self._take(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at + 1:
            self.rows["after"] = self._take(trainer)


@pytest.mark.parametrize("algorithm", ["sma", "gossip"])
def test_a_replica_that_skips_keeps_its_optimizer_state_and_sits_the_update_out(algorithm: str) -> None:
    """Plain Lightning does not step the optimizer for a skipped step: the skipping replica's momentum
    stays as it was (the other replica's moves). With gossip, which does not reset it to z, its weights
    are its pre-step weights when it mixes: replica 0 ends at (w_0' + w_1) / 2, replica 1 takes w_0'."""
    rows = _RowsAroundStep(at=2)
    strategy = CrossbowStrategy(replicas_per_device=2, algorithm=algorithm, engine="sequential")
    trainer(strategy=strategy, max_epochs=1, callbacks=[rows]).fit(
        _SecondReplicaSkipsThirdStep(), loader(make_data(64))
    )
    for (w_before, m_before), (w_after, m_after) in zip(rows.rows["before"], rows.rows["after"], strict=True):
        assert torch.equal(m_after[1], m_before[1])
        assert not torch.equal(m_after[0], m_before[0])
        if algorithm == "gossip":
            torch.testing.assert_close(2 * w_after[0] - w_after[1], w_before[1])


class _ItemAtThirdStep(Classifier):
    """Code vmap cannot run (``.item()``), but only from the third step on."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        if batch_idx >= 2:
            self.seen_loss = loss.item()
        return loss


class _DropoutItemAtThirdStep(_ItemAtThirdStep):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 3))


class _MixupItemAtFirstStep(Classifier):
    """Mixes each batch with itself reversed, by a coefficient that Python's and NumPy's generators draw, then runs
    code vmap cannot run, from the first step on (under the fused engine those generators draw once a step, under the
    sequential engine once a replica: from the first step on, auto's steps are the sequential engine's)."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        mix = float(np.random.beta(0.4, 0.4)) * random.random()
        loss = super().training_step((mix * x + (1 - mix) * x.flip(0), y), batch_idx)
        self.seen_loss = loss.item()
        return loss


@pytest.mark.parametrize(
    "model",
    [_ItemAtThirdStep, _DropoutItemAtThirdStep, _MixupItemAtFirstStep],
    ids=["plain", "dropout", "python and numpy draws"],
)
def test_auto_falls_back_to_sequential_when_fusing_fails_at_the_first_or_a_later_step(model: type[Classifier]) -> None:
    """From the failed step on, auto runs what engine="sequential" runs: the failed attempt's draws (torch's dropout,
    Python's and NumPy's) are given back, so the sequential run of that step draws the same numbers (fused and
    sequential draw alike)."""
    dataset = make_data(num_samples=128)
    runs = {}
    for engine in ("auto", "sequential"):
        torch.manual_seed(3)
        random.seed(3)
        np.random.seed(3)
        runs[engine] = model()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            trainer(strategy=CrossbowStrategy(replicas_per_device=4, engine=engine), max_epochs=1).fit(
                runs[engine], loader(dataset)
            )
        fell_back = [w for w in record if "cannot run fused under torch.func.vmap" in str(w.message)]
        assert len(fell_back) == (engine == "auto")
    for a, b in zip(runs["auto"].parameters(), runs["sequential"].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _RaisesItsOwnError(Classifier):
    class BadBatch(ValueError):
        pass

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if batch_idx == 1:
            raise self.BadBatch("a batch the user's own check refuses")
        return super().training_step(batch, batch_idx)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes came with Python 3.11")
def test_an_error_under_vmap_keeps_its_type_and_says_where_it_came_from_under_the_fused_engine() -> None:
    """PyTorch's own (a .item() that vmap cannot batch) and the user's alike: the type stays, so the user's
    ``except`` still catches it, and a note says that engine='fused' ran the step under vmap."""
    for model, error in ((_ItemAtThirdStep(), RuntimeError), (_RaisesItsOwnError(), _RaisesItsOwnError.BadBatch)):
        fit = trainer(strategy=CrossbowStrategy(replicas_per_device=4, engine="fused"), max_epochs=1)
        with pytest.raises(error) as caught:
            fit.fit(model, loader(make_data(num_samples=128)))
        assert type(caught.value) is error
        assert any(
            "crossbow: this came from training_step run under torch.func.vmap" in note
            for note in caught.value.__notes__
        )


class _ChangesASavedTensor(Classifier):
    """Its own bug: it changes in place a tensor that autograd saved for the backward (the error names its shape,
    ``[4, 8]`` for one replica's, ``[4, 4, 8]`` under vmap)."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        hidden = torch.tanh(self.net[0](x))
        hidden.mul_(2.0)
        return F.cross_entropy(self.net[2](hidden), y)


@pytest.mark.parametrize(
    ("model", "error", "match"),
    [
        (_RaisesItsOwnError, _RaisesItsOwnError.BadBatch, "refuses"),
        (_ChangesASavedTensor, RuntimeError, "modified by an inplace operation"),  # (raised in the backward)
    ],
    ids=["in the forward", "in the backward"],
)
def test_the_steps_own_error_under_auto_is_raised_without_a_fallback_warning(
    model: type, error: type, match: str
) -> None:
    """An error that the sequential run of the step raises too is the step's own, not vmap's: it reaches the user as
    it is, without the warning that the step cannot run fused."""
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=4, engine="auto"), max_epochs=1)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(error, match=match):
        warnings.simplefilter("always")
        fit.fit(model(), loader(make_data(num_samples=128)))
    assert not [w for w in caught if "cannot run fused" in str(w.message)]


class _CheckpointsActivations(Classifier):
    """Non-reentrant activation checkpointing around a block with BatchNorm; dropout after it: a step that fails in
    its fused backward must leave the replicas' statistics and the random draws as the sequential run finds them."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.head = nn.Sequential(nn.Dropout(0.3), nn.Linear(8, 3))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_step_whose_fused_backward_fails_runs_again_sequentially_under_auto(accumulate: int) -> None:
    """vmap runs the forward of non-reentrant activation checkpointing, and its backward fails: auto undoes the
    step, warns once, and goes on sequentially, bitwise as engine='sequential' trains (statistics, dropout draws),
    also where the batch only accumulates (Lightning runs it outside the optimizer step)."""
    runs, warned = {}, {}
    for engine in ("auto", "sequential"):
        torch.manual_seed(0)
        model = _CheckpointsActivations()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer(
                strategy=CrossbowStrategy(replicas_per_device=2, engine=engine),
                max_epochs=2,
                accumulate_grad_batches=accumulate,
            ).fit(model, loader(make_data(num_samples=64)))
        runs[engine] = model.state_dict()
        warned[engine] = [str(w.message) for w in caught if "cannot run fused" in str(w.message)]
    assert len(warned["auto"]) == 1 and "the training_step's backward cannot run fused" in warned["auto"][0]
    assert not warned["sequential"]
    for (name, a), b in zip(runs["auto"].items(), runs["sequential"].values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


class _RaisesAroundBackwardOnce(Classifier):
    """Raises once, at step 1, in ``on_before_backward`` or ``on_after_backward``."""

    def __init__(self, hook: str) -> None:
        super().__init__()
        self.hook, self.raised = hook, False

    def _check(self, hook: str) -> None:
        if hook == self.hook and self.trainer.global_step == 1 and not self.raised:
            self.raised = True
            raise _RaisesItsOwnError.BadBatch("a gradient the user's own check refuses")

    def on_before_backward(self, loss: Tensor) -> None:
        self._check("on_before_backward")

    def on_after_backward(self) -> None:
        self._check("on_after_backward")


@pytest.mark.parametrize("hook", ["on_before_backward", "on_after_backward"])
def test_an_error_in_a_hook_around_a_fused_backward_is_raised_without_a_fallback_warning(hook: str) -> None:
    """Raised outside autograd, it is the step's own, even raised once only (a sequential run would not raise it)."""
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=2, engine="auto"), max_epochs=1)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(_RaisesItsOwnError.BadBatch, match="refuses"):
        warnings.simplefilter("always")
        fit.fit(_RaisesAroundBackwardOnce(hook), loader(make_data(num_samples=64)))
    assert not [w for w in caught if "cannot run fused" in str(w.message)]


class _KeepsStepTensors(Classifier):
    """Lightning 2's idioms for a step's tensors: kept on the module in ``training_step``, read by a later hook
    (``where`` says how); and a count of the steps, which a fused attempt that is undone must not raise."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where, self.outputs, self.by_name, self.epochs, self.steps_seen = where, [], {}, [], 0
        self.by_stage: dict[str, list[Tensor]] = {"train": []}
        self.recent: deque[Tensor] = deque(maxlen=3)
        self.slots: list[Any] = [None, None]
        self.pair: tuple[list[Tensor], list[Tensor]] = ([], [])
        self.history: dict[str, list[Any]] = {"correct": [None] * 100}  # (a long list in a small dict)
        self.window: list[Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        correct = logits.argmax(1) == y
        self.steps_seen += 1
        if self.where == "list":
            self.outputs.append(correct)
        elif self.where == "attribute":
            self.last_correct = correct
        elif self.where == "dict":
            self.by_name[f"step {batch_idx}"] = correct
        elif self.where == "dict of lists":
            self.by_stage["train"].append(correct)
        elif self.where == "deque":
            self.recent.append(correct)
        elif self.where == "slot":  # an earlier item replaced
            self.slots[batch_idx % 2] = correct
        elif self.where == "tuple of lists":
            self.pair[0].append(correct)
        elif self.where == "dict of a long list":
            self.history["correct"].append(correct)
        else:  # appended, then the attribute bound to a new list
            self.window.append(correct)
            self.window = self.window[-3:]
        return F.cross_entropy(logits, y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.where == "attribute":
            self.outputs.append(self.last_correct.clone())
        elif self.where in ("deque", "slot"):
            self.outputs.append(
                torch.cat([t for t in (self.recent if self.where == "deque" else self.slots) if t is not None])
            )

    def on_train_epoch_end(self) -> None:
        kept = {
            "dict": list(self.by_name.values()),
            "dict of lists": self.by_stage["train"],
            "tuple of lists": self.pair[0],
            "dict of a long list": self.history["correct"][100:],
            "rebound": self.window,
        }.get(self.where, self.outputs)
        self.epochs.append(torch.cat(kept).float().mean())
        for container in (self.outputs, self.by_name, self.by_stage["train"], self.pair[0]):
            container.clear()
        del self.history["correct"][100:]


#: Where each idiom keeps its tensors, as the refusal names it.
KEPT_IN = {
    "list": r"self\.outputs \(a list\)",
    "attribute": r"self\.last_correct",
    "dict": r"self\.by_name \(a dict\)",
    "dict of lists": r"self\.by_stage \(a dict\)",
    "deque": r"self\.recent \(a deque\)",
    "slot": r"self\.slots \(a list\)",
    "tuple of lists": r"self\.pair \(a tuple\)",
    "dict of a long list": r"self\.history \(a dict\)",
    "rebound": r"self\.window",
}


@pytest.mark.parametrize("where", list(KEPT_IN))
def test_tensors_a_step_keeps_on_the_module_run_sequentially_under_auto_and_are_refused_by_fused(where: str) -> None:
    """Under vmap they would escape (a later read fails inside PyTorch): auto undoes the fused attempt on the
    module's attributes (its step count included) and runs what the sequential engine runs (each replica's own
    tensors kept); fused names the attribute."""
    runs = {}
    for engine in ("auto", "sequential"):
        runs[engine] = _KeepsStepTensors(where)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            trainer(strategy=CrossbowStrategy(replicas_per_device=2, engine=engine), max_epochs=2).fit(
                runs[engine], loader(make_data(num_samples=64))
            )
        fell_back = [str(w.message) for w in record if "Falling back" in str(w.message)]
        assert len(fell_back) == (engine == "auto")
        assert all("keeps tensors computed under vmap in self." in message for message in fell_back)
    assert runs["auto"].steps_seen == runs["sequential"].steps_seen == 2 * 8  # two epochs of 8 batches
    assert len(runs["auto"].epochs) == 2
    assert torch.equal(torch.stack(runs["auto"].epochs), torch.stack(runs["sequential"].epochs))
    for a, b in zip(runs["auto"].parameters(), runs["sequential"].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(NotFusableError, match=f"keeps tensors computed under vmap in {KEPT_IN[where]}, where"):
        trainer(strategy=CrossbowStrategy(replicas_per_device=2, engine="fused"), max_steps=1).fit(
            _KeepsStepTensors(where), loader(make_data(num_samples=64))
        )


class _KeepsActivations(L.Callback):
    """A forward hook registered at fit start keeps the first layer's output in the callback's own dict, and the
    callback reads it after every batch, as activation-statistics callbacks do."""

    def __init__(self) -> None:
        self.activations: dict[str, Tensor] = {}
        self.means: list[float] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.net[0].register_forward_hook(lambda module, args, out: self.activations.update(first=out.detach()))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.means.append(float(self.activations["first"].mean()))


def test_a_tensor_that_a_hook_keeps_in_a_callback_runs_sequentially_under_auto_and_is_refused_by_fused() -> None:
    """Under vmap the hook's tensor would escape into the callback (its read after the batch fails inside PyTorch):
    auto undoes the fused attempt on the callback's attributes and runs what the sequential engine runs; fused names
    the callback's attribute."""
    means = {}
    for engine in ("auto", "sequential"):
        callback = _KeepsActivations()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            trainer(strategy=CrossbowStrategy(replicas_per_device=2, engine=engine), callbacks=[callback]).fit(
                Classifier(), loader(make_data(num_samples=32))
            )
        fell_back = [str(w.message) for w in record if "Falling back" in str(w.message)]
        assert len(fell_back) == (engine == "auto")
        assert all("_KeepsActivations.activations (a dict)" in message for message in fell_back)
        means[engine] = callback.means
    assert len(means["auto"]) == 2 and means["auto"] == means["sequential"]  # (the last replica's, each step)
    with pytest.raises(NotFusableError, match=r"vmap in _KeepsActivations\.activations \(a dict\), where"):
        trainer(strategy=CrossbowStrategy(replicas_per_device=2, engine="fused"), callbacks=[_KeepsActivations()]).fit(
            Classifier(), loader(make_data(num_samples=32))
        )


class _CountsThenFailsUnderVmap(_ItemAtThirdStep):
    """Counts its steps on the module, then (from the third step on) calls ``.item()``, which vmap cannot run."""

    def __init__(self) -> None:
        super().__init__()
        self.steps_seen, self.batches_seen = 0, []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.steps_seen += 1
        self.batches_seen.append(batch_idx)
        return super().training_step(batch, batch_idx)


def test_a_fused_attempt_that_fails_leaves_the_modules_attributes_as_they_were() -> None:
    runs = {}
    for engine in ("auto", "sequential"):
        runs[engine] = _CountsThenFailsUnderVmap()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer(strategy=CrossbowStrategy(replicas_per_device=2, engine=engine), max_epochs=1).fit(
                runs[engine], loader(make_data(num_samples=64))
            )
    assert runs["sequential"].steps_seen == 8
    assert runs["auto"].steps_seen == 2 + 4  # two fused steps (one call each), then two replicas a step
    assert runs["auto"].batches_seen == [0, 1, 2, 2, 3, 3]  # (the failed fused attempt at step 2 undone)


def test_tensors_kept_at_the_end_of_a_long_list_are_taken_out() -> None:
    """A list longer than what each step copies is looked at in its last items, where appending puts them."""
    model = _KeepsStepTensors("list")
    model.on_train_epoch_end = lambda: None  # type: ignore[method-assign]  # (the list as training leaves it)
    model.outputs.extend(torch.zeros(8, dtype=torch.bool) for _ in range(500))  # (kept from before the fit)
    trainer(strategy=CrossbowStrategy(replicas_per_device=2), max_steps=3).fit(model, loader(make_data(num_samples=64)))
    assert len(model.outputs) == 500 + 2 * 3 and not any(is_functorch_wrapped_tensor(t) for t in model.outputs)


@pytest.mark.parametrize("k", [1, 3])
def test_lightnings_throughput_monitor_counts_each_batch_of_a_step_with_the_users_functions(k: int) -> None:
    """Its ``batch_size_fn`` and ``length_fn`` are written for one batch; hooks receive a step's k batches."""
    from lightning.pytorch.callbacks import ThroughputMonitor
    from lightning.pytorch.trainer.states import RunningStage

    monitor = ThroughputMonitor(batch_size_fn=_samples_of, length_fn=_values_of)
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=k), callbacks=[monitor], max_epochs=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (it asks for flops_per_batch)
        fit.fit(Classifier(), loader(make_data(num_samples=72)))  # 9 batches of 8 features 6 a sample
    assert fit.global_step == 2 * 9 // k
    assert monitor._samples[RunningStage.TRAINING] == 8 * k * fit.global_step
    assert monitor._lengths[RunningStage.TRAINING] == 6 * 8 * k * fit.global_step
    assert monitor._batches[RunningStage.TRAINING] == fit.global_step
    pickle.loads(pickle.dumps(monitor))  # (as it pickled before: the functions are kept in a class, not a closure)


def _samples_of(batch: Any) -> int:
    return batch[0].size(0)


def _values_of(batch: Any) -> int:
    return batch[0].numel()


class _Stream(torch.utils.data.IterableDataset):
    """An iterable dataset without a length: the DataLoader over it has none either."""

    def __init__(self, dataset: torch.utils.data.Dataset) -> None:
        self.dataset = dataset

    def __iter__(self) -> Any:
        return iter(self.dataset)


def test_a_loader_without_a_length_trains_on_every_group() -> None:
    seen = _CenterAt()
    data = torch.utils.data.DataLoader(_Stream(make_data(num_samples=56)), batch_size=8)  # 7 batches
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=2), max_epochs=2, callbacks=[seen])
    fit.fit(Classifier(), data)
    assert fit.global_step == 2 * 3  # 3 full groups of 2 per pass; the 7th batch does not fill one


@pytest.mark.parametrize("heterogeneous", [False, True])
def test_fewer_batches_than_replicas_is_refused_before_training(heterogeneous: bool) -> None:
    match = r"has 3 batches per epoch, fewer than the 4 that one step takes .*at most replicas_per_device=3"
    with pytest.raises(ValueError, match=match):
        trainer(strategy=CrossbowStrategy(replicas_per_device=4, heterogeneous=heterogeneous), max_epochs=1).fit(
            Classifier(), loader(make_data(num_samples=24))
        )


def test_a_loader_without_a_length_and_fewer_batches_than_replicas_is_refused_at_its_first_pass() -> None:
    """Its length is learnt only as its first pass ends: then, not after epochs that made no step."""
    data = torch.utils.data.DataLoader(_Stream(make_data(num_samples=16)), batch_size=8)  # 2 batches
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=3), max_epochs=2)
    match = r"the first pass of the training DataLoader gave 2 batch\(es\), fewer than the 3 .*replicas_per_device=2"
    with pytest.raises(ValueError, match=match):
        fit.fit(Classifier(), data)
    assert fit.global_step == 0 and fit.current_epoch == 0


class _PassesOf(torch.utils.data.IterableDataset):
    """Passes of the given numbers of samples, one after another."""

    def __init__(self, dataset: torch.utils.data.Dataset, lengths: list[int]) -> None:
        self.dataset, self.lengths, self.passes = dataset, lengths, 0

    def __iter__(self) -> Any:
        length, self.passes = self.lengths[self.passes], self.passes + 1
        return (self.dataset[i] for i in range(length))


def test_a_later_pass_of_fewer_batches_than_replicas_is_skipped_with_a_warning() -> None:
    """Once a pass made a step, a shorter one only skips its batches (the first pass alone proves a loader too short)."""
    data = torch.utils.data.DataLoader(_PassesOf(make_data(num_samples=56), [56, 16, 40]), batch_size=8)  # 7, 2, 5
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=3), max_epochs=3)
    with pytest.warns(UserWarning, match=r"ended with 1 batch\(es\) that do not fill a step of 3"):
        fit.fit(Classifier(), data)
    assert fit.global_step == 2 + 0 + 1 and fit.current_epoch == 3


# --------------------------------------------------------------------------------- checkpoints
def test_a_crossbow_checkpoint_resumes_in_plain_lightning(tmp_path: Path) -> None:
    """Its optimizer state is over the module's own parameters: the mean over replicas of theirs."""
    dataset = make_data(num_samples=64)
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=2, algorithm="sma"), max_epochs=1)
    fit.fit(Classifier(optimizer="adam"), loader(dataset))
    path = tmp_path / "crossbow.ckpt"
    fit.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    stacked = checkpoint["crossbow"]["ranks"][0]["optimizer"]["state"]
    central = checkpoint["optimizer_states"][0]["state"]
    for index, state in stacked.items():
        torch.testing.assert_close(central[index]["exp_avg"], state["exp_avg"].mean(0))
        assert torch.equal(central[index]["step"], state["step"])

    plain = trainer(max_epochs=2)
    plain.fit(Classifier(optimizer="adam"), loader(dataset), ckpt_path=path)
    assert plain.global_step == 4 + 8  # crossbow's 4 steps, then one epoch of 8 plain steps


class NewLearningRateOnResume(Classifier):
    """Sets the learning rate of the resumed run in the checkpoint it loads, as users do in ``on_load_checkpoint``."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        for group in checkpoint["optimizer_states"][0]["param_groups"]:
            group["lr"] = 0.5
        self.learning_rates: set[float] = set()

    def on_train_batch_start(self, *args: Any) -> None:
        self.learning_rates.add(self.trainer.optimizers[0].param_groups[0]["lr"])


@pytest.mark.parametrize("k", [1, 2])
def test_a_learning_rate_set_in_the_checkpoint_on_load_is_the_resumed_runs_as_in_plain_lightning(
    k: int, tmp_path: Path
) -> None:
    """The replicas' own copy of their optimizer state (same k) takes the hyper-parameters of the checkpoint's
    optimizer state as plain Lightning loads it: an lr edited there is the lr the resumed run trains at (before, the
    edit was ignored), and at k=1 the resumed run is plain Lightning's, bitwise."""
    dataset = make_data(num_samples=64)
    first = trainer(strategy=CrossbowStrategy(replicas_per_device=k), max_epochs=1)
    first.fit(Classifier(optimizer="adam"), loader(dataset))
    first.save_checkpoint(tmp_path / "saved.ckpt")
    resumed = NewLearningRateOnResume(optimizer="adam")
    trainer(strategy=CrossbowStrategy(replicas_per_device=k), max_epochs=2).fit(
        resumed, loader(dataset), ckpt_path=tmp_path / "saved.ckpt"
    )
    assert resumed.learning_rates == {0.5}
    if k == 1:
        plain = NewLearningRateOnResume(optimizer="adam")
        trainer(max_epochs=2).fit(plain, loader(dataset), ckpt_path=tmp_path / "saved.ckpt")
        for a, b in zip(resumed.parameters(), plain.parameters(), strict=True):
            assert torch.equal(a, b)


class SavesInItsStep(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if batch_idx == 1:
            self.trainer.save_checkpoint(self.path)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("engine", ["fused", "sequential"])
def test_a_checkpoint_saved_inside_training_step_is_refused_saying_where_to_save_instead(
    engine: str, tmp_path: Path
) -> None:
    """Inside the step the module holds the replicas' weights (batched under vmap: the save crashed in torch.save;
    replica 0's under the sequential engine: a checkpoint of the wrong weights, then an in-place error)."""
    model = SavesInItsStep()
    model.path = tmp_path / "in_step.ckpt"
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=2, engine=engine), max_epochs=1)
    with pytest.raises(RuntimeError, match="saved inside training_step, .* Save it from a hook after the step"):
        fit.fit(model, loader(make_data(num_samples=64)))
    assert not model.path.exists()


def test_the_central_optimizer_state_is_the_mean_over_every_processs_replicas() -> None:
    """Two processes of 2 and 1 replicas; the second never stepped parameter 1 (an unused branch): it counts
    as a zero row, as fresh momentum is. Shared state (a step count) is the first process's. Parameter 2 was
    frozen when training started (not replicated): its state, of 2 rows like rank 0's k, is not per replica."""
    from lightning_crossbow.optim import central_state_over_ranks

    generator = torch.Generator().manual_seed(0)
    a0, a1, b0 = (torch.randn(2, 3, generator=generator), torch.randn(2, 4, generator=generator), torch.randn(1, 3))
    step, frozen = torch.tensor(5.0), {"sum": torch.randn(2, 5, generator=generator)}
    ranks = [
        {"state": {0: {"momentum_buffer": a0, "step": step}, 1: {"momentum_buffer": a1, "step": step}, 2: frozen}},
        {"state": {0: {"momentum_buffer": b0, "step": torch.tensor(9.0)}, 2: frozen}},
    ]
    groups = [{"lr": 0.1, "params": [0, 1, 2]}]
    merged = central_state_over_ranks({"state": {2: frozen}, "param_groups": groups}, ranks, (2, 1), stacked=[0, 1])
    torch.testing.assert_close(merged["state"][0]["momentum_buffer"], (a0.sum(0) + b0[0]) / 3)
    torch.testing.assert_close(merged["state"][1]["momentum_buffer"], a1.sum(0) / 3)
    assert merged["state"][0]["step"] is step and merged["param_groups"] is groups
    assert merged["state"][2] is frozen


@pytest.mark.parametrize("k", [1, 2])
def test_after_fit_each_parameter_holds_its_own_storage(tmp_path: Path, k: int) -> None:
    """A layer saved alone after fit writes its own bytes, as in plain Lightning: z's parameters, views of one flat
    buffer during fit, are each their own tensor again (``torch.save`` of a view writes its whole storage), with
    the values fit left."""
    model = Classifier()
    trainer(strategy=CrossbowStrategy(replicas_per_device=k), max_epochs=1).fit(model, loader(make_data()))
    for name, param in model.named_parameters():
        assert param.untyped_storage().nbytes() == param.numel() * param.element_size(), name
    head = dict(model.net[2].state_dict())
    torch.save(head, tmp_path / "head.pt")
    torch.save({key: value.clone() for key, value in head.items()}, tmp_path / "copy.pt")
    assert (tmp_path / "head.pt").stat().st_size == (tmp_path / "copy.pt").stat().st_size
    assert all(torch.equal(a, b) for a, b in zip(head.values(), torch.load(tmp_path / "head.pt").values()))


class _HoldsTheFirstLayer(Classifier):
    """Adam; ``on_before_optimizer_step`` zeroes the first layer's gradient (a layer held, as fine-tuning recipes
    do), and the first row of the last layer's."""

    def __init__(self) -> None:
        super().__init__(optimizer="adam")

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.net[0].weight.grad.zero_()
        self.net[2].weight.grad[0] = 0.0


@pytest.mark.parametrize("k", [1, 4])
def test_a_gradient_a_hook_zeroes_holds_the_parameter_under_adam(k: int) -> None:
    """Each replica's gradient got the hook's change as a shift, ``g_j - mean``, which Adam turned into a step of
    each replica's own whose mean is not zero (at k=4 the held layer moved by 0.07); as in plain Lightning, what
    a hook zeroes stays where it is."""
    model = _HoldsTheFirstLayer()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer(strategy=CrossbowStrategy(replicas_per_device=k), max_epochs=2).fit(model, loader(make_data(128)))
    assert torch.equal(model.net[0].weight, initial["net.0.weight"])
    assert torch.equal(model.net[2].weight[0], initial["net.2.weight"][0])
    assert not torch.equal(model.net[2].weight[1:], initial["net.2.weight"][1:])  # (the rest trained)


class _EditsOnLoad(Classifier):
    """A BatchNorm classifier whose ``on_load_checkpoint`` edits what the resume trains from, as a fine-tuning
    recipe may: a head re-initialised, BatchNorm's statistics reset, the momentum zeroed, or one parameter's
    optimizer state dropped."""

    def __init__(self, edit: Optional[str] = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
        self.edit = edit

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state_dict, optimizer_state = checkpoint["state_dict"], checkpoint["optimizer_states"][0]["state"]
        if self.edit == "head":
            state_dict["net.3.weight"] = torch.zeros(3, 8)
        elif self.edit == "batch norm":
            state_dict["net.1.running_mean"].zero_()
            state_dict["net.1.running_var"] = torch.ones(8)
        elif self.edit == "momentum":
            for entries in optimizer_state.values():
                entries["momentum_buffer"].zero_()
        elif self.edit == "momentum through .data":  # (no version counter sees it)
            for entries in optimizer_state.values():
                entries["momentum_buffer"].data.zero_()
        elif self.edit == "state dropped":
            del optimizer_state[0]
        elif self.edit == "optimizer reset":
            checkpoint["optimizer_states"] = []


class _StackAtTrainStart(L.Callback):
    """Keeps, as training starts, the replicas of ``net.3.weight`` and ``net.1.running_mean``, and each stacked
    leaf's optimizer state."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        stack = trainer.strategy.stack
        self.head = stack.params["net.3.weight"].detach().clone()
        self.running_mean = stack.buffers["net.1.running_mean"].clone()
        optimizer = trainer.optimizers[0]
        self.state = [
            {key: value.clone() for key, value in optimizer.state.get(leaf, {}).items()}
            for leaf in stack.params.values()
        ]


def _resume_sma_seeing_the_stack(model: L.LightningModule, checkpoint: Path, saved_at: int) -> _StackAtTrainStart:
    """One more step of ``sma`` at k=2 from ``checkpoint`` (saved at step ``saved_at``): the stack as it starts."""
    seen = _StackAtTrainStart()
    trainer(
        strategy=CrossbowStrategy(replicas_per_device=2, algorithm="sma"),
        max_epochs=-1,
        max_steps=saved_at + 1,
        callbacks=[seen],
    ).fit(model, loader(make_data(64)), ckpt_path=checkpoint)
    return seen


@pytest.mark.parametrize(
    "edit", ["head", "batch norm", "momentum", "momentum through .data", "state dropped", "optimizer reset"]
)
def test_what_on_load_checkpoint_edits_is_what_a_resume_trains_from(tmp_path: Path, edit: str) -> None:
    """At k=1 two resumed steps are bitwise plain Lightning's; at k=2 under ``sma`` (whose replicas differ from z)
    every replica starts from the edited entries. Crossbow's own copies of the replicas and their optimizer state,
    saved beside the ones the hook edits, were restored over the edits."""
    data = make_data(64)
    first = trainer(strategy=CrossbowStrategy(replicas_per_device=2, algorithm="sma"), max_epochs=1)
    first.fit(_EditsOnLoad(), loader(data))
    first.save_checkpoint(tmp_path / "sma.ckpt")
    ends = []
    for crossbow in (False, True):
        fit = trainer(strategy=CrossbowStrategy(replicas_per_device=1) if crossbow else "auto", max_epochs=1)
        fit.fit(_EditsOnLoad(), loader(data))
        fit.save_checkpoint(tmp_path / "one.ckpt")
        model = _EditsOnLoad(edit)
        strategy = CrossbowStrategy(replicas_per_device=1) if crossbow else "auto"
        trainer(strategy=strategy, max_epochs=-1, max_steps=fit.global_step + 2).fit(
            model, loader(data), ckpt_path=tmp_path / "one.ckpt"
        )
        ends.append(model.state_dict())
    for name, value in ends[0].items():
        assert torch.equal(value, ends[1][name]), name
    seen = _resume_sma_seeing_the_stack(_EditsOnLoad(edit), tmp_path / "sma.ckpt", first.global_step)
    assert not torch.equal(seen.head[0], seen.head[1]) or edit == "head"  # (the replicas differ from each other)
    if edit == "head":
        assert torch.equal(seen.head, torch.zeros(2, 3, 8))
    if edit == "batch norm":
        assert torch.equal(seen.running_mean, torch.zeros(2, 8))
    if edit.startswith("momentum"):
        assert all(not state["momentum_buffer"].any() for state in seen.state)
    if edit == "optimizer reset":
        assert seen.state == [{}] * len(seen.state)
    if edit == "state dropped":
        assert seen.state[0] == {} and all(state for state in seen.state[1:])


def test_weights_set_after_fit_are_what_a_checkpoint_saved_then_resumes_from(tmp_path: Path) -> None:
    """After fit the module takes other weights (``trainer.test(ckpt_path="best")`` loads the best), then a
    checkpoint is saved: under ``sma`` its resume starts every replica from those weights, BatchNorm's statistics
    included, as plain Lightning resumes from them (the replicas kept as fit ended went on from the last weights)."""
    model = _EditsOnLoad()
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=2, algorithm="sma"), max_epochs=1)
    fit.fit(model, loader(make_data(64)))
    torch.manual_seed(5)
    best = {name: value + torch.randn(value.shape).to(value.dtype) for name, value in model.state_dict().items()}
    model.load_state_dict(best)
    fit.save_checkpoint(tmp_path / "best.ckpt")
    seen = _resume_sma_seeing_the_stack(_EditsOnLoad(), tmp_path / "best.ckpt", fit.global_step)
    assert torch.equal(seen.head, best["net.3.weight"].expand(2, 3, 8))
    assert torch.equal(seen.running_mean, best["net.1.running_mean"].expand(2, 8))


class _LinearWithExtraState(nn.Linear):
    """A layer whose extra state is no tensor (a quantization recipe, say)."""

    def get_extra_state(self) -> Any:
        return {"scale": 2.0, "recipe": "fp8"}

    def set_extra_state(self, state: Any) -> None:
        self.recipe = state


def test_a_module_with_extra_state_that_is_no_tensor_fits_and_saves_after_fit(tmp_path: Path) -> None:
    """The module's state_dict holds a dict beside the tensors: fit ends, and a checkpoint saved after it loads, as in
    plain Lightning (keeping the module's state at fit's end took every entry for a tensor)."""
    model = Classifier()
    model.net[2] = _LinearWithExtraState(8, 3)
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=2), max_epochs=1)
    fit.fit(model, loader(make_data(64)))
    fit.save_checkpoint(tmp_path / "after.ckpt")
    state_dict = torch.load(tmp_path / "after.ckpt", weights_only=False)["state_dict"]
    assert state_dict["net.2._extra_state"] == {"scale": 2.0, "recipe": "fp8"}


def test_a_weights_only_checkpoint_holds_no_crossbow_state(tmp_path: Path) -> None:
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=2), max_epochs=1)
    fit.fit(Classifier(), loader(make_data(num_samples=32)))
    fit.save_checkpoint(tmp_path / "weights.ckpt", weights_only=True)
    checkpoint = torch.load(tmp_path / "weights.ckpt", weights_only=False)
    assert "crossbow" not in checkpoint and "optimizer_states" not in checkpoint
    assert set(checkpoint["state_dict"]) == set(Classifier().state_dict())


# ----------------------------------------------------------------------- gradients hooks see
class _GradNormSeen(Classifier):
    """Reads the module's gradients where plain Lightning users do (``grad_norm`` in on_before_optimizer_step)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.grads: list[list[Tensor]] = []
        self.norms: list[dict[str, Tensor]] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.grads.append([p.grad.clone() for p in self.parameters()])
        self.norms.append(grad_norm(self, norm_type=2))


class _MeanLossGradientAtZ(L.Callback):
    """The gradient at z of the mean loss over the step's batches, computed here on a copy of the network."""

    def __init__(self) -> None:
        self.expected: list[list[Tensor]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        net = copy.deepcopy(pl_module.net)
        loss = sum(F.cross_entropy(net(x), y) for x, y in batch) / len(batch)
        self.expected.append(list(torch.autograd.grad(loss, list(net.parameters()))))


def test_one_replica_shows_hooks_the_gradients_plain_lightning_shows() -> None:
    dataset = make_data(num_samples=48)
    plain, crossbow = _GradNormSeen(), _GradNormSeen()
    trainer(max_epochs=1).fit(plain, loader(dataset))
    trainer(strategy=CrossbowStrategy(replicas_per_device=1), max_epochs=1).fit(crossbow, loader(dataset))
    for a, b in zip(plain.grads, crossbow.grads, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y)
    assert plain.norms[-1].keys() == crossbow.norms[-1].keys() and "grad_2.0_norm_total" in crossbow.norms[-1]


@pytest.mark.parametrize("engine", ["fused", "sequential"])
def test_hooks_see_the_mean_gradient_over_replicas(engine: str) -> None:
    """With scaled averaging every learner starts at z: the mean gradient is the mean loss's gradient at z."""
    model, expected = _GradNormSeen(), _MeanLossGradientAtZ()
    strategy = CrossbowStrategy(replicas_per_device=4, engine=engine)
    trainer(strategy=strategy, max_epochs=1, callbacks=[expected]).fit(model, loader(make_data(num_samples=64)))
    assert len(model.grads) == len(expected.expected) == 2
    for seen, reference in zip(model.grads, expected.expected, strict=True):
        for x, y in zip(seen, reference, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for p in model.parameters())  # removed with the hooks when training ends


def test_without_hooks_that_read_them_no_gradients_are_formed(tmp_path: Path) -> None:
    """Lightning's own callbacks (a checkpoint, the progress bar), a hook where plain Lightning shows no gradient
    (an epoch's end) and one not made for gradients (a step's end) form none: the mean gradient is not computed."""
    model = Classifier()
    strategy = CrossbowStrategy(replicas_per_device=2)
    seen: list[bool] = []

    class AtEpochEnd(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module) -> None:
            seen.append(trainer.strategy._mean_gradients is None)
            seen.append(all(p.grad is None for p in pl_module.parameters()))

        def on_train_batch_end(self, trainer, pl_module, *args: Any) -> None:  # (a step's end: a timer, a logger)
            pass

    fit = trainer(
        strategy=strategy,
        max_epochs=2,
        callbacks=[AtEpochEnd(), ModelCheckpoint(dirpath=tmp_path, save_last=True)],
        enable_progress_bar=True,
        enable_checkpointing=True,
        default_root_dir=tmp_path,
    )
    fit.fit(model, loader(make_data(num_samples=32)))
    assert len(seen) == 4 and all(seen)


# --------------------------------------------------------------- a training_step's other outputs
class _ReturnsDict(Classifier):
    def __init__(self, with_number: bool = True) -> None:
        super().__init__()
        self.with_number = with_number

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self(x)
        out = {
            "loss": F.cross_entropy(logits, y),
            "acc": (logits.argmax(1) == y).float().mean(),
            "pred": logits.argmax(1),
        }
        return {**out, "n": len(y)} if self.with_number else out


class _Outputs(L.Callback):
    def __init__(self) -> None:
        self.outputs: list[dict[str, Any]] = []
        self.batches: list[Any] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        group = batch if isinstance(batch[0], (list, tuple)) else [batch]  # crossbow's group, or plain's batch
        with torch.no_grad():  # every replica starts at z (scaled averaging): its predictions are z's
            self.batches.append([(pl_module(x).argmax(1), y) for x, y in group])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.outputs.append(outputs)


def test_one_replica_hands_callbacks_the_outputs_plain_lightning_hands() -> None:
    dataset = make_data(num_samples=32)
    plain, crossbow = _Outputs(), _Outputs()
    trainer(max_epochs=1, callbacks=[plain]).fit(_ReturnsDict(), loader(dataset))
    trainer(strategy=CrossbowStrategy(replicas_per_device=1), max_epochs=1, callbacks=[crossbow]).fit(
        _ReturnsDict(), loader(dataset)
    )
    for a, b in zip(plain.outputs, crossbow.outputs, strict=True):
        assert a.keys() == b.keys()
        assert a["n"] == b["n"] == 8
        assert torch.equal(a["pred"], b["pred"]) and a["pred"].dtype == torch.int64
        torch.testing.assert_close(a["acc"], b["acc"])


@pytest.mark.parametrize(("engine", "with_number"), [("sequential", True), ("fused", False)])
def test_other_outputs_are_the_mean_for_scalar_metrics_and_per_replica_lists_otherwise(
    engine: str, with_number: bool
) -> None:
    seen = _Outputs()
    trainer(strategy=CrossbowStrategy(replicas_per_device=2, engine=engine), max_epochs=1, callbacks=[seen]).fit(
        _ReturnsDict(with_number), loader(make_data(num_samples=32))
    )
    for outputs, replicas in zip(seen.outputs, seen.batches, strict=True):
        assert isinstance(outputs["pred"], list) and len(outputs["pred"]) == 2
        for pred, (expected, _) in zip(outputs["pred"], replicas, strict=True):
            assert torch.equal(pred, expected)
        accuracy = sum(float((p == y).float().mean()) for p, y in replicas) / 2
        assert float(outputs["acc"]) == pytest.approx(accuracy)
        if with_number:
            assert outputs["n"] == [8, 8]


# ------------------------------------------------------------- callbacks that change the weights
class _ClampWeights(L.Callback):
    """A weight constraint applied between steps, in place (as WGAN's clipping or a max-norm constraint is)."""

    def on_train_batch_end(self, trainer, pl_module, *args: Any) -> None:
        with torch.no_grad():
            for p in pl_module.parameters():
                p.clamp_(-0.05, 0.05)


def test_a_change_a_callback_makes_to_the_weights_is_where_the_next_step_starts() -> None:
    assert_one_replica_is_plain_lightning(Classifier, make_data(num_samples=48), callbacks=lambda: [_ClampWeights()])


class _OptimizerStateAtStart(L.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        optimizer = trainer.optimizers[0]
        self.exp_avg = [optimizer.state[p]["exp_avg"].clone() for g in optimizer.param_groups for p in g["params"]]


def test_a_plain_checkpoint_seeds_every_replicas_optimizer_state(tmp_path: Path) -> None:
    dataset = make_data(num_samples=64)
    plain = trainer(max_epochs=1)
    plain.fit(Classifier(optimizer="adam"), loader(dataset))
    plain.save_checkpoint(tmp_path / "plain.ckpt")
    saved = torch.load(tmp_path / "plain.ckpt", weights_only=False)["optimizer_states"][0]["state"]

    seen = _OptimizerStateAtStart()
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=3), max_epochs=2, callbacks=[seen])
    with pytest.warns(UserWarning, match="every replica's optimizer state is the checkpoint's"):
        fit.fit(Classifier(optimizer="adam"), loader(dataset), ckpt_path=tmp_path / "plain.ckpt")
    for index, stacked in enumerate(seen.exp_avg):
        assert stacked.shape[0] == 3
        for row in stacked:
            assert torch.equal(row, saved[index]["exp_avg"])


def test_a_checkpoint_of_another_k_seeds_every_replica_with_the_mean_state(tmp_path: Path) -> None:
    dataset = make_data(num_samples=64)
    first = trainer(strategy=CrossbowStrategy(replicas_per_device=2, algorithm="sma"), max_epochs=1)
    first.fit(Classifier(optimizer="adam"), loader(dataset))
    first.save_checkpoint(tmp_path / "k2.ckpt")
    stacked_saved = torch.load(tmp_path / "k2.ckpt", weights_only=False)["crossbow"]["ranks"][0]["optimizer"]["state"]

    seen = _OptimizerStateAtStart()
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=4, algorithm="sma"), max_epochs=2, callbacks=[seen])
    with pytest.warns(UserWarning, match="re-seeded from the central model and every replica's optimizer state"):
        fit.fit(Classifier(optimizer="adam"), loader(dataset), ckpt_path=tmp_path / "k2.ckpt")
    for index, stacked in enumerate(seen.exp_avg):
        for row in stacked:
            torch.testing.assert_close(row, stacked_saved[index]["exp_avg"].mean(0))


def test_crossbow_metrics_reach_the_logger_at_the_steps_lightning_logs(tmp_path: Path) -> None:
    fit = trainer(
        strategy=CrossbowStrategy(replicas_per_device=2), max_epochs=2, logger=CSVLogger(tmp_path), log_every_n_steps=3
    )
    fit.fit(Classifier(), loader(make_data(num_samples=128)))  # 8 steps per epoch
    rows = list(csv.DictReader((tmp_path / "lightning_logs" / "version_0" / "metrics.csv").open()))
    user_steps = {row["step"] for row in rows if row.get("train_loss")}
    crossbow_steps = {row["step"] for row in rows if row.get("crossbow/replicas_per_device")}
    assert len(user_steps) == 16 // 3
    assert crossbow_steps == user_steps


class _LogsBeforeTheOptimizerStep(Classifier):
    """Logs for the epoch in training_step, and in on_before_optimizer_step (as Lightning's docs log grad_norm)."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("samples", float(len(batch[1])), on_step=False, on_epoch=True, reduce_fx="sum")
        self.log("loss_for_epoch", loss, on_epoch=True)
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.log_dict(grad_norm(self, norm_type=2))


def test_logging_in_on_before_optimizer_step_keeps_what_training_step_logged_for_the_epoch() -> None:
    """Lightning resets a hook's values of the last epoch at its first self.log of an epoch's first batch after another
    hook's: crossbow's own metrics, logged as training_step's after on_before_optimizer_step, reset that step's
    replayed logs, so every epoch lost its first step's (56 samples of 64). k=1 is plain Lightning's, at k=2 the
    sum still counts every sample."""
    metrics = {}
    for strategy, k in (("auto", 1), (CrossbowStrategy(replicas_per_device=1), 1), (CrossbowStrategy(2), 2)):
        fit = trainer(strategy=strategy, max_epochs=2, log_every_n_steps=1)
        fit.fit(_LogsBeforeTheOptimizerStep(), loader(make_data(num_samples=64)))
        metrics[k if strategy != "auto" else "plain"] = dict(fit.callback_metrics)
    assert metrics["plain"]["samples"] == metrics[1]["samples"] == metrics[2]["samples"] == 64
    assert metrics[1]["loss_for_epoch_epoch"] == metrics["plain"]["loss_for_epoch_epoch"]


class _LogsWithBatchNorm(_LogsBeforeTheOptimizerStep):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


class _LogsAroundTheOptimizerStep(Classifier):
    """Logs an epoch sum before and after the optimizer step in its own optimizer_step (training_step logs nothing)."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        self.log("before", 1.0, on_step=False, on_epoch=True, reduce_fx="sum")
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        self.log("after", 1.0, on_step=False, on_epoch=True, reduce_fx="sum")


def test_crossbows_own_metrics_make_no_later_hooks_values_reset() -> None:
    """crossbow logs its step metrics inside the optimizer step, where plain Lightning logs nothing: left as
    Lightning's last hook that logged, they made optimizer_step's second log of an epoch's first batch reset that
    hook's values (7 of 8 steps counted). Now as plain Lightning."""
    sums = {}
    for name, strategy in (("plain", "auto"), ("crossbow", CrossbowStrategy(replicas_per_device=1))):
        fit = trainer(strategy=strategy, max_epochs=2, log_every_n_steps=1)
        fit.fit(_LogsAroundTheOptimizerStep(), loader(make_data(num_samples=64)))
        sums[name] = (float(fit.callback_metrics["before"]), float(fit.callback_metrics["after"]))
    assert sums["crossbow"] == sums["plain"]


def test_stochastic_weight_averagings_batchnorm_epoch_logs_what_training_step_logs() -> None:
    """StochasticWeightAveraging's extra epoch, which updates BatchNorm's statistics with forwards only (Lightning
    skips the backward, whose end replays the replicas' logs): its training_step logs reach the callbacks as in
    plain Lightning (before: the last epoch's stale value)."""
    seen = {}
    for name, strategy in (("plain", "auto"), ("crossbow", CrossbowStrategy(replicas_per_device=1))):
        swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
        fit = trainer(strategy=strategy, max_epochs=2, callbacks=[swa])
        fit.fit(_LogsWithBatchNorm(), loader(make_data(num_samples=64)))
        seen[name] = dict(fit.callback_metrics)
    assert seen["crossbow"]["loss_for_epoch_epoch"] == seen["plain"]["loss_for_epoch_epoch"]
    assert seen["crossbow"]["samples"] == seen["plain"]["samples"] == 64


class _SwitchesToSGD(L.Callback):
    """At epoch 1 the module's configure_optimizers makes SGD instead of Adam, which a callback takes in: through
    the strategy's setup_optimizers, or by setting trainer.optimizers."""

    def __init__(self, how: str) -> None:
        self.how = how

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if trainer.current_epoch == 1:
            pl_module.hparams.optimizer = "sgd"
            if self.how == "setup_optimizers":
                trainer.strategy.setup_optimizers(trainer)
            else:
                trainer.optimizers = [pl_module.configure_optimizers()]


def test_switching_to_an_optimizer_of_a_smaller_learning_rate_is_not_a_drop_of_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """reset_on_lr_drop compares a step's learning rates with the last step's: across a switch of optimizers (SGD at
    0.1, then Adam at 0.001) those are another optimizer's, and the replicas were reset as if the rate dropped."""

    class ToAdam(L.Callback):
        def on_train_epoch_start(self, trainer: L.Trainer, pl_module: Any) -> None:
            if trainer.current_epoch == 1:
                trainer.optimizers = [torch.optim.Adam(pl_module.parameters(), lr=1e-3)]

    strategy = CrossbowStrategy(replicas_per_device=2, algorithm="easgd", reset_on_lr_drop=True)
    with caplog.at_level(logging.INFO):
        trainer(strategy=strategy, max_epochs=2, callbacks=[ToAdam()]).fit(
            Classifier(optimizer="sgd", lr=0.1), loader(make_data(num_samples=64))
        )
    assert "learning rate dropped" not in caplog.text


@pytest.mark.parametrize("how", ["setup_optimizers", "trainer.optimizers"])
def test_an_optimizer_made_during_fit_steps_the_replicas(how: str) -> None:
    """Before, the new optimizer stepped the module's parameters, which no backward reaches: training stopped
    without a word. Now k=1 is plain Lightning's run bitwise, and at k=2 the weights keep moving after the switch."""
    dataset = make_data(num_samples=64)
    assert_one_replica_is_plain_lightning(
        lambda: Classifier(optimizer="adam"), dataset, epochs=3, callbacks=lambda: [_SwitchesToSGD(how)]
    )
    weights = []

    class Weights(L.Callback):
        def on_train_epoch_end(self, trainer: L.Trainer, pl_module: Any) -> None:
            weights.append(pl_module.net[0].weight.detach().clone())

    fit = trainer(
        strategy=CrossbowStrategy(replicas_per_device=2), max_epochs=3, callbacks=[_SwitchesToSGD(how), Weights()]
    )
    fit.fit(Classifier(optimizer="adam"), loader(dataset))
    assert isinstance(fit.optimizers[0], torch.optim.SGD)
    assert not torch.equal(weights[1], weights[0]) and not torch.equal(weights[2], weights[1])


class _InitializedIn(Classifier):
    """Initialises weights in ``hook`` (``__init__``, ``on_fit_start`` or ``on_train_start``), in one of three ways
    (``how``): in place under no_grad (xavier, the first layer), through ``.data`` (the last layer, not the first
    parameter of its flat buffer), or by a new tensor given to ``.data`` (the last layer's)."""

    def __init__(self, hook: str, how: str) -> None:
        super().__init__()
        self.hook, self.how = hook, how
        if hook == "__init__":
            self._initialize()

    def _initialize(self) -> None:
        torch.manual_seed(7)
        weight = self.net[0].weight if self.how == "in place" else self.net[2].weight
        if self.how == "in place":
            with torch.no_grad():
                nn.init.xavier_uniform_(weight, gain=3.0)
        elif self.how == ".data":
            weight.data.normal_()
        else:
            weight.data = torch.full_like(weight, 0.1)

    def on_fit_start(self) -> None:
        if self.hook == "on_fit_start":
            self._initialize()

    def on_train_start(self) -> None:
        if self.hook == "on_train_start":
            self._initialize()


@pytest.mark.parametrize("how", ["in place", ".data", "a new tensor"])
@pytest.mark.parametrize("algorithm", ["sma", "easgd", "gossip"])
def test_weights_set_in_on_fit_start_or_on_train_start_are_the_learners_start(algorithm: str, how: str) -> None:
    """The replicas are made at set-up, before those hooks: under the rules that keep learners apart (whose
    learners do not restart from z every step) they started from the weights before the hook's, and gossip's z
    (their mean) dropped the hook's change altogether; a new tensor given to a parameter's ``.data`` left it out of z
    for good. Now the fit is the one initialised in __init__, bitwise."""
    weights = {}
    for hook in ("__init__", "on_fit_start", "on_train_start"):
        model = _InitializedIn(hook, how)
        trainer(strategy=CrossbowStrategy(replicas_per_device=2, algorithm=algorithm)).fit(
            model, loader(make_data(num_samples=64))
        )
        weights[hook] = [p.detach().clone() for p in model.parameters()]
    for hook in ("on_fit_start", "on_train_start"):
        for a, b in zip(weights["__init__"], weights[hook], strict=True):
            assert torch.equal(a, b)


def test_resuming_with_another_algorithm_says_so(tmp_path: Path) -> None:
    first = trainer(strategy=CrossbowStrategy(replicas_per_device=2), max_epochs=1)
    first.fit(Classifier(), loader(make_data(num_samples=32)))
    first.save_checkpoint(tmp_path / "scaled.ckpt")
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=2, algorithm="sma"), max_epochs=2)
    with pytest.warns(
        UserWarning, match="trained with algorithm='scaled_averaging' and training goes on with algorithm='sma'"
    ):
        fit.fit(Classifier(), loader(make_data(num_samples=32)), ckpt_path=tmp_path / "scaled.ckpt")
    assert fit.global_step == 4


class _SkipsLabelZeroFirstWithExtras(_SkipsLabelZeroFirst):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return None if loss is None else {"loss": loss, "pred": self(batch[0]).argmax(1), "acc": torch.tensor(0.5)}


def test_a_skipping_replica_has_none_at_its_index_in_the_other_outputs() -> None:
    seen = _Outputs()
    batches = list(loader(make_data(num_samples=32)))
    stepped = [int(y[0]) != 0 for _, y in batches]
    assert not all(stepped) and any(stepped)
    trainer(strategy=CrossbowStrategy(replicas_per_device=4, engine="sequential"), max_epochs=1, callbacks=[seen]).fit(
        _SkipsLabelZeroFirstWithExtras(), loader(make_data(num_samples=32))
    )
    (outputs,) = seen.outputs
    assert [p is not None for p in outputs["pred"]] == stepped
    assert float(outputs["acc"]) == 0.5


class _GradsAfterBackward(_GradNormSeen):
    def __init__(self) -> None:
        super().__init__()
        self.after_backward: list[list[Tensor]] = []

    def on_after_backward(self) -> None:
        self.after_backward.append([p.grad.clone() for p in self.parameters()])


def test_with_a_gradient_scaler_hooks_see_scaled_then_unscaled_gradients_as_in_plain_lightning() -> None:
    """16-mixed: on_after_backward sees the scaled gradients, on_before_optimizer_step the unscaled ones."""
    dataset = make_data(num_samples=32)
    plain, crossbow = _GradsAfterBackward(), _GradsAfterBackward()

    def scaled() -> MixedPrecision:  # (Lightning's precision="16-mixed" has no scaler on the CPU)
        return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(max_epochs=1, plugins=[scaled()]).fit(plain, loader(dataset))
        trainer(strategy=CrossbowStrategy(replicas_per_device=1), max_epochs=1, plugins=[scaled()]).fit(
            crossbow, loader(dataset)
        )
    assert plain.trainer.precision_plugin.scaler is not None
    for seen in ("after_backward", "grads"):
        for a, b in zip(getattr(plain, seen), getattr(crossbow, seen), strict=True):
            for x, y in zip(a, b, strict=True):
                torch.testing.assert_close(x, y)
    ratio = plain.after_backward[0][0].norm() / plain.grads[0][0].norm()
    assert ratio > 100  # the scale: the two hooks really see different gradients


class _WithTemperature(Classifier):
    """A 0-dim parameter (a learned temperature): its optimizer state is 0-dim too, like Adam's step count."""

    def __init__(self) -> None:
        super().__init__(optimizer="adam")
        self.temperature = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x) / self.temperature


def test_a_zero_dim_parameter_s_optimizer_state_is_seeded_per_replica(tmp_path: Path) -> None:
    dataset = make_data(num_samples=64)
    plain = trainer(max_epochs=1)
    plain.fit(_WithTemperature(), loader(dataset))
    plain.save_checkpoint(tmp_path / "plain.ckpt")
    seen = _OptimizerStateAtStart()
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=3), max_epochs=2, callbacks=[seen])
    with pytest.warns(UserWarning, match="every replica's optimizer state is the checkpoint's"):
        fit.fit(_WithTemperature(), loader(dataset), ckpt_path=tmp_path / "plain.ckpt")
    assert fit.global_step == 8 + 2  # it trained on (8 batches at k=3: 2 steps): the state has a row per replica
    assert [tuple(t.shape) for t in seen.exp_avg].count((3,)) == 1  # the temperature's, one value per replica


class _WithBatchNorm(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


class _ClearGradientsAtEpochEnd(L.Callback):
    """Drops the gradients when an epoch ends. Without it, the optimizer step that ends the BatchNorm epoch of
    ``StochasticWeightAveraging`` (whose backward Lightning skips, zeroing nothing) takes the last training step's
    gradients again, in plain Lightning as in crossbow, and moves the averaged weights."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        trainer.optimizers[0].zero_grad(set_to_none=True)


def _fit_with_swa(
    strategy: Any, dataset: Any, clear_gradients: bool = False
) -> tuple[_WithBatchNorm, StochasticWeightAveraging, list[str]]:
    torch.manual_seed(0)
    model, swa = _WithBatchNorm(), StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
    callbacks = [swa, _ClearGradientsAtEpochEnd()] if clear_gradients else [swa]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer(strategy=strategy, max_epochs=3, callbacks=callbacks).fit(model, loader(dataset))
    return model, swa, [str(w.message) for w in record if "crossbow" in str(w.message)]


def test_stochastic_weight_averaging_with_batch_norm_at_one_replica_is_plain_lightning() -> None:
    dataset = make_data(num_samples=64)
    plain, _, _ = _fit_with_swa("auto", dataset)
    for engine in ("fused", "sequential"):
        crossbow, _, warned = _fit_with_swa(CrossbowStrategy(replicas_per_device=1, engine=engine), dataset)
        assert not warned and crossbow.trainer.global_step == plain.trainer.global_step
        for (name, a), b in zip(plain.state_dict().items(), crossbow.state_dict().values(), strict=True):
            torch.testing.assert_close(
                a, b, rtol=0, atol=0, msg=name
            )  # the averaged weights, the recomputed statistics


class _KeepsGradientsForValidation(_WithBatchNorm):
    def on_validation_model_zero_grad(self) -> None:
        """Lightning's hook overridden: the gradients stay through validation."""


@pytest.mark.parametrize("module", [_WithBatchNorm, _KeepsGradientsForValidation], ids=["released", "kept"])
def test_gradients_released_before_validation_leave_swas_batch_norm_epoch_nothing_to_step(module: type) -> None:
    """Lightning releases the module's gradients before validating (``on_validation_model_zero_grad``); the replicas'
    go too, so the step that ends SWA's BatchNorm epoch (no backward) has none and leaves the averaged weights as plain
    Lightning's does (before, it took the last step's gradients again). Where the module overrides the hook, its
    gradients stay, and the step takes them in both. One replica: bitwise plain Lightning."""
    dataset = make_data(num_samples=64)
    models = {}
    for name, strategy in [
        ("plain", "auto"),
        ("fused", CrossbowStrategy(replicas_per_device=1, engine="fused")),
        ("sequential", CrossbowStrategy(replicas_per_device=1, engine="sequential")),
    ]:
        torch.manual_seed(0)
        models[name] = module()
        swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
        trainer(strategy=strategy, max_epochs=3, callbacks=[swa]).fit(
            models[name], loader(dataset), loader(make_data(num_samples=16, seed=1))
        )
    for name in ("fused", "sequential"):
        for (key, a), b in zip(models["plain"].state_dict().items(), models[name].state_dict().values(), strict=True):
            assert torch.equal(a, b), (name, key)


@pytest.mark.parametrize("clear_gradients", [True, False], ids=["gradients cleared", "gradients kept"])
@pytest.mark.parametrize("algorithm", ["scaled_averaging", "sma"])
@pytest.mark.parametrize("engine", ["fused", "sequential", "auto"])
def test_stochastic_weight_averagings_batch_norm_epoch_recomputes_the_statistics_of_the_averaged_weights(
    engine: str, algorithm: str, clear_gradients: bool
) -> None:
    """Its last epoch only runs forwards, every replica from z (the averaged weights): z's running statistics are
    then those of every batch at the averaged weights, as ``torch.optim.swa_utils.update_bn`` finds them. With no
    gradients left for the step that ends that epoch, z keeps the averaged weights (no rule moves it, not even sma's
    momentum on z), as plain Lightning's weights stay. With the last training step's gradients left, scaled
    averaging steps z with them, as plain Lightning steps its weights; sma steps only the replicas (which start at
    z: no correction), and z's momentum starts afresh at the averaged weights."""
    dataset = make_data(num_samples=64)  # 8 batches: 4 steps at k=2
    model, swa, warned = _fit_with_swa(
        CrossbowStrategy(replicas_per_device=2, engine=engine, algorithm=algorithm), dataset, clear_gradients
    )
    assert not warned  # (auto did not fall back: the forwards of that epoch run one replica after another)
    reference = copy.deepcopy(model)
    for averaged, weight in zip(swa._average_model.parameters(), reference.parameters(), strict=True):
        if clear_gradients or algorithm == "sma":  # (sma: the replicas start at z, and z's momentum is reset)
            torch.testing.assert_close(weight, averaged, rtol=0, atol=0)
        weight.data.copy_(averaged)
    torch.optim.swa_utils.update_bn(loader(dataset), reference)
    batch_norm, expected = model.net[1], reference.net[1]
    torch.testing.assert_close(batch_norm.running_mean, expected.running_mean)
    torch.testing.assert_close(batch_norm.running_var, expected.running_var)
    assert batch_norm.momentum == expected.momentum == 0.1  # (the callback put the momentum back)


def test_plain_lightnings_weights_stay_averaged_when_the_batch_norm_epoch_has_no_gradients() -> None:
    """What the test above expects of crossbow, plain Lightning does."""
    model, swa, _ = _fit_with_swa("auto", make_data(num_samples=64), clear_gradients=True)
    for averaged, weight in zip(swa._average_model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(weight, averaged, rtol=0, atol=0)


# ---------------------------------------------------------------- frozen parameters given to the optimizer
class _FrozenFirstLayer(Classifier):
    """``self.parameters()`` given to Adagrad (which makes its state at once) with the first layer frozen, as is
    common with a frozen backbone. The sample ``skip`` makes its replica skip; ``diverge`` makes its loss NaN."""

    def __init__(self, skip: Tensor, diverge: Tensor) -> None:
        super().__init__()
        self.net[0].weight.requires_grad_(False)
        self.skip, self.diverge = skip, diverge

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if torch.equal(batch[0][0], self.skip):
            return None
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if torch.equal(batch[0][0], self.diverge) else loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adagrad(self.parameters(), lr=0.1)


def test_a_frozen_parameter_in_the_optimizer_keeps_its_own_state_through_skips_divergence_and_checkpoints(
    tmp_path: Path,
) -> None:
    """The frozen weight is not replicated: its optimizer state is the optimizer's own (shaped like it), in the
    checkpoint too, which plain Lightning resumes and then trains with the weight unfrozen; a skipped or diverged
    replica leaves it alone."""
    data = make_data(num_samples=48)  # 6 batches of 8: steps of 3 at k=3
    model = _FrozenFirstLayer(skip=data[8][0], diverge=data[32][0])  # replica 1 of step 0, replica 1 of step 1
    frozen = model.net[0].weight.detach().clone()
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=3), max_epochs=1)
    with pytest.warns(UserWarning, match="replica 1 on rank 0 has a non-finite loss"):
        fit.fit(model, loader(data))
    assert torch.equal(model.net[0].weight, frozen) and all(p.isfinite().all() for p in model.parameters())
    fit.save_checkpoint(tmp_path / "frozen.ckpt")
    saved = torch.load(tmp_path / "frozen.ckpt", weights_only=False)["optimizer_states"][0]["state"]
    assert [entry["sum"].shape for entry in saved.values()] == [p.shape for p in model.parameters()]
    assert torch.equal(saved[0]["sum"], torch.zeros_like(frozen))  # (Adagrad's initial sum: never stepped)

    class Unfrozen(_FrozenFirstLayer):
        def on_train_start(self) -> None:
            self.net[0].weight.requires_grad_(True)

    never = torch.full_like(data[0][0], float("inf"))
    resumed = Unfrozen(skip=never, diverge=never)
    plain = trainer(max_epochs=2)
    plain.fit(resumed, loader(data), ckpt_path=tmp_path / "frozen.ckpt")
    assert plain.global_step == 2 + 6 and not torch.equal(resumed.net[0].weight, frozen)


# ------------------------------------------------------------------- what hooks change in the gradients
class _ClipsItsOwnGradients(Classifier):
    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05)  # (not Lightning's self.clip_gradients)


class _ZeroesAGradientAfterBackward(Classifier):
    def on_after_backward(self) -> None:
        self.net[0].weight.grad.zero_()


class _HalvesGradients(L.Callback):
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        for parameter in pl_module.parameters():
            parameter.grad = parameter.grad * 0.5  # (a new tensor, not a change in place)


@pytest.mark.parametrize("case", ["configure_gradient_clipping", "on_after_backward", "on_before_optimizer_step"])
def test_what_gradient_hooks_change_in_the_modules_gradients_is_plain_lightnings_step_at_one_replica(case: str) -> None:
    make_model = {
        "configure_gradient_clipping": _ClipsItsOwnGradients,
        "on_after_backward": _ZeroesAGradientAfterBackward,
    }
    callbacks = (lambda: [_HalvesGradients()]) if case == "on_before_optimizer_step" else list
    assert_one_replica_is_plain_lightning(make_model.get(case, Classifier), make_data(), callbacks=callbacks)


class _ReadsGradientsAfterTheStep(L.Callback):
    """Records the first layer's gradient where plain Lightning still shows the step's: after it, and before the
    next step's ``zero_grad`` (a hook made for gradients, so they are formed)."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def _record(self, pl_module: L.LightningModule) -> None:
        gradient = pl_module.net[0].weight.grad
        self.seen.append(None if gradient is None else gradient.clone())

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._record(pl_module)

    def on_before_zero_grad(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._record(pl_module)


def test_hooks_after_the_step_see_its_gradient_as_in_plain_lightning_at_one_replica() -> None:
    seen = {}
    for name, strategy in (("plain", "auto"), ("crossbow", CrossbowStrategy(replicas_per_device=1))):
        seen[name] = _ReadsGradientsAfterTheStep()
        trainer(strategy=strategy, max_epochs=2, callbacks=[seen[name]]).fit(Classifier(), loader(make_data()))
    assert len(seen["plain"].seen) == len(seen["crossbow"].seen) == 2 * (10 + 10)
    assert sum(gradient is not None for gradient in seen["plain"].seen) > 30
    for plain, ours in zip(seen["plain"].seen, seen["crossbow"].seen, strict=True):
        assert (plain is None and ours is None) or torch.equal(plain, ours)


class _ShiftsGradients(L.Callback):
    """Adds ``shift`` to every gradient of the module, in place: the gradient of ``shift * sum(p)`` added to the loss."""

    def __init__(self, shift: float) -> None:
        self.shift = shift

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        for parameter in pl_module.parameters():
            parameter.grad.add_(self.shift)


class _ShiftedLoss(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return super().training_step(batch, batch_idx) + 0.01 * sum(p.sum() for p in self.parameters())


def test_a_hooks_change_to_the_mean_gradient_reaches_every_replica() -> None:
    """At k=3, a hook that adds 0.01 to the mean gradient trains as a loss with 0.01 sum(p) added does: every
    replica's gradient gets the same shift (Crossbow's rule, whose replicas stay apart)."""
    models = []
    for make_model, callbacks in ((Classifier, [_ShiftsGradients(0.01)]), (_ShiftedLoss, [])):
        model = make_model()
        strategy = CrossbowStrategy(replicas_per_device=3, algorithm="sma", engine="sequential")
        trainer(strategy=strategy, max_epochs=2, callbacks=callbacks).fit(model, loader(make_data()))
        models.append(model)
    for shifted_by_hook, shifted_by_loss in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(shifted_by_hook, shifted_by_loss)
    assert not torch.allclose(models[0].net[0].weight, _trained_without_shift())


def _trained_without_shift() -> Tensor:
    model = Classifier()
    strategy = CrossbowStrategy(replicas_per_device=3, algorithm="sma", engine="sequential")
    trainer(strategy=strategy, max_epochs=2).fit(model, loader(make_data()))
    return model.net[0].weight


# ------------------------------------------------------ parameters frozen, unfrozen or added during training
class _FreezesTheFirstLayer(L.Callback):
    """Freezes the first layer for epoch 1 (a hand-written fine-tuning schedule), and unfreezes it for epoch 2."""

    def __init__(self) -> None:
        self.at_epoch_start: list[Tensor] = []

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.net[0].weight.requires_grad_(trainer.current_epoch != 1)
        self.at_epoch_start.append(pl_module.net[0].weight.detach().clone())


@pytest.mark.parametrize("algorithm", ["scaled_averaging", "sma", "gossip"])
def test_a_parameter_frozen_during_training_stays_as_it_is_and_trains_again_once_unfrozen(algorithm: str) -> None:
    if algorithm == "scaled_averaging":  # (the default rule, with one replica: plain Lightning's steps, bitwise)
        assert_one_replica_is_plain_lightning(
            Classifier, make_data(), epochs=3, callbacks=lambda: [_FreezesTheFirstLayer()]
        )
    model, freezes = Classifier(), _FreezesTheFirstLayer()
    strategy = CrossbowStrategy(replicas_per_device=3, algorithm=algorithm)
    trainer(strategy=strategy, max_epochs=3, callbacks=[freezes]).fit(model, loader(make_data()))
    first, frozen, unfrozen = freezes.at_epoch_start
    assert not torch.equal(first, frozen)  # trained in epoch 0,
    assert torch.equal(frozen, unfrozen)  # not in epoch 1 (z, and every replica with it: SMA's momentum too),
    assert not torch.equal(unfrozen, model.net[0].weight)  # and again in epoch 2


class _UnfreezesTheFirstLayer(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net[0].weight.requires_grad_(False)

    def on_train_epoch_start(self) -> None:
        self.net[0].weight.requires_grad_(self.current_epoch >= 1)


class _FrozenFromFitStartUntilEpoch1(Classifier):
    """Frozen in ``on_fit_start``, once crossbow made its replicas (a parameter frozen during training)."""

    def on_fit_start(self) -> None:
        self.net[0].weight.requires_grad_(False)

    def on_train_epoch_start(self) -> None:
        self.net[0].weight.requires_grad_(self.current_epoch >= 1)


@pytest.mark.parametrize("algorithm", ["scaled_averaging", "sma", "gossip"])
def test_a_parameter_frozen_when_training_started_gets_replicas_once_unfrozen(algorithm: str) -> None:
    """Frozen in ``__init__``, it has no replicas until unfrozen; then it trains as one frozen during training does
    (held at z until unfrozen; its optimizer state starts at its first step in both)."""
    if algorithm == "scaled_averaging":
        assert_one_replica_is_plain_lightning(_UnfreezesTheFirstLayer, make_data(), epochs=3)
    models = []
    for make_model in (_UnfreezesTheFirstLayer, _FrozenFromFitStartUntilEpoch1):
        model = make_model()
        strategy = CrossbowStrategy(replicas_per_device=3, algorithm=algorithm)
        trainer(strategy=strategy, max_epochs=3).fit(model, loader(make_data()))
        models.append(model)
    grown, held = models
    assert not torch.equal(grown.net[0].weight, Classifier().net[0].weight)  # (trained from epoch 1)
    for a, b in zip(grown.parameters(), held.parameters(), strict=True):
        torch.testing.assert_close(a, b)  # (in a flat buffer of its own, at another offset: rounding may differ)


class _WithBackbone(Classifier):
    """Lightning's fine-tuning set-up: a ``backbone`` and an optimizer over the parameters that are trainable."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = self.net[0]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


class _RecordsTheBackbone(L.Callback):
    def __init__(self) -> None:
        self.weights: list[Tensor] = []
        self.lrs: list[list[float]] = []

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.weights.append(module.backbone.weight.detach().clone())
        self.lrs.append([group["lr"] for group in trainer.optimizers[0].param_groups])


def test_backbone_finetuning_unfreezes_and_schedules_the_backbone_as_in_plain_lightning() -> None:
    def finetuning() -> list:
        return [BackboneFinetuning(unfreeze_backbone_at_epoch=1)]

    assert_one_replica_is_plain_lightning(_WithBackbone, make_data(), epochs=3, callbacks=finetuning)
    runs = []
    for strategy in ("auto", CrossbowStrategy(replicas_per_device=3)):
        recorder = _RecordsTheBackbone()
        callbacks = [*finetuning(), recorder]
        trainer(strategy=strategy, max_epochs=3, callbacks=callbacks).fit(_WithBackbone(), loader(make_data()))
        runs.append((recorder, callbacks[0].state_dict()))
    (plain, plain_state), (crossbow, crossbow_state) = runs
    assert crossbow.lrs == plain.lrs  # (one group, then the backbone's, its lr scheduled by the callback)
    assert crossbow_state == plain_state  # (the groups it saves, by the module's parameter names)
    initial, (epoch_0, epoch_1, epoch_2) = _WithBackbone().backbone.weight, crossbow.weights
    assert torch.equal(epoch_0, initial) and not torch.equal(epoch_1, epoch_0) and not torch.equal(epoch_2, epoch_1)


def test_a_fine_tuning_run_resumes_with_the_replicas_its_unfrozen_parameters_got(tmp_path: Path) -> None:
    """As in plain Lightning, BaseFinetuning restores the param groups on resuming and leaves the backbone frozen
    (its ``setup`` freezes it; only the epoch of unfreezing unfreezes it): at k=1, crossbow resumes exactly as plain
    Lightning does; at k=3 (SMA: replicas apart from z), the replicas the backbone got, and their optimizer state,
    are restored as they were saved, not re-seeded from z."""
    checkpoint = tmp_path / "finetuned.ckpt"
    for strategy in ("auto", "k=1", "k=3"):

        def fit(max_epochs: int, callbacks: list, ckpt_path: Any = None) -> _WithBackbone:
            model = _WithBackbone()
            chosen = {"auto": "auto", "k=1": CrossbowStrategy(1), "k=3": CrossbowStrategy(3, algorithm="sma")}[strategy]
            callbacks = [BackboneFinetuning(unfreeze_backbone_at_epoch=1), *callbacks]
            trainer(strategy=chosen, max_epochs=max_epochs, callbacks=callbacks).fit(
                model, loader(make_data()), ckpt_path=ckpt_path
            )
            return model

        saving = _SavesAtTheEnd(checkpoint)
        fit(2, [saving])
        restored = _RecordsTheRestoredStack()
        model = fit(3, [restored], ckpt_path=checkpoint)
        saved = torch.load(checkpoint, weights_only=False)
        assert torch.equal(model.backbone.weight, saved["state_dict"]["net.0.weight"])  # (frozen, as in plain)
        if strategy == "auto":
            plain = model
            continue
        if strategy == "k=1":
            for a, b in zip(plain.parameters(), model.parameters(), strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        rank = saved["crossbow"]["ranks"][0]
        assert (
            rank["stack"]["names"]
            == restored.stack["names"]
            == [["net.2.weight", "net.2.bias"], ["net.0.weight", "net.0.bias"]]
        )
        for a, b in zip(rank["stack"]["replicas"], restored.stack["replicas"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        momenta = [state["momentum_buffer"] for _, state in sorted(rank["optimizer"]["state"].items())]
        assert len(momenta) == len(restored.momenta) == 4
        for a, b in zip(momenta, restored.momenta, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_resuming_a_fine_tuning_run_without_its_callback_is_refused_naming_the_param_groups(tmp_path: Path) -> None:
    checkpoint = tmp_path / "finetuned.ckpt"
    callbacks = [BackboneFinetuning(unfreeze_backbone_at_epoch=1), _SavesAtTheEnd(checkpoint)]
    trainer(strategy=CrossbowStrategy(replicas_per_device=2), max_epochs=2, callbacks=callbacks).fit(
        _WithBackbone(), loader(make_data())
    )
    resumed = trainer(strategy=CrossbowStrategy(replicas_per_device=2), max_epochs=3)
    with pytest.raises(ValueError, match=r"checkpoint's optimizer has 2 param group\(s\) and this run's has 1\."):
        resumed.fit(_WithBackbone(), loader(make_data()), ckpt_path=checkpoint)


class _UnfreezesInTwoStages(BaseFinetuning):
    """Freezes both layers before training; unfreezes the last at epoch 1 and the first at epoch 2 (again at every
    later epoch, so that a resumed run unfreezes them as well)."""

    def freeze_before_training(self, module: L.LightningModule) -> None:
        self.freeze([module.net[0], module.net[2]])

    def finetune_function(self, module: L.LightningModule, epoch: int, optimizer: Any) -> None:
        if epoch >= 1:
            self.unfreeze_and_add_param_group(module.net[2], optimizer, lr=0.05)
        if epoch >= 2:
            self.unfreeze_and_add_param_group(module.net[0], optimizer, lr=0.02)


class _WithABias(_WithBackbone):
    """With a parameter of its own, trainable from the start (the two stages freeze both layers before training)."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(3))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x) + self.shift


@pytest.mark.parametrize("how", ["in a module hook", "by BaseFinetuning, in two stages"])
def test_a_run_that_unfroze_parameters_resumes_bitwise_as_it_went_on(how: str, tmp_path: Path) -> None:
    """Resumed after the parameters frozen when training started got their replicas, a run goes on bitwise as
    without the interruption: they get their replicas again, in the same flat buffers, and take their saved
    replicas and optimizer state (also when a hook unfreezes them only once the resumed run has started)."""
    make_model, callbacks, epochs, resume_at = (
        (_UnfreezesTheFirstLayer, list, 3, "epoch=1.ckpt")
        if how == "in a module hook"
        else (_WithABias, lambda: [_UnfreezesInTwoStages()], 4, "epoch=2.ckpt")
    )
    models = []
    for ckpt_path in (None, tmp_path / resume_at):
        model = make_model()
        saving = [ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, filename="{epoch}")] if ckpt_path is None else []
        strategy = CrossbowStrategy(replicas_per_device=3, algorithm="sma")  # (replicas apart from z)
        fit = trainer(
            strategy=strategy,
            max_epochs=epochs,
            callbacks=[*callbacks(), *saving],
            enable_checkpointing=True,
            default_root_dir=tmp_path,  # (the resumed fit's default ModelCheckpoint writes there, not in the cwd)
        )
        fit.fit(model, loader(make_data()), ckpt_path=ckpt_path)
        models.append(model)
    for a, b in zip(*(model.parameters() for model in models), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _SavesAtTheEnd(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


class _RecordsTheRestoredStack(L.Callback):
    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if isinstance(trainer.strategy, CrossbowStrategy):
            self.stack = trainer.strategy.stack.state_dict()
            optimizer = trainer.optimizers[0]
            self.momenta = [
                optimizer.state[p]["momentum_buffer"].clone() for g in optimizer.param_groups for p in g["params"]
            ]


class _AddsTheFirstLayerToTheOptimizer(Classifier):
    """Trains the last layer, and from epoch 1 also the first (``add_param_group``)."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.net[2].parameters(), lr=0.1, momentum=0.9)

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == 1:
            self.trainer.optimizers[0].add_param_group({"params": list(self.net[0].parameters())})


def test_a_param_group_added_during_training_trains_its_parameters() -> None:
    assert_one_replica_is_plain_lightning(_AddsTheFirstLayerToTheOptimizer, make_data(), epochs=2)
    model = _AddsTheFirstLayerToTheOptimizer()
    before = model.net[0].weight.detach().clone()
    trainer(strategy=CrossbowStrategy(replicas_per_device=3), max_epochs=2).fit(model, loader(make_data()))
    assert not torch.equal(before, model.net[0].weight)

    class AddsAParameterTwice(_AddsTheFirstLayerToTheOptimizer):
        def on_train_epoch_start(self) -> None:
            if self.current_epoch == 1:
                self.trainer.optimizers[0].add_param_group({"params": [self.net[2].weight]})

    with pytest.raises(ValueError, match="holds parameters that another group already holds"):
        trainer(strategy=CrossbowStrategy(replicas_per_device=3), max_epochs=2).fit(
            AddsAParameterTwice(), loader(make_data())
        )


class _EditsThenClipsInConfigureGradientClipping(Classifier):
    """Lightning's documented pattern: change the gradients, then ``self.clip_gradients``."""

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, **kwargs: Any) -> None:
        for parameter in self.parameters():
            parameter.grad.mul_(3.0)
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")


class _EditsThroughData(Classifier):
    def on_after_backward(self) -> None:
        self.net[0].weight.grad.data.mul_(0.0)  # (does not move the gradient's version counter)


class _FreezesMidAccumulationAndScalesWhatItSees(Classifier):
    """Freezes the first layer at batch 3 (between two accumulated batches) and doubles every gradient it is shown:
    a frozen parameter must be shown no gradient from the next step on, as in plain Lightning."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 3:
            self.net[0].weight.requires_grad_(False)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        for parameter in self.parameters():
            if parameter.grad is not None:
                parameter.grad.mul_(2.0)


@pytest.mark.parametrize(
    "make_model",
    [_EditsThenClipsInConfigureGradientClipping, _EditsThroughData, _FreezesMidAccumulationAndScalesWhatItSees],
    ids=["edit then self.clip_gradients", "edit through .data", "frozen mid-accumulation, shown no gradient"],
)
def test_gradient_changes_are_plain_lightnings_at_one_replica_in_harder_cases(make_model: Any) -> None:
    assert_one_replica_is_plain_lightning(make_model, make_data(), accumulate_grad_batches=2)


class _ClipsAndSkipsOrDiverges(Classifier):
    """Zeroes the first layer's mean gradient in ``on_after_backward`` and clips them all; the replica of sample
    ``odd`` skips the step (``"skip"``) or gets a NaN loss (``"nan"``)."""

    def __init__(self, odd: Tensor, how: str) -> None:
        super().__init__(optimizer="plain_sgd")
        self.odd, self.how = odd, how

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        odd = torch.equal(batch[0][0], self.odd)
        if odd and self.how == "skip":
            return None
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if odd else loss

    def on_after_backward(self) -> None:
        self.net[0].weight.grad.zero_()
        torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05)


@pytest.mark.parametrize("how", ["skip", "nan"])
def test_a_replica_left_out_of_the_step_is_left_out_of_the_mean_that_hooks_change(how: str) -> None:
    """The hook zeroes the first layer's mean gradient over the replicas that take the step: with plain SGD, z's
    first layer then does not move (a skipped replica's zero gradient in the mean would move it; a diverged one's
    NaN would make every replica, and z, NaN)."""
    data = make_data()
    model = _ClipsAndSkipsOrDiverges(odd=data[8][0], how=how)  # (replica 1 of the first step)
    before = model.net[0].weight.detach().clone()
    strategy = CrossbowStrategy(replicas_per_device=2, engine="sequential")  # (scaled averaging: z takes each step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the NaN replica's warning)
        trainer(strategy=strategy, max_steps=2).fit(model, loader(data))
    torch.testing.assert_close(model.net[0].weight, before, rtol=0, atol=1e-7)
    assert all(p.isfinite().all() for p in model.parameters())


class _GradientsSeenAroundZeroGrad(L.Callback):
    """What the module's gradients are at ``on_before_zero_grad`` (the last step's) and at ``on_before_backward``
    (none: ``zero_grad`` cleared them); its ``on_after_backward`` makes crossbow show gradients at all."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, list[Any]]] = []

    def _record(self, hook: str, pl_module: L.LightningModule) -> None:
        self.seen.append((hook, [None if p.grad is None else p.grad.clone() for p in pl_module.parameters()]))

    def on_before_zero_grad(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._record("on_before_zero_grad", pl_module)

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Tensor) -> None:
        self._record("on_before_backward", pl_module)

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record("on_after_backward", pl_module)


def test_the_modules_gradients_are_cleared_when_zero_grad_clears_the_replicas() -> None:
    seen = []
    for strategy in ("auto", CrossbowStrategy(replicas_per_device=1)):
        callback = _GradientsSeenAroundZeroGrad()
        trainer(strategy=strategy, max_steps=3, callbacks=[callback]).fit(Classifier(), loader(make_data()))
        seen.append(callback.seen)
    plain, crossbow = seen
    assert [hook for hook, _ in plain] == [hook for hook, _ in crossbow]
    for (hook, expected), (_, got) in zip(plain, crossbow):
        assert [g is None for g in expected] == [g is None for g in got], hook
        for e, g in zip(expected, got):
            if e is not None:
                torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert any(hook == "on_before_zero_grad" and grads[0] is not None for hook, grads in plain)  # (not vacuous)


class _SchedulesItsBuffers(Classifier):
    """Buffers that hooks change outside the step, as schedules, counters and EMAs do: a temperature annealed at each
    epoch's start (in place) and read by the step, a step counter (in place, after every batch), a last-epoch mark
    assigned anew at each epoch's end, and an ``AveragedModel`` of the network updated after every optimizer step
    (its ``n_averaged`` buffer counts the updates)."""

    def __init__(self) -> None:
        super().__init__(optimizer="plain_sgd")
        self.register_buffer("temperature", torch.tensor(1.0))
        self.register_buffer("steps_done", torch.zeros((), dtype=torch.long))
        self.register_buffer("last_epoch", torch.tensor(-1))
        self.ema = torch.optim.swa_utils.AveragedModel(self.net, multi_avg_fn=None)
        self.ema.requires_grad_(False)
        self.temperatures_read: list[float] = []

    def on_train_epoch_start(self) -> None:
        self.temperature.fill_(0.5**self.current_epoch)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        if not is_functorch_wrapped_tensor(self.temperature):  # (one replica at a time: what it reads)
            self.temperatures_read.append(float(self.temperature))
        return nn.functional.cross_entropy(self(x) / self.temperature, y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.steps_done += 1
        self.ema.update_parameters(self.net)

    def on_train_epoch_end(self) -> None:
        self.last_epoch = torch.tensor(self.current_epoch)


@pytest.mark.parametrize("engine", ["fused", "sequential"])
def test_buffers_that_hooks_change_keep_their_values_as_in_plain_lightning(engine: str) -> None:
    """A buffer of the module that a hook changes (in place or assigned anew) keeps the hook's value: the replicas
    take it, and the replicas' mean does not overwrite it. At k=1, bitwise plain Lightning's run; at k=3, the
    counters count crossbow's steps and every replica reads the annealed temperature."""
    results = {}
    for name, strategy, replicas in [
        ("plain", "auto", 1),
        ("k=1", CrossbowStrategy(replicas_per_device=1, engine=engine), 1),
        ("k=3", CrossbowStrategy(replicas_per_device=3, engine=engine), 3),
    ]:
        torch.manual_seed(0)
        model = _SchedulesItsBuffers()
        fit = trainer(strategy=strategy, max_epochs=3)
        fit.fit(model, loader(make_data(num_samples=48)))
        results[name] = (model, fit.global_step, replicas)
    plain = results["plain"][0]
    assert int(plain.steps_done) == 18 and int(plain.ema.n_averaged) == 18 and float(plain.temperature) == 0.25
    one = results["k=1"][0]
    for mine, theirs in zip(one.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs)
    assert one.temperatures_read == plain.temperatures_read
    three, steps, k = results["k=3"]
    assert steps == 6 and int(three.steps_done) == 6 and int(three.ema.n_averaged) == 6
    assert float(three.temperature) == 0.25 and int(three.last_epoch) == 2
    if engine == "sequential":  # each replica reads the temperature of its epoch: 1, 0.5, 0.25 for 2 steps each
        assert three.temperatures_read == [t for t in (1.0, 0.5, 0.25) for _ in range(2 * k)]


class _ScalesAtFitStart(Classifier):
    """A buffer that ``on_fit_start`` sets (after a resume's checkpoint was restored), read by every step."""

    def __init__(self, scale_at_fit_start: float) -> None:
        super().__init__(optimizer="plain_sgd")
        self.register_buffer("scale", torch.tensor(1.0))
        self.scale_at_fit_start = scale_at_fit_start

    def on_fit_start(self) -> None:
        self.scale.fill_(self.scale_at_fit_start)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x) * self.scale, y)


def test_a_buffer_set_at_fit_start_of_a_resumed_fit_is_taken_by_the_restored_replicas(tmp_path: Path) -> None:
    """A resumed fit restores z's buffers before the replicas are made and the replicas' own from crossbow's state
    after ``on_fit_start``: what that hook set goes to the restored replicas too, as in plain Lightning (bitwise at
    k=1)."""
    states = {}
    for name, make in [("plain", lambda: "auto"), ("crossbow", lambda: CrossbowStrategy(replicas_per_device=1))]:
        torch.manual_seed(0)
        first = trainer(strategy=make(), max_epochs=1)
        first.fit(_ScalesAtFitStart(2.0), loader(make_data(num_samples=32)))
        first.save_checkpoint(tmp_path / f"{name}.ckpt")
        model = _ScalesAtFitStart(0.5)
        trainer(strategy=make(), max_epochs=3).fit(
            model, loader(make_data(num_samples=32)), ckpt_path=tmp_path / f"{name}.ckpt"
        )
        states[name] = model.state_dict()
    assert float(states["plain"]["scale"]) == 0.5
    for key, value in states["plain"].items():
        assert torch.equal(states["crossbow"][key], value), key
