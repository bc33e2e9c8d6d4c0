"""Hardware efficiency inside Lightning: samples/s of crossbow against plain Lightning, one process.

Every configuration trains the MNIST-1D CNN (examples/models.py) on MNIST-1D-shaped data in the
same process (``--model lenet5``: LeNet-5, two-dimensional convolutions and pooling, on 28x28 images);
configurations are interleaved and repeated, so ratios are measured side by side on
this (shared, noisy) machine: each ratio is the median over repetitions of the ratio within one
repetition (the two runs of a pair are seconds apart), next to the ratio of the medians.

The data are a ``TensorDataset``, whose batches crossbow gathers a step at a time (one indexing per tensor), where
plain Lightning's ``DataLoader`` fetches and collates them sample by sample. The row "sample by sample" trains
crossbow on the same samples fetched as plain Lightning fetches them: its ratio to plain Lightning is that of
crossbow's own work alone.

    python benchmarks/throughput.py            # the core issue's comparisons, 5 repetitions
    python benchmarks/throughput.py --quick    # 3 repetitions, fewer steps
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.models import Classifier, conv1d_net, lenet5  # noqa: E402
from lightning_crossbow import CrossbowStrategy  # noqa: E402
from lightning_crossbow.fused_layers import fusable_layers, fused_layers  # noqa: E402
from lightning_crossbow.lean_vmap import lean_vmap  # noqa: E402
from lightning_crossbow.stateless import Reparametrizer  # noqa: E402


class StepTimer(L.Callback):
    """Wall time of the training steps after ``warmup`` steps (first timed batch's start to last batch's end).

    On CUDA the clock is read after ``torch.cuda.synchronize()``, so queued kernels are counted. Given ``steps``,
    it is read at the first timed step's start and the last one's end only: a synchronize after every step would
    keep the host from queueing the next step's kernels while the GPU runs this one's, as training does."""

    def __init__(self, warmup: int, steps: Optional[int] = None) -> None:
        self.warmup = warmup
        self.last = None if steps is None else warmup + steps - 1
        self.start: Optional[float] = None
        self.end: Optional[float] = None
        self.steps = 0

    @staticmethod
    def _now(pl_module: L.LightningModule) -> float:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        return time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.warmup:
            self.start = self._now(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx >= self.warmup and (self.last is None or batch_idx == self.last):
            self.end = self._now(pl_module)
            self.steps = batch_idx - self.warmup + 1


def bare_trainer(strategy: Any, devices: int = 1, accelerator: str = "cpu", **kwargs: Any) -> L.Trainer:
    """A Trainer without logger, checkpoints, progress bar or summary: nothing but training is timed."""
    defaults: dict[str, Any] = dict(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(**{**defaults, **kwargs})


class SampleBySample(Dataset):
    """A ``TensorDataset``'s samples, one ``__getitem__`` at a time: a dataset that crossbow fetches as a
    ``DataLoader`` does, sample by sample (it gathers a ``TensorDataset``'s batches at once, see
    :class:`lightning_crossbow.data.GatheredBatches`)."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return self.data[index]

    def __len__(self) -> int:
        return len(self.data)


def samples_per_second(
    strategy: Any,
    k: int,
    batch_size: int,
    steps: int,
    warmup: int,
    net: Optional[Callable[[], torch.nn.Module]] = None,
    input_shape: tuple[int, ...] = (40,),
    accelerator: str = "cpu",
    callbacks: tuple[L.Callback, ...] = (),
    sample_by_sample: bool = False,
) -> float:
    """Trains ``warmup + steps`` steps of ``k`` batches of ``batch_size`` random inputs of ``input_shape``
    (default: the MNIST-1D CNN on MNIST-1D-shaped data) from a ``TensorDataset`` (``sample_by_sample``: wrapped in
    :class:`SampleBySample`); returns measured samples/s."""
    torch.manual_seed(0)
    n = (warmup + steps) * k * batch_size
    data: Dataset = TensorDataset(torch.randn(n, *input_shape), torch.randint(0, 10, (n,)))
    if sample_by_sample:
        data = SampleBySample(data)
    timer = StepTimer(warmup, steps)
    trainer = bare_trainer(strategy, accelerator=accelerator, callbacks=[timer, *callbacks])
    model = Classifier(net() if net is not None else conv1d_net(40, 10), lr=0.01)
    trainer.fit(model, DataLoader(data, batch_size=batch_size))
    return timer.steps * k * batch_size / (timer.end - timer.start)


