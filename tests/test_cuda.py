"""On a CUDA device: the streams engine, engine="auto"'s choice, the fused engine in bf16-mixed, the
memory guard, two GPUs over NCCL, and code written while no GPU was at hand (the accelerator's device type, the
corrected embedding under vmap, z's buffers after every step).

Every test here is skipped where there is no CUDA device (CI has none). On a GPU machine:
``python -m pytest tests/test_cuda.py``.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_crossbow import CrossbowAccelerator, CrossbowStrategy, ReplicaAutoTuner
from lightning_crossbow.accelerator import device_memory
from lightning_crossbow.engines import FastestEngine, StreamsEngine
from tests.helpers import (
    BranchesOnTheData,
    Classifier,
    ReplicaSnapshot,
    assert_one_replica_is_plain_lightning,
    loader,
    make_data,
    trainer,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class EngineSpy(ReplicaSnapshot):
    """Keeps the replicas at the end of training and the engine at the last step."""

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.engine = trainer.strategy.engine


def cuda_fit(engine: str, k: int = 4, epochs: int = 2, model: Any = None, **kwargs: Any) -> EngineSpy:
    """Trains on one GPU (192 samples, batches of 8: 24 batches, 24/k steps per epoch); returns the spy."""
    spy = EngineSpy()
    strategy = CrossbowStrategy(replicas_per_device=k, engine=engine, algorithm="sma")
    fit = trainer(accelerator="cuda", devices=1, strategy=strategy, callbacks=[spy], max_epochs=epochs, **kwargs)
    fit.fit(model or Classifier(), loader(make_data(num_samples=192)))
    return spy


def assert_same_replicas(a: EngineSpy, b: EngineSpy) -> None:
    for name, value in b.params.items():
        torch.testing.assert_close(a.params[name], value, rtol=1e-5, atol=1e-5)


def test_the_streams_engine_gives_the_sequential_engines_values_on_cuda() -> None:
    assert_same_replicas(cuda_fit("streams"), cuda_fit("sequential"))


class StreamRecorder(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.streams: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.streams.append(torch.cuda.current_stream().stream_id)
        return super().training_step(batch, batch_idx)


def test_every_replica_runs_on_its_own_stream_and_none_on_the_default_stream() -> None:
    model = StreamRecorder()
    cuda_fit("streams", k=4, epochs=1, model=model)
    per_step = [model.streams[i : i + 4] for i in range(0, len(model.streams), 4)]
    default = torch.cuda.default_stream().stream_id
    assert per_step[0] == [default] * 4  # the first step runs one replica after another, watching for metrics
    assert len(set(per_step[1])) == 4 and default not in per_step[1]
    assert all(step == per_step[1] for step in per_step[1:])  # the pool's streams are reused from step to step


def test_auto_on_cuda_times_fused_against_streams_and_keeps_the_faster() -> None:
    spy = cuda_fit("auto", epochs=4)  # 24 steps: the 14 trial steps end in epoch 3
    engine = spy.engine
    assert isinstance(engine, FastestEngine) and isinstance(engine.candidates["streams"], StreamsEngine)
    medians = {name: sorted(times)[len(times) // 2] for name, times in engine.seconds.items()}
    assert engine.chosen == min(medians, key=medians.__getitem__)
    assert_same_replicas(spy, cuda_fit("sequential", epochs=4))


@pytest.mark.skipif(
    not torch.cuda.is_available() or not torch.cuda.is_bf16_supported(), reason="needs a CUDA device with bf16"
)
@pytest.mark.parametrize("engine", ["fused", "streams"])
def test_bf16_mixed_trains_on_cuda(engine: str) -> None:
    spy = cuda_fit(engine, precision="bf16-mixed")
    for value in spy.params.values():
        assert value.dtype == torch.float32 and torch.isfinite(value).all()  # the weights stay float32
    float32 = cuda_fit("sequential").params
    assert max(float((spy.params[n] - v).abs().max()) for n, v in float32.items()) < 0.05  # close, not equal


def test_one_replica_on_cuda_is_bitwise_plain_lightning() -> None:
    assert_one_replica_is_plain_lightning(Classifier, make_data(num_samples=48), accelerator="cuda", devices=1)


def test_the_memory_guard_reads_the_gpus_free_memory() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    memory = device_memory(device)
    free, total = torch.cuda.mem_get_info(device)
    assert 0 < memory["memory_free_bytes"] <= total
    stats = CrossbowAccelerator("cuda").get_device_stats(device)
    assert stats["memory_free_bytes"] > 0 and stats["memory_used_bytes"] > 0
    tuner = ReplicaAutoTuner(window=2, warmup=0, threshold=0.0, max_replicas=3)
    fit = trainer(
        accelerator="cuda", devices=1, strategy=CrossbowStrategy(replicas_per_device=1), callbacks=[tuner], max_epochs=2
    )
    fit.fit(Classifier(), loader(make_data(num_samples=192)))
    assert max(r.replicas_per_device for r in tuner.history) > 1  # the guard lets a small model's k climb


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("engine", ["fused", "streams"])
def test_two_gpus_over_nccl_keep_z_identical(tmp_path: Path, engine: str) -> None:
    script = Path(__file__).with_name("multiprocess_script.py")
    env = {key: value for key, value in os.environ.items() if key not in ("LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    command = [sys.executable, str(script), str(tmp_path), "popen", "2", "--accelerator", "cuda", "--engine", engine]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", map_location="cpu") for r in range(2)]
    for a, b in zip(ranks[0]["z"], ranks[1]["z"], strict=True):
        assert torch.equal(a, b)


# ----------------------------------------------------- written without a GPU at hand: run these first on one
class DeviceSeen(L.Callback):
    """The device the module trains on (Lightning moves it back to the CPU at teardown)."""

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.device = pl_module.device


@pytest.mark.parametrize(
    ("device_type", "expected"), [("cpu", "cpu"), ("cuda", "cuda"), (None, "cuda")], ids=["cpu", "cuda", "None"]
)
def test_an_accelerator_given_a_device_type_trains_there_on_a_cuda_machine(device_type: Any, expected: str) -> None:
    """``CrossbowAccelerator("cpu")`` keeps to the CPU where CUDA is available; ``"cuda"`` and None train on the GPU."""
    seen = DeviceSeen()
    fit = trainer(
        accelerator=CrossbowAccelerator(device_type),
        devices=1,
        strategy=CrossbowStrategy(replicas_per_device=2),
        callbacks=[seen],
        max_steps=2,
    )
    fit.fit(Classifier(), loader(make_data(num_samples=32)))
    assert seen.device.type == expected and fit.strategy.root_device.type == expected


class TokenBag(Classifier):
    """Token embeddings with a padding token (0, the last token of every sequence), averaged, then a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(20, 8, padding_idx=0)
        self.net = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(self.embedding(x).mean(1))


