"""Argument checks shared by the strategy, the auto-tuner and the balancer (and the strategy's own: the optimizer
classes it steps element-wise, the arguments it hands on to Lightning's DDPStrategy).

Each raises ``ValueError`` naming the argument, what is allowed and what was given; numpy's numbers pass,
bools do not (``True`` is not a count or a rate).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer


def is_real(value: Any) -> bool:
    """A finite real number (numpy's included), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_int(name: str, value: Any, least: int = 1, note: str = "") -> None:
    """``value`` is an integer (numpy's included), not a bool, at least ``least``; ``note`` adds what else is
    allowed (", or None")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        allowed = "a positive int (1, 2, 3, ...)" if least == 1 else f"an int >= {least}"
        raise ValueError(f"{name} must be {allowed}{note}, got {value!r}.")


def check_real(name: str, value: Any, allowed: str, holds: Callable[[float], bool]) -> None:
    """``value`` is a finite real number for which ``holds`` is true; ``allowed`` says which (">= 0")."""
    if not is_real(value) or not holds(float(value)):
        raise ValueError(f"{name} must be a number {allowed}, got {value!r}.")


def check_clock(value: Any) -> None:
    """``value`` is a function returning seconds, as ``time.perf_counter`` (the clock tests inject)."""
    if not callable(value):
        raise ValueError(f"clock must be a function returning seconds (as time.perf_counter), got {value!r}.")


def optimizer_classes(classes: Any) -> tuple[type[Optimizer], ...]:
    """``elementwise_optimizers`` as a tuple of optimizer classes (one class alone is accepted)."""
    if isinstance(classes, (type, str)):
        classes = (classes,)
    try:
        classes = tuple(classes)
    except TypeError:
        classes = (classes,)
    wrong = [c for c in classes if not (isinstance(c, type) and issubclass(c, Optimizer))]
    if wrong:
        raise ValueError(
            "elementwise_optimizers must list optimizer classes (subclasses of torch.optim.Optimizer), for example"
            f" elementwise_optimizers=[MySGD]; got {wrong[0]!r}"
            + (" (a name: give the class itself)." if isinstance(wrong[0], str) else ".")
        )
    return classes


#: Lightning's ways of starting the processes (DDPStrategy's ``start_method``).
START_METHODS = ("popen", "spawn", "fork", "forkserver")


def check_lightning_arguments(arguments: Mapping[str, Any]) -> None:
    """The arguments CrossbowStrategy passes on to Lightning's DDPStrategy, each of the type it takes (None: chosen
    for you), so that a wrong one fails here with its name rather than later with an AttributeError."""
    expected = {
        "accelerator": (Accelerator, "lightning.pytorch.accelerators.Accelerator"),
        "cluster_environment": (ClusterEnvironment, "lightning.fabric.plugins.ClusterEnvironment"),
        "checkpoint_io": (CheckpointIO, "lightning.fabric.plugins.CheckpointIO"),
        "precision_plugin": (Precision, "lightning.pytorch.plugins.precision.Precision"),
        "timeout": (timedelta, "datetime.timedelta"),
    }
    for name, (kind, where) in expected.items():
        value = arguments[name]
        if value is not None and not isinstance(value, kind):
            raise ValueError(f"{name} must be a {where} or None, got {value!r}.")
    devices = arguments["parallel_devices"]
    if devices is not None and not (
        isinstance(devices, (list, tuple)) and all(isinstance(d, torch.device) for d in devices)
    ):
        raise ValueError(f"parallel_devices must be a list of torch.device or None, got {devices!r}.")
    backend = arguments["process_group_backend"]
    known = [name for name in torch.distributed.Backend.backend_list if name != "undefined"]
    if backend is not None and not (isinstance(backend, str) and (backend.lower() in known or ":" in backend)):
        raise ValueError(
            f"process_group_backend must be one of {', '.join(map(repr, known))} (or per device, as"
            f" 'cpu:gloo,cuda:nccl'), or None (gloo on CPU, NCCL on CUDA), got {backend!r}."
        )
    if arguments["start_method"] not in START_METHODS:
        raise ValueError(
            f"start_method must be one of {', '.join(map(repr, START_METHODS))}, got {arguments['start_method']!r}."
        )