#: ``--model``: the network and one sample's shape.
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], tuple[int, ...]]] = {
    "mnist1d-cnn": (lambda: conv1d_net(40, 10), (40,)),
    "lenet5": (lenet5, (1, 28, 28)),
}


def kernel_samples_per_second(
    k: int, batch_size: int, steps: int, warmup: int, fused: bool, model: str = "mnist1d-cnn"
) -> float:
    """What PyTorch's kernels allow, outside Lightning and crossbow: samples/s of the bare forward, backward and SGD
    step (momentum 0.9) of ``model`` (:data:`MODELS`) on random data. ``fused=False``: one model on batches of
    ``k * batch_size``; ``fused=True``: ``k`` models stacked and run under ``vmap``, each on its own
    ``batch_size``, as the fused engine runs them on CPU (its parameter swap, its call of ``vmap``,
    :mod:`lightning_crossbow.lean_vmap`, and its layers and cross-entropy fused,
    :mod:`lightning_crossbow.fused_layers`)."""
    torch.manual_seed(0)
    make_net, shape = MODELS[model]
    net = make_net()
    inputs, targets = torch.randn(k, batch_size, *shape), torch.randint(0, 10, (k, batch_size))
    if fused:
        stacked = {name: p.detach().expand(k, *p.shape).clone().requires_grad_() for name, p in net.named_parameters()}
        parameters = list(stacked.values())
        layers = fusable_layers(net, torch.device("cpu"))

        swapped = Reparametrizer(net, stacked)  # (the fused engine's swap)

        def loss_of(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with swapped(params):
                return torch.nn.functional.cross_entropy(net(x), y)

        def losses() -> torch.Tensor:
            with fused_layers(layers, losses=True):
                return lean_vmap(loss_of, k, stacked, inputs, targets).sum()
    else:
        parameters = list(net.parameters())
        inputs, targets = inputs.reshape(k * batch_size, *shape), targets.reshape(-1)

        def losses() -> torch.Tensor:
            return torch.nn.functional.cross_entropy(net(inputs), targets)

    optimizer = torch.optim.SGD(parameters, lr=0.01, momentum=0.9)
    for step in range(warmup + steps):
        if step == warmup:
            start = time.perf_counter()
        optimizer.zero_grad()
        losses().backward()
        optimizer.step()
    return steps * k * batch_size / (time.perf_counter() - start)


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    return {
        "torch": torch.__version__,
        "lightning": L.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def results_dir(quick: bool) -> Path:
    """Where a benchmark writes its JSON: ``benchmarks/out/``, or ``benchmarks/out/quick/`` for ``--quick`` runs
    (so a quick run never overwrites the full results that RESULTS.md is written from)."""
    out = Path(__file__).with_name("out")
    return out / "quick" if quick else out


def save_result(path: Path, command: str, **fields: Any) -> None:
    """Writes ``fields`` as JSON at ``path``, with the machine and the command that measured them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), "command": command, **fields}, indent=2))


#: The name's end of a configuration whose dataset is fetched sample by sample (:class:`SampleBySample`).
SAMPLE_BY_SAMPLE = ", sample by sample"


def configurations(per_replica_batch: int, k: int) -> dict[str, tuple[Callable[[], Any], int, int]]:
    """name -> (strategy factory, replicas, batch size); a name that ends in :data:`SAMPLE_BY_SAMPLE` trains on a
    :class:`SampleBySample` dataset."""
    return {
        f"crossbow k={k} fused b={per_replica_batch}": (
            lambda: CrossbowStrategy(k, engine="fused"),
            k,
            per_replica_batch,
        ),
        f"crossbow k={k} fused b={per_replica_batch}{SAMPLE_BY_SAMPLE}": (
            lambda: CrossbowStrategy(k, engine="fused"),
            k,
            per_replica_batch,
        ),
        f"crossbow k={k} sequential b={per_replica_batch}": (
            lambda: CrossbowStrategy(k, engine="sequential"),
            k,
            per_replica_batch,
        ),
        f"plain b={k * per_replica_batch}": (lambda: "auto", 1, k * per_replica_batch),
        f"crossbow k=1 b={per_replica_batch}": (lambda: CrossbowStrategy(1), 1, per_replica_batch),
        f"plain b={per_replica_batch}": (lambda: "auto", 1, per_replica_batch),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--repeats", type=int, help="repetitions (default 5, or 3 with --quick)")
    parser.add_argument("--steps", type=int, help="timed steps per run (default 80, or 40 with --quick)")
    parser.add_argument("--model", choices=list(MODELS), default="mnist1d-cnn")
    parser.add_argument(
        "--out", type=Path, help="default: benchmarks/out/throughput.json, throughput_<model>.json for another model"
    )
    args = parser.parse_args()
    net, shape = MODELS[args.model]
    repeats, steps, warmup = (3, 40, 10) if args.quick else (5, 80, 10)
    repeats, steps = args.repeats or repeats, args.steps or steps
    configs = configurations(args.batch_size, args.replicas)
    measured: dict[str, list[float]] = {name: [] for name in configs}
    k, b = args.replicas, args.batch_size
    kernels = {f"kernels alone: vmap k={k} b={b}": True, f"kernels alone: one model b={k * b}": False}
    measured.update({name: [] for name in kernels})
    for _ in range(repeats):  # interleaved: every repetition runs every configuration once
        for name, (strategy, replicas, batch) in configs.items():
            measured[name].append(
                samples_per_second(
                    strategy(),
                    replicas,
                    batch,
                    steps,
                    warmup,
                    net,
                    shape,
                    sample_by_sample=name.endswith(SAMPLE_BY_SAMPLE),
                )
            )
        for name, fused in kernels.items():
            measured[name].append(kernel_samples_per_second(k, b, 4 * steps, warmup, fused, args.model))
    median = {name: statistics.median(values) for name, values in measured.items()}
    pairs = {
        f"fused / sequential (k={k}, target >= 2)": (f"crossbow k={k} fused b={b}", f"crossbow k={k} sequential b={b}"),
        f"fused k={k} / plain b={k * b} (target >= 0.8)": (f"crossbow k={k} fused b={b}", f"plain b={k * b}"),
        f"fused k={k}, its data fetched sample by sample as plain's are / plain b={k * b}": (
            f"crossbow k={k} fused b={b}{SAMPLE_BY_SAMPLE}",
            f"plain b={k * b}",
        ),
        f"crossbow k=1 / plain b={b} (target >= 0.85)": (f"crossbow k=1 b={b}", f"plain b={b}"),
        f"kernels alone: vmap k={k} / one model b={k * b} (the ceiling of fused / plain)": tuple(kernels),
    }
    ratios = {
        name: {
            "paired": statistics.median(x / y for x, y in zip(measured[a], measured[b], strict=True)),
            "of_medians": median[a] / median[b],
        }
        for name, (a, b) in pairs.items()
    }
    print(
        f"\n{args.model}: samples/s, median of {repeats} interleaved runs ({steps} timed steps each),"
        f" torch {torch.__version__}, lightning {L.__version__}, {torch.get_num_threads()} threads,"
        f" {platform.processor() or platform.machine()}"
    )
    for name, value in median.items():
        spread = f"{min(measured[name]):.0f}-{max(measured[name]):.0f}"
        print(f"  {name:<40} {value:>9.0f}   (range {spread})")
    print(f"ratios: {'paired':>75} {'of medians':>11}")
    for name, value in ratios.items():
        print(f"  {name:<78} {value['paired']:.2f} {value['of_medians']:>11.2f}")
    command = (
        "python benchmarks/throughput.py"
        + (" --quick" if args.quick else "")
        + (f" --repeats {args.repeats}" if args.repeats else "")
        + (f" --steps {args.steps}" if args.steps else "")
        + (f" --model {args.model}" if args.model != "mnist1d-cnn" else "")
    )
    name = "throughput.json" if args.model == "mnist1d-cnn" else f"throughput_{args.model}.json"
    save_result(
        args.out or results_dir(args.quick) / name,
        command,
        model=args.model,
        repeats=repeats,
        timed_steps=steps,
        samples_per_sec=measured,
        median=median,
        ratios=ratios,
    )


if __name__ == "__main__":
    main()