def test_an_embedding_with_padding_idx_runs_fused_on_cuda_as_it_runs_sequentially() -> None:
    """The fused engine's corrected ``F.embedding`` (vmap's own rule trains the padding row of every replica but the
    first) gives the sequential engine's values on CUDA too, and the padding row never trains."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(1, 20, (48, 5), generator=generator)
    x[:, -1] = 0
    tokens = TensorDataset(x, torch.randint(0, 3, (48,), generator=generator))
    runs = {}
    for engine in ("fused", "sequential"):
        runs[engine] = TokenBag()
        fit = trainer(accelerator="cuda", devices=1, strategy=CrossbowStrategy(3, engine=engine), max_steps=4)
        fit.fit(runs[engine], DataLoader(tokens, batch_size=4))
        assert not runs[engine].embedding.weight[0].any()
    for a, b in zip(runs["fused"].parameters(), runs["sequential"].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class BatchNormNet(Classifier):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


class BuffersAgainstReplicas(L.Callback):
    """After every step: the largest difference between z's BatchNorm statistics and the replicas' mean."""

    def __init__(self) -> None:
        self.differences: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        z, stacked = dict(pl_module.named_buffers()), trainer.strategy.stack.buffers
        for name in ("net.1.running_mean", "net.1.running_var"):
            self.differences.append(float((z[name] - stacked[name].mean(0)).abs().max()))


@pytest.mark.parametrize("engine", ["fused", "streams", "sequential"])
def test_z_s_buffers_are_the_replicas_mean_after_every_step_on_cuda(engine: str) -> None:
    check = BuffersAgainstReplicas()
    fit = trainer(
        accelerator="cuda", devices=1, strategy=CrossbowStrategy(3, engine=engine), max_epochs=2, callbacks=[check]
    )
    fit.fit(BatchNormNet(), loader(make_data(num_samples=96)))
    assert len(check.differences) == 2 * 2 * 4  # two buffers, two epochs of four steps (12 batches, k=3)
    assert max(check.differences) < 1e-6


@pytest.mark.parametrize("engine", ["streams", "sequential"])
def test_a_parameter_some_replicas_losses_do_not_reach_is_held_for_them_on_cuda(engine: str) -> None:
    """Each replica's backward runs on its own stream under ``streams``: the rows no loss reached must still be
    noted (and held out of the step) as on the CPU, where tests/test_semantics.py checks them against an
    independent reference. Here: the GPU run, k=2 with momentum and weight decay, equals the CPU run."""
    dataset, weights = make_data(num_samples=64), []
    for accelerator, name in (("cuda", engine), ("cpu", "sequential")):
        model = BranchesOnTheData()
        fit = trainer(accelerator=accelerator, strategy=CrossbowStrategy(2, engine=name, outer_lr=1.0), max_steps=4)
        fit.fit(model, loader(dataset))
        weights.append({n: p.detach().cpu() for n, p in model.named_parameters()})
    through = [bool(x[0, 0] > 0) for x, _ in loader(dataset)][:8]
    assert any(through[i] != through[i + 1] for i in range(0, 8, 2))  # (a step where one replica alone uses extra)
    for name, value in weights[1].items():
        torch.testing.assert_close(weights[0][name], value, rtol=1e-5, atol=1e-6, msg=name)


class WideRegressor(L.LightningModule):
    """A hidden layer of ``width`` units: each replica's activations take batch x width floats, so that a few
    replicas fill the memory the test allows while the parameters stay small."""

    def __init__(self, width: int = 2**19) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 1))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def wide_fit(k: int, steps: int = 3) -> tuple[CrossbowStrategy, WideRegressor]:
    """``steps`` fused steps at k of WideRegressor, per-replica batch 256, on one GPU."""
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256 * 24, 4, generator=generator), torch.randn(256 * 24, generator=generator))
    strategy, model = CrossbowStrategy(replicas_per_device=k, engine="fused", algorithm="sma"), WideRegressor()
    fit = trainer(accelerator="cuda", devices=1, strategy=strategy, max_steps=steps, max_epochs=-1)
    fit.fit(model, DataLoader(data, batch_size=256))
    return strategy, model


def test_a_real_out_of_memory_error_backs_off_to_the_k_that_fits_and_loses_nothing() -> None:
    """The GPU's allocator is capped a little above what k=4 needs at its peak: from k=8 the strategy backs off
    through 7, 6 and 5 to exactly 4 (a failed step's memory must all be free again for each retry), and the
    run then equals a k=4 run from the start (the batches of the failed groups open the next ones)."""
    device = torch.device("cuda", torch.cuda.current_device())
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    _, reference = wide_fit(4)
    peak = torch.cuda.max_memory_reserved(device)
    total = torch.cuda.get_device_properties(device).total_memory
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(min(1.0, 1.12 * peak / total), device)  # k=5 needs about 1.25x
    try:
        with pytest.warns(UserWarning, match="out of memory with replicas_per_device=8") as caught:
            strategy, model = wide_fit(8)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    backed_off = [str(w.message) for w in caught if "out of memory" in str(w.message)]
    assert len(backed_off) == 4, backed_off  # 8 -> 7 -> 6 -> 5 -> 4
    assert strategy.replicas_per_device == strategy.replica_ceiling == 4
    for (name, param), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param, expected, msg=f"z differs in {name}")
