"""Bad input fails before training with an error that names the argument and what is allowed."""

from __future__ import annotations

import math
import pickle
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelPruning, StochasticWeightAveraging
from torch import nn

from lightning_crossbow import CrossbowAccelerator, CrossbowStrategy
from tests.helpers import Classifier, loader, make_data, trainer


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "4", None])
def test_replicas_per_device_must_be_a_positive_int(value) -> None:
    with pytest.raises(ValueError, match=r"replicas_per_device must be a positive int .* got"):
        CrossbowStrategy(replicas_per_device=value)


@pytest.mark.parametrize("value", [0, 0.0, -0.1, 1.5, math.nan, "0.5"])
def test_alpha_must_lie_in_zero_one(value) -> None:
    with pytest.raises(ValueError, match=r"alpha must be a number in \(0, 1\] or None"):
        CrossbowStrategy(algorithm="sma", alpha=value)


@pytest.mark.parametrize("value", [1.0, -0.1, 2, math.inf])
def test_central_momentum_must_lie_in_zero_one(value) -> None:
    with pytest.raises(ValueError, match=r"central_momentum must be a number in \[0, 1\)"):
        CrossbowStrategy(central_momentum=value)


@pytest.mark.parametrize("value", ["slowmo", "SMA", None])
def test_unknown_algorithm(value) -> None:
    with pytest.raises(ValueError, match=r"algorithm must be one of 'scaled_averaging', 'sma', 'easgd', 'gossip', got"):
        CrossbowStrategy(algorithm=value)


@pytest.mark.parametrize("value", [0, -1.0, "auto", math.nan, None])
def test_outer_lr_must_be_adaptive_linear_or_positive(value) -> None:
    with pytest.raises(ValueError, match=r"outer_lr must be 'adaptive', 'linear' or a positive number, got"):
        CrossbowStrategy(outer_lr=value)


@pytest.mark.parametrize("value", [-1, math.nan, "1"])
def test_warmup_epochs_must_be_non_negative(value) -> None:
    with pytest.raises(ValueError, match=r"warmup_epochs must be a number >= 0, got"):
        CrossbowStrategy(warmup_epochs=value)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"alpha": 0.5}, r"alpha applies to algorithm='sma' and 'easgd'"),
        (
            {"algorithm": "sma", "outer_lr": 2.0},
            r"outer_lr and warmup_epochs apply to algorithm='scaled_averaging', not 'sma'",
        ),
        ({"algorithm": "easgd", "warmup_epochs": 1}, r"outer_lr and warmup_epochs apply to .*not 'easgd'"),
        (
            {"algorithm": "easgd", "central_momentum": 0.9},
            r"algorithm='easgd' has no central momentum.*algorithm='sma'",
        ),
        ({"algorithm": "gossip", "alpha": 0.5}, r"alpha and central_momentum do not apply to algorithm='gossip'"),
        ({"algorithm": "gossip", "outer_lr": "linear"}, r"outer_lr and warmup_epochs apply to .*not 'gossip'"),
    ],
)
def test_arguments_that_do_not_apply_to_the_algorithm(arguments, message) -> None:
    with pytest.raises(ValueError, match=message):
        CrossbowStrategy(**arguments)


@pytest.mark.parametrize("value", ["cuda_streams", "vmap", ""])
def test_unknown_engine(value) -> None:
    with pytest.raises(ValueError, match=r"engine must be one of 'auto', 'fused', 'sequential', 'streams'"):
        CrossbowStrategy(engine=value)


def test_the_streams_engine_needs_cuda_and_says_so_before_training() -> None:
    model = Classifier()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(
        ValueError, match=r"engine='streams' .* needs a CUDA device; this run is on cpu\. Use engine='auto'"
    ):
        trainer(strategy=CrossbowStrategy(replicas_per_device=2, engine="streams")).fit(model, loader(make_data()))
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())  # nothing trained


class _Manual(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class _TwoOptimizers(Classifier):
    def configure_optimizers(self):
        return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.SGD(self.parameters(), lr=0.1)]


class _DrawsItsBatches(Classifier):
    def training_step(self, dataloader_iter):
        batch, batch_idx, _ = next(dataloader_iter)
        return super().training_step(batch, batch_idx)


class _LBFGS(Classifier):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


class MySGD(torch.optim.SGD):
    pass


