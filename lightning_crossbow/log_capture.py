"""Captures what a LightningModule logs from k replicas and logs it once, reduced over the replicas.

``self.log`` cannot run per replica: under ``torch.func.vmap`` the value would escape the vmapped
call, and in a loop Lightning would keep the last replica's value. While a replica's
``training_step`` runs, ``module.log``/``module.log_dict`` are shadowed by recorders; afterwards
:meth:`LogCapture.replay` calls the real ``self.log`` once per name with the mean over replicas (with
``reduce_fx="sum"``, ``"max"`` or ``"min"``, their sum, max or min, so that Lightning's reduction over the steps
is that reduction over every batch). torchmetrics ``Metric`` objects are passed through once: they already
aggregate every replica's updates, for the epoch value; the step value, which Lightning reads from the metric's
last ``forward``, is set to the mean over replicas of each replica's own ``forward`` value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor, nn
from torchmetrics import Metric


@dataclass
class LogCall:
    """One ``self.log(name, value, **kwargs)`` call of one replica (or of all, stacked, when fused)."""

    name: str
    value: Any
    kwargs: dict[str, Any]
    #: For a torchmetrics ``Metric``: its ``forward`` value when this replica logged it (its own batch's value).
    step_value: Any = None


@dataclass
class _Logged:
    kwargs: dict[str, Any]
    per_replica: list[Any] = field(default_factory=list)
    stacked: list[Tensor] = field(default_factory=list)
    step_values: list[Any] = field(default_factory=list)  # a Metric's, one per replica
    batches: list[Any] = field(default_factory=list)  # the batch of each per_replica value (None: not known)
    given_sizes: list[Any] = field(default_factory=list)  # the batch_size= each per_replica value was logged with


class LogCapture:
    """Records ``self.log`` calls of replica steps; :meth:`replay` logs each name once."""

    def __init__(self) -> None:
        self._logged: dict[str, _Logged] = {}

    @staticmethod
    @contextmanager
    def recording(module: nn.Module) -> Iterator[list[LogCall]]:
        """Shadows ``module.log`` and ``module.log_dict`` with recorders for the duration."""
        calls: list[LogCall] = []

        def log(name: str, value: Any, **kwargs: Any) -> None:
            step_value = value._forward_cache if isinstance(value, Metric) else None
            calls.append(LogCall(name, value, kwargs, step_value))

        def log_dict(dictionary: Mapping[str, Any], **kwargs: Any) -> None:
            for name, value in dictionary.items():
                log(name, value, **kwargs)

        module.__dict__["log"], module.__dict__["log_dict"] = log, log_dict
        try:
            yield calls
        finally:
            del module.__dict__["log"], module.__dict__["log_dict"]

    def add(self, calls: list[LogCall], batch: Any = None) -> None:
        """Adds the calls of one replica, which ran on ``batch``."""
        for call in calls:
            logged = self._logged.setdefault(call.name, _Logged(call.kwargs))
            logged.per_replica.append(call.value)
            logged.step_values.append(call.step_value)
            logged.batches.append(batch)
            logged.given_sizes.append(call.kwargs.get("batch_size"))

    def add_stacked(self, calls: list[LogCall], stacked_values: list[Tensor], num_replicas: int) -> None:
        """Adds the calls of a fused step of ``num_replicas`` replicas: tensor values come stacked, shape
        ``(k, ...)``; any other value, computed once under vmap, is every replica's."""
        tensors = iter(stacked_values)
        for call in calls:
            logged = self._logged.setdefault(call.name, _Logged(call.kwargs))
            if isinstance(call.value, Tensor):
                logged.stacked.append(next(tensors))
            else:
                logged.per_replica.extend([call.value] * num_replicas)
                logged.batches.extend([None] * num_replicas)
                logged.given_sizes.extend([call.kwargs.get("batch_size")] * num_replicas)

    def clear(self) -> None:
        """Drops what was captured (the logs of an attempt that failed: a fused step, an out-of-memory step)."""
        self._logged.clear()

    def replay(self, module: Any, batch_size: Callable[[], int] = lambda: 1) -> None:
        """Logs every captured name once through the real ``module.log``; clears the capture. A mean logged for
        the epoch (``on_epoch=True``; ``training_step``'s default is on step only) weighs in Lightning's epoch mean
        by the batches that logged it, as in plain Lightning: its ``batch_size`` (the one given, else one
        replica's, from ``batch_size()``) times the number of replica values it averages (fewer than k where
        replicas skipped the step before logging); where the replicas' sizes differ (a short batch in the group, or a
        ``batch_size=`` given per replica, a count of tokens say), the mean weighs each replica's value by its own
        size and the step by their sum. Always an integer, so that every process's running count keeps one dtype
        for ``sync_dist``."""
        one_batch: Optional[int] = None
        sizes_of: dict[int, int] = {}  # (each batch's size, inferred once)
        for name, logged in self._logged.items():
            value, kwargs = _reduced_over_replicas(logged), logged.kwargs
            if (
                kwargs.get("on_epoch")
                and not isinstance(value, Metric)
                and over_replicas(kwargs.get("reduce_fx", "mean")) is _MEAN
            ):
                sizes = (
                    _uneven_batch_sizes(logged, sizes_of)
                    if kwargs.get("batch_size") is None
                    else _uneven_given_sizes(logged)
                )
                if sizes is not None:  # (a group of batches of several sizes: each value weighs by its own)
                    value, weight = _weighted_mean(logged.per_replica, sizes), sum(sizes)
                else:
                    if kwargs.get("batch_size") is None and one_batch is None:
                        one_batch = batch_size()
                    values = len(logged.per_replica) + sum(len(rows) for rows in logged.stacked)
                    weight = int(kwargs.get("batch_size") or one_batch) * values
                kwargs = {**kwargs, "batch_size": weight}
            module.log(name, value, **kwargs)
        self._logged.clear()


