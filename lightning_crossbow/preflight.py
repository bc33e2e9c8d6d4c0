"""Before training: refusals and warnings (what crossbow's replicas would silently undo or outgrow, and why), and
Lightning callbacks adapted to crossbow (a step of k batches; an optimizer over stacked replicas)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ContextManager

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_crossbow.data import ReplicaGroup
from lightning_crossbow.tuner import ReplicaAutoTuner


def check_callbacks(trainer: "pl.Trainer") -> None:
    """Refuses, before training, the callbacks whose work crossbow's replicas would silently undo."""
    from lightning.pytorch.callbacks import ModelPruning

    for callback in trainer.callbacks:
        if isinstance(callback, ModelPruning):
            raise ValueError(
                f"crossbow cannot train with the {type(callback).__name__} callback: it re-registers each pruned"
                " parameter (weight_orig and a mask), and crossbow replicates the parameters. Remove the callback, or"
                " train with another strategy."
            )


def warn_of_step_schedules_under_tuning(trainer: "pl.Trainer") -> None:
    """A tuned k changes the steps per epoch: a schedule sized in steps no longer fits the run."""
    if not any(isinstance(c, ReplicaAutoTuner) for c in trainer.callbacks):
        return
    for config in trainer.lr_scheduler_configs:
        if config.interval == "step":
            rank_zero_warn(
                f"crossbow: the learning-rate scheduler {type(config.scheduler).__name__} steps every optimizer step,"
                " and the ReplicaAutoTuner changes how many steps an epoch has while training runs (k batches"
                " per step): a schedule sized in steps (such as OneCycleLR's total_steps from"
                " trainer.estimated_stepping_batches, counted at the starting k) will not end with training."
                " Use interval='epoch', or a fixed replicas_per_device."
            )


class PerBatchOfTheGroup:
    """``measure`` (a function of one batch) summed over the batches of a crossbow step, which hooks receive as the
    group of its k batches (:class:`~lightning_crossbow.data.ReplicaGroup`); any other batch is measured as it is.
    (A class, not a closure: a callback holding it pickles as it did.)"""

    def __init__(self, measure: Callable[[Any], int]) -> None:
        self.measure = measure

    def __call__(self, batch: Any) -> int:
        if isinstance(batch, ReplicaGroup):
            return sum(self.measure(one) for one in batch)
        return self.measure(batch)


def per_batch_of_the_group(measure: Callable[[Any], int]) -> Callable[[Any], int]:
    """``measure`` as a :class:`PerBatchOfTheGroup` (once: one that already is stays as it is)."""
    return measure if isinstance(measure, PerBatchOfTheGroup) else PerBatchOfTheGroup(measure)


def adapt_throughput_monitors(trainer: "pl.Trainer") -> None:
    """Lightning's ``ThroughputMonitor`` counts a step's samples with the user's ``batch_size_fn`` (and items with
    ``length_fn``), written for one batch: they count each batch of the step's group, summed."""
    from lightning.pytorch.callbacks import ThroughputMonitor

    for callback in trainer.callbacks:
        if isinstance(callback, ThroughputMonitor):
            callback.batch_size_fn = per_batch_of_the_group(callback.batch_size_fn)
            if callback.length_fn is not None:
                callback.length_fn = per_batch_of_the_group(callback.length_fn)


class WithModuleParameters:
    """A callback's hook run inside ``presenting()``: while it runs, the optimizer's param groups hold the module's
    own parameters, as the hook expects (:meth:`CrossbowStrategy.optimizer_over_module_parameters`). (A class, not a
    closure: a callback holding it pickles as it did.)"""

    def __init__(self, hook: Callable[..., Any], presenting: Callable[[], ContextManager[Any]]) -> None:
        self.hook, self.presenting = hook, presenting

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.presenting():
            return self.hook(*args, **kwargs)


def adapt_finetuning_callbacks(trainer: "pl.Trainer", presenting: Callable[[], ContextManager[Any]]) -> None:
    """Lightning's ``BaseFinetuning`` (``BackboneFinetuning`` and the user's own subclasses) finds, adds and saves
    the optimizer's param groups by the module's parameters, in ``on_fit_start`` (a resumed run's groups) and
    ``on_train_epoch_start`` (``finetune_function``): both run inside ``presenting()``."""
    from lightning.pytorch.callbacks import BaseFinetuning

    for callback in trainer.callbacks:
        if isinstance(callback, BaseFinetuning):
            for name in ("on_fit_start", "on_train_epoch_start"):
                hook = getattr(callback, name)
                if isinstance(hook, WithModuleParameters):  # (adapted by an earlier fit: for this one's strategy)
                    hook = hook.hook
                setattr(callback, name, WithModuleParameters(hook, presenting))