class _Custom(Classifier):
    def configure_optimizers(self):
        return MySGD(self.parameters(), lr=0.1)


class _Lazy(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LazyLinear(8), nn.Tanh(), nn.Linear(8, 3))


class _NeverTrains(L.Callback):
    def on_train_batch_start(self, *args) -> None:
        raise AssertionError("training started")


@pytest.mark.parametrize(
    ("model", "error", "pattern"),
    [
        (_Manual, RuntimeError, "automatic optimization only"),
        (_DrawsItsBatches, RuntimeError, r"does not support training_step\(self, dataloader_iter\): crossbow hands"),
        (_TwoOptimizers, RuntimeError, "exactly one optimizer from configure_optimizers, got more than one"),
        (_LBFGS, TypeError, "cannot use the optimizer LBFGS: L-BFGS steps every parameter together .* Use an"),
        (_Custom, TypeError, r"MySGD subclasses SGD, which is: if it .*\(elementwise_optimizers=\[MySGD\]"),
        (_Lazy, ValueError, r"cannot replicate net.0.weight, net.0.bias: uninitialized \(a lazy module's"),
    ],
)
def test_unsupported_training_setups_fail_before_training(model, error, pattern) -> None:
    with pytest.raises(error, match=pattern):
        trainer(strategy=CrossbowStrategy(replicas_per_device=2), callbacks=[_NeverTrains()]).fit(
            model(), loader(make_data())
        )


def test_a_declared_elementwise_optimizer_is_accepted() -> None:
    model = _Custom()
    strategy = CrossbowStrategy(replicas_per_device=2, elementwise_optimizers=[MySGD])
    trainer(strategy=strategy, max_steps=1).fit(model, loader(make_data()))
    assert model.trainer.global_step == 1


def test_strategy_and_accelerator_names_are_registered() -> None:
    t = L.Trainer(strategy="crossbow", logger=False)
    assert isinstance(t.strategy, CrossbowStrategy) and t.strategy.auto_replicas  # k is tuned while training
    assert t.strategy.algorithm == "scaled_averaging"
    spawn = L.Trainer(strategy="crossbow_spawn", logger=False).strategy
    assert spawn._start_method == "spawn" and spawn.auto_replicas
    t = L.Trainer(strategy="crossbow", accelerator="crossbow", devices=1, logger=False)
    assert isinstance(t.accelerator, CrossbowAccelerator)
    assert t.strategy.root_device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_sync_batchnorm_is_refused_for_training_with_the_reason() -> None:
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=2), sync_batchnorm=True)
    with pytest.raises(ValueError, match=r"does not support Trainer\(sync_batchnorm=True\): each replica keeps"):
        fit.fit(Classifier(), loader(make_data()))
    fit.validate(Classifier(), loader(make_data()))  # evaluation uses the running statistics: nothing to refuse


class _WithSyncBatchNorm(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(
            torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
        )


def test_sync_batchnorm_layers_are_refused_before_training_naming_them() -> None:
    """A model converted by the user (nn.SyncBatchNorm.convert_sync_batchnorm) is refused as sync_batchnorm=True is,
    before any training (PyTorch's own error, on CPU, came from inside the first step)."""
    model = _WithSyncBatchNorm()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"does not train SyncBatchNorm layers \(net\.1\): each replica keeps"):
        trainer(strategy=CrossbowStrategy(replicas_per_device=2)).fit(model, loader(make_data()))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


def test_the_accelerators_device_stats_add_to_lightnings_own() -> None:
    from lightning.pytorch.accelerators import CPUAccelerator

    accelerator = CrossbowAccelerator("cpu")
    accelerator.samples_per_second = 123.0
    stats = accelerator.get_device_stats("cpu")
    assert set(CPUAccelerator().get_device_stats("cpu")) < set(stats)  # cpu_percent, ... are kept
    assert stats["memory_free_bytes"] > 0 and stats["crossbow/samples_per_sec"] == 123.0