def over_replicas(reduce_fx: Any) -> Callable[[Tensor], Tensor]:
    """The reduction over the replicas' values (dim 0) that, followed by Lightning's ``reduce_fx`` over the steps,
    gives that reduction over every batch: the mean (the default: Lightning's mean over steps of equal batches), or
    the sum, max or min. (A reduction Lightning does not know gets the mean; Lightning then refuses it.)"""
    name = reduce_fx.lower() if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", "mean")
    return _OVER_REPLICAS.get(name, _OVER_REPLICAS["mean"])


_OVER_REPLICAS: dict[str, Callable[[Tensor], Tensor]] = {
    "mean": lambda values: values.mean(0),
    "sum": lambda values: values.sum(0),
    "max": lambda values: values.amax(0),
    "min": lambda values: values.amin(0),
}
_MEAN = _OVER_REPLICAS["mean"]


def _reduced_over_replicas(logged: _Logged) -> Any:
    """Tensors (stacked or per replica) and numbers reduced over the replicas as ``reduce_fx`` asks
    (:func:`over_replicas`); a Metric object passes through, its step value the replicas' mean
    (:func:`_with_mean_step_value`)."""
    others = [v for v in logged.per_replica if not isinstance(v, Tensor)]
    if others and isinstance(others[0], Metric):
        return _with_mean_step_value(others[0], logged.step_values)
    reduce = over_replicas(logged.kwargs.get("reduce_fx", "mean"))
    tensors = [v for v in logged.per_replica if isinstance(v, Tensor)]
    if not others and len(tensors) + len(logged.stacked) == 1:  # one source: no concatenation needed
        if tensors:
            return tensors[0].detach()  # one replica: its value, exactly as plain Lightning would log it
        return reduce(logged.stacked[0].detach().float())
    rows = [t.detach() for t in logged.stacked]
    rows += [v.detach().unsqueeze(0) for v in tensors]
    rows += [torch.tensor([float(v)]) for v in others]
    return reduce(torch.cat([r.to(rows[0].device).float() for r in rows]))


def _uneven_batch_sizes(logged: _Logged, sizes_of: dict[int, int]) -> Optional[list[int]]:
    """The batch size of each replica value of ``logged`` (Lightning's inference, batch by batch, kept in
    ``sizes_of``) when they are not all one (a short batch in the group: the group ran replica by replica); None when
    they are, or are not known."""
    if logged.stacked or not logged.per_replica or any(batch is None for batch in logged.batches):
        return None
    sizes = []
    for batch in logged.batches:
        if id(batch) not in sizes_of:
            sizes_of[id(batch)] = extract_batch_size(batch)
        sizes.append(sizes_of[id(batch)])
    return sizes if len(set(sizes)) > 1 else None


def _uneven_given_sizes(logged: _Logged) -> Optional[list[int]]:
    """The ``batch_size=`` each replica value of ``logged`` was logged with, when they are not all one; None when
    they are (or some value came stacked, from one fused call: one size for all its replicas)."""
    if logged.stacked or not logged.per_replica or any(size is None for size in logged.given_sizes):
        return None
    sizes = [int(size) for size in logged.given_sizes]
    return sizes if len(set(sizes)) > 1 else None


def _weighted_mean(values: list[Any], weights: list[int]) -> Tensor:
    """``sum_j w_j v_j / sum_j w_j`` over tensors and numbers: the mean over every sample of batches whose means are
    ``values``, as plain Lightning's epoch mean weighs each batch by its size."""
    device = next((v.device for v in values if isinstance(v, Tensor)), torch.device("cpu"))
    rows = torch.stack([torch.as_tensor(v, device=device).detach().float().reshape(()) for v in values])
    weights_tensor = torch.tensor(weights, dtype=rows.dtype, device=device)
    return (rows * weights_tensor).sum() / weights_tensor.sum()


def _with_mean_step_value(metric: Metric, step_values: list[Any]) -> Metric:
    """``metric`` (which already aggregates every replica's updates, the epoch value), its step value (the last
    ``forward``'s, which Lightning logs on step) set to the mean of the replicas' own, where each replica's
    ``forward`` gave a tensor."""
    if len(step_values) > 1 and all(isinstance(v, Tensor) for v in step_values):
        values = torch.stack([v.detach() for v in step_values])
        metric._forward_cache = values.float().mean(0).to(values.dtype)
    return metric
