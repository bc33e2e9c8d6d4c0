"""Runs crossbow on 2 CPU processes (gloo) and saves what every rank ends with; driven by test_multiprocess.py.

usage: python tests/multiprocess_script.py OUT_DIR {popen,spawn} K [--mismatch] [--epochs N] [--resume CKPT]
       [--save CKPT] [--distributed-sampler] [--checkpoint-dir DIR] [--kill-at-step S] [--tune] [--algorithm A]
       [--heterogeneous COSTS] [--samples N] [--optimizer NAME] [--outer-lr ETA] [--second-fit] [--uneven-datasets]
       [--sigterm-at-step S] [--skip-at-step S] [--averaging-period H] [--gathers-in-step]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader, Subset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_crossbow import CrossbowStrategy, ReplicaAutoTuner, SpeedBalancer  # noqa: E402
from tests.helpers import Classifier, ResumableLoader, make_data  # noqa: E402

WORLD_SIZE = 2


class Sharded(L.LightningDataModule):
    """Rank r trains on samples r, r+2, r+4, ... in order (the user's own per-rank loader)."""

    def __init__(self, shorter_on_rank_1: int = 0) -> None:
        super().__init__()
        self.shorter_on_rank_1 = shorter_on_rank_1

    def train_dataloader(self) -> DataLoader:
        rank = self.trainer.global_rank
        dataset = make_data(num_samples=96)
        shard = range(rank, len(dataset) - (self.shorter_on_rank_1 * WORLD_SIZE if rank == 1 else 0), WORLD_SIZE)
        return DataLoader(Subset(dataset, shard), batch_size=8)


class Unsharded(L.LightningDataModule):
    """The whole dataset on every rank: Lightning's DistributedSampler shards (and shuffles) it, as with DDP;
    in heterogeneous mode crossbow routes it."""

    def __init__(
        self,
        num_samples: int = 96,
        validate: bool = False,
        resumable: bool = False,
        batch_size: int = 8,
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        self.num_samples, self.resumable, self.batch_size = num_samples, resumable, batch_size
        self.drop_last = drop_last
        if validate:  # 8 validation batches, which the ranks share as in plain Lightning
            self.val_dataloader = lambda: DataLoader(make_data(num_samples=64, seed=1), batch_size=8)

    def train_dataloader(self) -> DataLoader:
        return (ResumableLoader if self.resumable else DataLoader)(
            make_data(num_samples=self.num_samples), batch_size=self.batch_size, drop_last=self.drop_last
        )


class VirtualClock:
    """A clock that only moves when told: the balancer's clock in tests, so measured speeds are exact."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SimulatedDeviceSpeed(L.Callback):
    """Each step, this rank's clock advances ``seconds_per_learner`` per local learner and batch of 8 samples (the
    DataLoader's; a larger per-replica batch costs in proportion): a device of that speed."""

    def __init__(self, clock: VirtualClock, seconds_per_learner: float) -> None:
        self.clock, self.seconds_per_learner = clock, seconds_per_learner

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object, batch_idx: int
    ) -> None:
        per_replica = max(8, *(len(y) for _, y in batch))  # type: ignore[attr-defined]  # (a short last batch: 8)
        self.clock.now += self.seconds_per_learner * len(batch) * per_replica / 8  # type: ignore[arg-type]


class KillAtStep(L.Callback):
    """SIGKILLs this process once ``global_step`` reaches ``step``: a crash, with no clean-up at all."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class ChangeKAndSaveAtStep(L.Callback):
    """Once ``global_step`` reaches ``step``: asks for k = ``new_k`` (``set_replicas_per_device``), and, with a
    ``path``, saves a checkpoint right after, while that change is under way."""

    def __init__(self, step: int, new_k: int, path: str | None) -> None:
        self.step, self.new_k, self.path = step, new_k, path

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            trainer.strategy.set_replicas_per_device(self.new_k)  # type: ignore[attr-defined]
            if self.path:
                trainer.save_checkpoint(self.path)


class SaveAtStep(L.Callback):
    """Saves a checkpoint at ``path`` once ``global_step`` reaches ``step`` (in ``on_train_batch_end``)."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


class SigtermAtStep(L.Callback):
    """Rank 1 alone sends itself SIGTERM once ``global_step`` reaches ``step``; counts the broadcasts every rank
    makes while training (Lightning's per-batch SIGTERM check is one)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.broadcasts = 0
        broadcast = torch.distributed.broadcast

        def counted(*args: object, **kwargs: object) -> object:
            self.broadcasts += self.training
            return broadcast(*args, **kwargs)

        torch.distributed.broadcast = counted
        self.training = False

    def on_train_start(self, trainer: L.Trainer, *args: object) -> None:
        self.training = True

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step and trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)


class SkipsAtStep(Classifier):
    """Every replica's ``training_step`` returns None (skips) at global step ``step``."""

    def __init__(self, step: int, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.skip_step = step

    def training_step(self, batch: object, batch_idx: int) -> object:
        return None if self.trainer.global_step == self.skip_step else super().training_step(batch, batch_idx)


class WatchStep(L.Callback):
    """Whether z, its momentum (z_prev) and the replicas were the same before and after global step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.before: list[torch.Tensor] = []
        self.unchanged: bool | None = None

    def _state(self, trainer: L.Trainer) -> list[torch.Tensor]:
        return [t.clone() for b in trainer.strategy.stack.buckets for t in (b.center, b.center_prev, b.replicas)]

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            self.before = self._state(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if self.before and self.unchanged is None:
            self.unchanged = all(torch.equal(a, b) for a, b in zip(self.before, self._state(trainer), strict=True))


class SaveFinalState(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.group_sizes: list[int] = []
        self.batch_sizes: list[list[int]] = []  # each step's per-replica batch sizes
        self.seen: list[list[torch.Tensor]] = []  # per epoch, the inputs this rank trained on
        self.validation_batches = 0  # outside the sanity check
        self.epoch_counts: list[list[int]] = []  # per epoch: [Lightning's count of its steps at its start, its steps]

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.epoch_counts.append([trainer.num_training_batches, 0])

    def on_validation_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        self.validation_batches += not trainer.sanity_checking

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object, batch_idx: int
    ) -> None:
        self.group_sizes.append(len(batch))  # type: ignore[arg-type]
        if self.epoch_counts:
            self.epoch_counts[-1][1] += 1
        self.batch_sizes.append([len(y) for _, y in batch])  # type: ignore[attr-defined]
        while len(self.seen) <= trainer.current_epoch:
            self.seen.append([])
        self.seen[trainer.current_epoch].extend(x for x, _ in batch)  # type: ignore[attr-defined]

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        torch.save(
            {
                "z": [p.detach().clone() for p in pl_module.parameters()],
                "replicas": {n: p.detach().clone() for n, p in strategy.stack.params.items()},
                "replicas_per_device": strategy.replicas_per_device,
                "group_sizes": self.group_sizes,
                "batch_sizes": self.batch_sizes,
                "world_size": trainer.world_size,
                "global_step": trainer.global_step,
                "seen": [torch.cat(inputs) if inputs else torch.empty(0) for inputs in self.seen],
                "splits": strategy.balancer.history if strategy.balancer is not None else None,
                "measured": strategy.balancer.measured if strategy.balancer is not None else None,
                "validation_batches": self.validation_batches,
                "epoch_counts": self.epoch_counts,
                "estimated_steps": getattr(pl_module, "estimated_steps", None),
            },
            self.out / f"rank{trainer.global_rank}.pt",
        )


class ReadsEstimatedSteps(Classifier):
    """Reads ``trainer.estimated_stepping_batches`` in ``configure_optimizers``, as a OneCycleLR set-up does: Lightning
    makes the training loader there, during the strategy's set-up."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.estimated_steps = self.trainer.estimated_stepping_batches
        return super().configure_optimizers()


class GathersInStep(Classifier):
    """Gathers every process's outputs in ``training_step`` (negatives for a contrastive loss, say)."""

    def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
        x, y = batch  # type: ignore[misc]
        out = self(x)
        everyone = self.all_gather(out.detach())
        return torch.nn.functional.cross_entropy(out, y) + 0.0 * everyone.sum()


class WithBackbone(Classifier):
    """Lightning's fine-tuning set-up: a ``backbone`` (the first layer) and an optimizer over what is trainable."""

    def __init__(self, optimizer: str) -> None:
        super().__init__(optimizer=optimizer)
        self.backbone = self.net[0]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("launcher", choices=["popen", "spawn"])
    parser.add_argument("k", type=int)
    parser.add_argument("--mismatch", action="store_true")
    parser.add_argument(
        "--mismatch-tuner-and-period", action="store_true", help="rank 0: k='auto', averaging_period=1; rank 1: k, 2"
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--resume")
    parser.add_argument("--save", help="save a checkpoint there after fit (with --change-k-at, at that step)")
    parser.add_argument("--change-k-at", help="STEP:K, set_replicas_per_device(K) once global_step reaches STEP")
    parser.add_argument("--save-at", action="append", default=[], help="STEP:PATH, a checkpoint at that step")
    parser.add_argument("--reads-estimated-steps", action="store_true", help="configure_optimizers reads them")
    parser.add_argument("--resumable-loader", action="store_true", help="a training loader that saves its place")
    parser.add_argument("--distributed-sampler", action="store_true")
    parser.add_argument("--checkpoint-dir", help="save a checkpoint at every epoch end there")
    parser.add_argument("--kill-at-step", type=int)
    parser.add_argument("--tune", action="store_true", help="let ReplicaAutoTuner change k (real clocks)")
    parser.add_argument("--algorithm", default="sma", choices=["sma", "easgd", "scaled_averaging", "gossip"])
    parser.add_argument("--heterogeneous", help="seconds per learner-step of each rank, e.g. 1,3 (a virtual clock)")
    parser.add_argument("--samples", type=int, default=96, help="training samples (with --heterogeneous)")
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--outer-lr", type=float)
    parser.add_argument("--second-fit", action="store_true", help="fit once more, one epoch, with the same strategy")
    parser.add_argument("--uneven-datasets", action="store_true", help="rank 1's data: a batch shorter (shard: 2)")
    parser.add_argument("--uneven-batch-sizes", action="store_true", help="rank 1's DataLoader has batch_size=4")
    parser.add_argument("--drop-last", action="store_true", help="the training DataLoader's drop_last")
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "cuda"], help="cuda: one GPU per rank, NCCL")
    parser.add_argument("--engine", default="auto")
    parser.add_argument("--validate", action="store_true", help="validate on 8 batches after every epoch")
    parser.add_argument("--sigterm-at-step", type=int, help="rank 1 alone gets SIGTERM after this step")
    parser.add_argument("--skip-at-step", type=int, help="every replica of every rank skips this step")
    parser.add_argument("--gathers-in-step", action="store_true", help="training_step calls self.all_gather")
    parser.add_argument("--finetune", action="store_true", help="BackboneFinetuning: net.0 frozen until epoch 1")
    parser.add_argument("--averaging-period", type=int, default=1, help="optimizer steps between two averagings")
    parser.add_argument("--max-batch-scale", type=float, default=1.0, help="SpeedBalancer's (with --heterogeneous)")
    parser.add_argument("--lr-follows-batch", action="store_true", help="SpeedBalancer's (with --heterogeneous)")
    args = parser.parse_args()
    callbacks: list[L.Callback] = [SaveFinalState(args.out)]
    balancer = None
    if args.heterogeneous:
        clock = VirtualClock()
        balancer = SpeedBalancer(
            every=2, clock=clock, max_batch_scale=args.max_batch_scale, lr_follows_batch=args.lr_follows_batch
        )
        cost = float(args.heterogeneous.split(",")[int(os.environ.get("LOCAL_RANK", 0))])
        callbacks.append(SimulatedDeviceSpeed(clock, cost))
    if args.checkpoint_dir:
        callbacks.append(ModelCheckpoint(args.checkpoint_dir, save_top_k=-1, save_on_train_epoch_end=True))
    if args.kill_at_step is not None:
        callbacks.append(KillAtStep(args.kill_at_step))
    for save_at in args.save_at:
        step, path = save_at.split(":", 1)
        callbacks.append(SaveAtStep(int(step), path))
    if args.change_k_at:
        step, new_k = map(int, args.change_k_at.split(":"))
        callbacks.append(ChangeKAndSaveAtStep(step, new_k, args.save))
    sigterm = SigtermAtStep(args.sigterm_at_step) if args.sigterm_at_step is not None else None
    watch = WatchStep(args.skip_at_step) if args.skip_at_step is not None else None
    if watch is not None:
        callbacks.append(watch)
    if sigterm is not None:
        callbacks.append(sigterm)
    if args.finetune:
        callbacks.append(BackboneFinetuning(unfreeze_backbone_at_epoch=1))
    if args.tune:  # threshold 0: it climbs to max_replicas unless a step gets slower; each rank's clock differs
        callbacks.append(ReplicaAutoTuner("throughput", window=1, warmup=0, threshold=0.0, max_replicas=3))
    rank = int(os.environ.get("LOCAL_RANK", 0))
    k: int | str = args.k + (rank if args.mismatch else 0)
    options = {"outer_lr": args.outer_lr} if args.outer_lr is not None else {}
    if args.mismatch_tuner_and_period:
        k, args.averaging_period = ("auto", 1) if rank == 0 else (args.k, 2)
    strategy = CrossbowStrategy(
        algorithm=args.algorithm,
        replicas_per_device=k,
        start_method=args.launcher,
        heterogeneous=balancer if balancer is not None else False,
        engine=args.engine,
        averaging_period=args.averaging_period,
        **options,
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=WORLD_SIZE,
        strategy=strategy,
        max_epochs=args.epochs,
        use_distributed_sampler=args.distributed_sampler,
        logger=False,
        default_root_dir=args.out,  # (what the run writes by default, the tuner's plot, stays in the test's folder)
        enable_checkpointing=bool(args.checkpoint_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    samples = args.samples - (8 if args.uneven_datasets and os.environ.get("LOCAL_RANK") == "1" else 0)
    datamodule = (
        Unsharded(
            samples,
            args.validate,
            args.resumable_loader,
            batch_size=4 if args.uneven_batch_sizes and os.environ.get("LOCAL_RANK") == "1" else 8,
            drop_last=args.drop_last,
        )
        if args.distributed_sampler or balancer is not None
        else Sharded(shorter_on_rank_1=16 if args.uneven_datasets else 0)
    )
    if args.skip_at_step is not None:
        model: Classifier = SkipsAtStep(args.skip_at_step, optimizer=args.optimizer)
    elif args.finetune:
        model = WithBackbone(optimizer=args.optimizer)
    elif args.reads_estimated_steps:
        model = ReadsEstimatedSteps(optimizer=args.optimizer)
    elif args.gathers_in_step:
        model = GathersInStep(optimizer=args.optimizer)
    else:
        model = Classifier(optimizer=args.optimizer)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, datamodule=datamodule, ckpt_path=args.resume)
        torch.save([str(w.message) for w in caught], args.out / f"rank{trainer.global_rank}_warnings.pt")
    except SIGTERMException:
        assert sigterm is not None
        stopped = {"global_step": trainer.global_step, "broadcasts": sigterm.broadcasts}
        torch.save(stopped, args.out / f"rank{trainer.global_rank}_stopped.pt")
        return
    if args.second_fit:
        trainer.fit_loop.max_epochs = args.epochs + 1
        trainer.fit(model, datamodule=datamodule)
    if args.save and not args.change_k_at:
        trainer.save_checkpoint(args.save)
    if watch is not None:
        torch.save(watch.unchanged, args.out / f"rank{trainer.global_rank}_skipped_step_unchanged.pt")


if __name__ == "__main__":
    main()