def test_an_accelerator_given_a_device_type_keeps_it_on_a_machine_with_the_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Lightning asks the accelerator's class for the devices: CrossbowAccelerator("cpu") answers for the CPU even
    where CUDA is available, and CrossbowAccelerator("cuda") says it is unavailable where CUDA is not."""
    from lightning.pytorch.accelerators import CUDAAccelerator
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    cpu = CrossbowAccelerator("cpu")
    assert isinstance(cpu, CrossbowAccelerator) and cpu.device_type == "cpu"
    assert type(pickle.loads(pickle.dumps(cpu))) is type(cpu)  # (spawned processes get it pickled)
    with monkeypatch.context() as cuda_machine:
        cuda_machine.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: True))
        cuda_machine.setattr(CUDAAccelerator, "get_parallel_devices", staticmethod(lambda d: [torch.device("cuda", 0)]))
        assert type(cpu).get_parallel_devices(type(cpu).parse_devices(2)) == [torch.device("cpu")] * 2
        assert type(cpu).is_available()
        assert type(CrossbowAccelerator()).get_parallel_devices(1) == [torch.device("cuda", 0)]  # (None: CUDA here)
    if not torch.cuda.is_available():
        with pytest.raises(MisconfigurationException, match="CrossbowCUDAAccelerator` can not run on your system"):
            L.Trainer(accelerator=CrossbowAccelerator("cuda"), strategy=CrossbowStrategy(replicas_per_device=2))
    with pytest.raises(ValueError, match=r"device_type must be 'cuda' or 'cpu', got \['cpu'\]"):
        CrossbowAccelerator(["cpu"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="CrossbowCPUAccelerator runs on 'cpu', not 'cuda': use CrossbowAccelerator"):
        type(cpu)("cuda")
    assert type(cpu)().device_type == "cpu"


def test_model_pruning_whose_work_the_replicas_would_undo_is_refused_before_training() -> None:
    model, started = Classifier(), []
    callback = ModelPruning("l1_unstructured", amount=0.5)
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=2), max_epochs=2, callbacks=[callback])
    model.on_train_batch_start = lambda *args: started.append(True)
    with pytest.raises(ValueError, match="ModelPruning callback: it re-registers each pruned parameter"):
        fit.fit(model, loader(make_data(num_samples=32)))
    assert not started


def test_stochastic_weight_averaging_without_batch_norm_trains() -> None:
    fit = trainer(
        strategy=CrossbowStrategy(replicas_per_device=2),
        max_epochs=2,
        callbacks=[StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)],
    )
    fit.fit(Classifier(), loader(make_data(num_samples=32)))
    assert fit.global_step == 4  # 2 epochs of 2 steps


def test_numpy_numbers_are_accepted_as_numbers() -> None:
    np = pytest.importorskip("numpy")
    strategy = CrossbowStrategy(replicas_per_device=np.int64(2), algorithm="sma", alpha=np.float32(0.25))
    assert strategy.replicas_per_device == 2 and type(strategy.replicas_per_device) is int
    assert strategy.alpha == 0.25


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(reset_on_lr_drop="no"), "reset_on_lr_drop must be True or False, got 'no'"),
        (dict(elementwise_optimizers=["MySGD"]), "elementwise_optimizers must list optimizer classes.*got 'MySGD'"),
        (dict(elementwise_optimizers="SGD"), r"optimizer classes.*got 'SGD' \(a name: give the class itself\)\."),
        (dict(elementwise_optimizers=[int]), "elementwise_optimizers must list optimizer classes"),
        (dict(parallel_devices="cpu"), "parallel_devices must be a list of torch.device or None, got 'cpu'"),
        (dict(cluster_environment="slurm"), "cluster_environment must be a lightning.fabric.plugins.Cluster"),
        (dict(checkpoint_io="torch"), "checkpoint_io must be a lightning.fabric.plugins.CheckpointIO or None"),
        (dict(precision_plugin="bf16"), "precision_plugin must be a lightning.pytorch.plugins.precision.Precision"),
        (dict(accelerator="cpu"), "accelerator must be a lightning.pytorch.accelerators.Accelerator or None"),
        (dict(process_group_backend="nonsense"), "process_group_backend must be one of 'gloo', 'nccl'.*'nonsense'"),
        (dict(process_group_backend=5), r"process_group_backend must be one of .*or None \(gloo on CPU.*got 5"),
        (dict(timeout=30), "timeout must be a datetime.timedelta or None, got 30"),
        (dict(start_method="bogus"), "start_method must be one of 'popen', 'spawn', 'fork', 'forkserver'"),
    ],
)
def test_more_bad_arguments_are_named(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        CrossbowStrategy(replicas_per_device=2, **kwargs)


def test_one_optimizer_class_alone_may_be_declared_elementwise() -> None:
    class MySGD(torch.optim.SGD):
        pass

    assert CrossbowStrategy(elementwise_optimizers=MySGD).elementwise_optimizers == (MySGD,)


def test_no_optimizer_is_refused_before_training() -> None:
    class NoOptimizer(Classifier):
        def configure_optimizers(self):
            return None

    with pytest.raises(RuntimeError, match="exactly one optimizer from configure_optimizers, got none"):
        trainer(strategy=CrossbowStrategy(replicas_per_device=2), max_epochs=1).fit(
            NoOptimizer(), loader(make_data(num_samples=32))
        )


@pytest.mark.parametrize(
    ("loaders", "got"),
    [
        ({"a": loader(make_data(num_samples=32)), "b": loader(make_data(num_samples=32))}, "a dict of 2 loader"),
        ([loader(make_data(num_samples=32))], "a list of 1 loader"),
    ],
    ids=["a dict of two", "a list of one"],
)
def test_several_training_loaders_are_refused_before_the_first_step(loaders: Any, got: str) -> None:
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=1))
    with pytest.raises(
        ValueError, match=rf"crossbow trains on one training DataLoader.*got {got}.*Pass one DataLoader"
    ):
        fit.fit(Classifier(), loaders)
    assert fit.global_step == 0


def test_backend_names_are_taken_as_torch_takes_them() -> None:
    for backend in ("gloo", "GLOO", "cpu:gloo,cuda:nccl"):
        assert CrossbowStrategy(process_group_backend=backend).process_group_backend == backend


class _ReturnsANonTensor(Classifier):
    """Returns ``loss`` (not a tensor) in place of its loss, or, with ``as_dict``, a dict whose 'loss' it is."""

    def __init__(self, loss: Any, as_dict: bool) -> None:
        super().__init__()
        self.loss, self.as_dict = loss, as_dict

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        super().training_step(batch, batch_idx)
        return {"loss": self.loss} if self.as_dict else self.loss


@pytest.mark.parametrize("engine", ["fused", "sequential", "auto"])
@pytest.mark.parametrize(
    ("loss", "as_dict", "message"),
    [
        (1.5, True, "training_step returned a dict whose 'loss' is a float; it must be a tensor"),
        (1.5, False, "training_step must return a loss tensor, a dict with a 'loss' key, or None; got float"),
        (None, True, r"training_step returned a dict whose 'loss' is None; .* return None instead of the dict"),
    ],
    ids=["dict", "number", "dict of None"],  # (plain Lightning refuses a dict whose 'loss' is None too)
)
def test_a_loss_that_is_not_a_tensor_gets_one_clear_error_from_every_engine(
    engine: str, loss: Any, as_dict: bool, message: str, recwarn: pytest.WarningsRecorder
) -> None:
    with pytest.raises(TypeError, match=message):
        trainer(strategy=CrossbowStrategy(replicas_per_device=2, engine=engine), max_steps=1).fit(
            _ReturnsANonTensor(loss, as_dict), loader(make_data())
        )
    assert not [w for w in recwarn if "Falling back" in str(w.message)]  # (auto: the same error either way)


class _ClampsInTheStep(Classifier):
    """Projects its first layer's weights in training_step (a max-norm constraint)."""

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            self.net[0].weight.clamp_(-0.3, 0.3)
        return super().training_step(batch, batch_idx)


def test_a_parameter_changed_in_place_in_the_step_says_what_the_sequential_engine_cannot_run() -> None:
    """Under the sequential engine each replica's weights are unbind views, which autograd does not let the step change
    in place: the error says so and where to change them (before: PyTorch's own "Output 0 of Unbind is a view" alone).
    The fused engine runs the step, each replica clamping its own weights."""
    fit = trainer(strategy=CrossbowStrategy(replicas_per_device=2, engine="sequential"))
    with pytest.raises(RuntimeError, match=r"training_step changed a parameter in place .* engine='fused'"):
        fit.fit(_ClampsInTheStep(), loader(make_data()))
    model = _ClampsInTheStep()
    fused = trainer(strategy=CrossbowStrategy(replicas_per_device=2, engine="fused"), max_steps=2)
    fused.fit(model, loader(make_data()))
    assert model.trainer.global_step == 2
