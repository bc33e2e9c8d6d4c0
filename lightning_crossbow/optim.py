"""The user's optimizer, re-pointed at the replica stack: one element-wise optimizer = k optimizers.

An optimizer whose update of an element depends only on that element's own gradient and state
(SGD, Adam, RMSprop, ...) treats the ``(k, *shape)`` stacked tensor of a parameter exactly like
``k`` independent copies: every replica gets its own momentum / moment estimates, and the user's
learning-rate schedulers keep driving the same ``param_groups``. Optimizers that mix elements
within a tensor (LBFGS, LARS, LAMB, Shampoo, Adafactor, ...) would mix replicas and are refused.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import (
    ASGD,
    LBFGS,
    SGD,
    Adadelta,
    Adagrad,
    Adam,
    Adamax,
    AdamW,
    NAdam,
    Optimizer,
    RAdam,
    RMSprop,
    Rprop,
)

from lightning_crossbow.replicas import resize_rows

#: State entries of torch's element-wise optimizers that are one number per parameter tensor, whatever its
#: shape (Adam's step count, ASGD's eta and mu, NAdam's mu product): never per element, so never per replica.
SCALAR_STATE_KEYS = frozenset({"step", "eta", "mu", "mu_product"})


def stacked_params(optimizer: Optimizer) -> list[Tensor]:
    """The parameters ``optimizer`` steps, in its state_dict's order: the stacked ``(k, *shape)`` replicas (and any
    parameter frozen when training started, which is not replicated: see :func:`stacked_indices`)."""
    return [param for group in optimizer.param_groups for param in group["params"]]


def stacked_indices(optimizer: Optimizer, stacked: Collection[Tensor]) -> list[int]:
    """The positions, in ``optimizer``'s state_dict order, of its parameters that are in ``stacked`` (the stack's
    leaves): the others are module parameters that were frozen when training started, one tensor shared by
    every replica, whose state is the optimizer's own, not per replica."""
    ids = {id(leaf) for leaf in stacked}
    return [index for index, param in enumerate(stacked_params(optimizer)) if id(param) in ids]


def _is_per_element(key: str, value: Any, shape: torch.Size) -> bool:
    """Whether state entry ``key`` is a tensor of one value per element of a parameter of ``shape`` (a
    0-dim parameter included: then only its key tells it from a count)."""
    return isinstance(value, Tensor) and key not in SCALAR_STATE_KEYS and value.shape == shape


ELEMENTWISE_OPTIMIZERS: tuple[type[Optimizer], ...] = (
    SGD,
    Adam,
    AdamW,
    Adamax,
    NAdam,
    RAdam,
    RMSprop,
    Adagrad,
    Adadelta,
    Rprop,
    ASGD,
)


def check_elementwise(optimizer: Optimizer, declared: Iterable[type[Optimizer]] = ()) -> None:
    """Raises ``TypeError`` unless ``optimizer``'s exact class is known (or declared) element-wise."""
    allowed = (*ELEMENTWISE_OPTIMIZERS, *declared)
    if type(optimizer) in allowed:
        return
    name, names = type(optimizer).__name__, ", ".join(cls.__name__ for cls in allowed)
    if isinstance(optimizer, LBFGS):
        raise TypeError(
            f"crossbow cannot use the optimizer {type(optimizer).__qualname__}: L-BFGS steps every parameter together"
            " (its curvature pairs and its line search span all elements), so it would mix the replicas stacked in"
            f" each tensor. Use an element-wise optimizer: {names}."
        )
    parent = next((cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS if isinstance(optimizer, cls)), None)
    if parent is not None:
        how = f"{name} subclasses {parent}, which is: if it keeps its step element-wise, declare it"
    else:
        how = f"If {name} updates every element from that element's own gradient and state only, declare it"
    raise TypeError(
        f"crossbow cannot use the optimizer {type(optimizer).__qualname__}: it is not known to be element-wise,"
        " and an optimizer that mixes elements within a tensor would mix the replicas stacked in it."
        f" Known element-wise optimizers: {names}. {how}: CrossbowStrategy(elementwise_optimizers=[{name}])."
    )


def unfuse_(optimizer: Optimizer) -> list[int]:
    """Sets ``fused=False`` in every param group that asked for ``fused=True``, and returns those groups' indices.

    PyTorch's fused optimizer kernels step non-contiguous parameters wrongly, and at ``k > 1`` a stacked
    ``(k, *shape)`` parameter is a non-contiguous view of its flat ``(k, N)`` buffer. Without ``fused`` the
    optimizer runs its ``foreach`` (or for-loop) implementation: the same update, one kernel per operation. A
    gradient scaler then unscales the gradients itself, as for any optimizer without fused kernels."""
    fused = [index for index, group in enumerate(optimizer.param_groups) if group.get("fused")]
    for index in fused:
        optimizer.param_groups[index]["fused"] = False
    if fused and getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer._step_supports_amp_scaling = False  # (only fused kernels take the scaler's grad_scale/found_inf)
    return fused


@torch.no_grad()
def repoint_to_stack(optimizer: Optimizer, stacked: Mapping[int, Tensor], num_replicas: int) -> None:
    """Replaces every parameter ``p`` in ``optimizer`` by ``stacked[id(p)]`` (when present).

    State the optimizer already holds for ``p`` (Adagrad creates it eagerly) is copied to every
    replica: tensors shaped like ``p`` become ``(k, *p.shape)``, anything else is kept as it is.
    """
    _replace_params(optimizer, stacked, lambda value: value.unsqueeze(0).repeat(num_replicas, *([1] * value.dim())))


@torch.no_grad()
def central_state_dict(optimizer: Optimizer, stacked: Collection[Tensor]) -> dict[str, Any]:
    """``optimizer.state_dict()`` as if it stepped the module's own parameters: every per-replica state
    tensor (shaped like its stacked ``(k, *shape)`` parameter, one of ``stacked``) becomes its mean over the
    replicas; other state (Adam's ``step``...), the state of parameters that are not stacked, and the
    hyper-parameters are kept. Plain Lightning, or any optimizer over the module's parameters, loads it. The
    optimizer itself is not changed."""
    state_dict = optimizer.state_dict()
    params = stacked_params(optimizer)
    for index in stacked_indices(optimizer, stacked):
        param, entry = params[index], state_dict["state"].get(index)
        if entry is not None:  # a new dict: the entry is the optimizer's own
            state_dict["state"][index] = {
                key: value.mean(0) if _is_per_element(key, value, param.shape) else value
                for key, value in entry.items()
            }
    return state_dict


@torch.no_grad()
def central_state_over_ranks(
    central: Mapping[str, Any], ranks: Sequence[Mapping[str, Any]], rows: Sequence[int], stacked: Collection[int]
) -> dict[str, Any]:
    """One process's :func:`central_state_dict` made the mean over the replicas of every process: ``ranks[r]``
    is process ``r``'s stacked ``optimizer.state_dict()``, of ``rows[r]`` replicas. Per-replica state (tensors
    of ``rows[r]`` rows) is summed over every process's rows and divided by ``sum(rows)``; a process with no
    entry for a parameter (none of its replicas stepped it yet) counts as zero rows, as fresh state is. Only the
    parameters at positions ``stacked`` (:func:`stacked_indices`) have per-replica state: the others' is
    ``central``'s. Shared state (Adam's ``step``) and the hyper-parameters are the first process's."""
    total, replicated = sum(rows), set(stacked)
    state: dict[int, dict[str, Any]] = {i: v for i, v in central["state"].items() if i not in replicated}
    for index in sorted({index for rank in ranks for index in rank["state"]} & replicated):
        merged: dict[str, Any] = {}
        summed: set[str] = set()
        for rank, k in zip(ranks, rows):
            for key, value in rank["state"].get(index, {}).items():
                if isinstance(value, Tensor) and key not in SCALAR_STATE_KEYS and value.dim() and len(value) == k:
                    merged[key] = value.sum(0) + merged[key] if key in merged else value.sum(0)
                    summed.add(key)
                else:
                    merged.setdefault(key, value)
        state[index] = {key: value / total if key in summed else value for key, value in merged.items()}
    return {"state": state, "param_groups": central["param_groups"]}


@torch.no_grad()
def seed_stacked_state_(optimizer: Optimizer, saved: Mapping[str, Any], stacked: Collection[Tensor]) -> bool:
    """Loads ``saved``, a state_dict of the same optimizer over the module's own parameters (as
    :func:`central_state_dict` writes it, or plain Lightning), or over stacked ones with another number
    of replicas, into ``optimizer`` over its stacked ``(k, *shape)`` parameters (those in ``stacked``; the
    others take their saved state as it is): every replica gets the same state, the saved one (stacked rows:
    their mean). Hyper-parameters come from ``saved``.
    Returns False, changing nothing, when the saved parameters do not match (count or shapes)."""
    params = stacked_params(optimizer)
    replicated = set(stacked_indices(optimizer, stacked))
    saved_groups = saved.get("param_groups", [])
    if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in optimizer.param_groups]:
        return False
    state: dict[int, dict[str, Any]] = {}
    for index, param in enumerate(params):
        entry = saved.get("state", {}).get(index)
        if entry is None:
            continue
        if index not in replicated:
            if any(
                isinstance(v, Tensor) and k not in SCALAR_STATE_KEYS and v.shape != param.shape
                for k, v in entry.items()
            ):
                return False
            state[index] = dict(entry)
            continue
        shape, rows = param.shape[1:], param.shape[0]
        seeded = {}
        for key, value in entry.items():
            if isinstance(value, Tensor) and key not in SCALAR_STATE_KEYS:
                if value.dim() == param.dim() and value.shape[1:] == shape:
                    value = value.mean(0)  # stacked rows of another k
                if value.shape != shape:
                    return False
                value = value.unsqueeze(0).repeat(rows, *([1] * value.dim()))
            seeded[key] = value
        state[index] = seeded
    groups = [
        {**{k: v for k, v in saved_group.items() if k != "params"}, "params": group_state["params"]}
        for saved_group, group_state in zip(saved_groups, optimizer.state_dict()["param_groups"])
    ]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return True


def take_central_settings_(optimizer: Optimizer, central: Mapping[str, Any]) -> None:
    """The stacked ``optimizer``, loaded from the replicas' own copy of its state, takes what the checkpoint's
    central optimizer state (``optimizer_states``, the one plain Lightning loads) says, as plain Lightning would
    take it, edits included (a new learning rate set in ``on_load_checkpoint``, say): every param group's
    hyper-parameters, and no state at all where the central one holds none. Unedited, it changes nothing."""
    if len(central["param_groups"]) == len(optimizer.param_groups):
        for group, saved_group in zip(optimizer.param_groups, central["param_groups"]):
            group.update({key: value for key, value in saved_group.items() if key != "params"})
    if not central["state"]:
        optimizer.state.clear()


def checkpoint_marks(checkpoint: Mapping[str, Any]) -> dict[tuple[Any, ...], Any]:
    """What each entry of a checkpoint as loaded holds, in its ``state_dict`` and its first optimizer's ``state``: a
    copy of each tensor, any other value itself; which parameters had optimizer state; and whether it held optimizer
    states at all. :func:`edited` compares an entry with its mark, by value, once the hooks that may edit the
    checkpoint (``on_load_checkpoint``) have run: an edit in place (through ``.data`` too) or a new value is seen, a
    new tensor equal to the old is not. (The copies cost one more of those tensors, until the restore.)"""
    marks: dict[tuple[Any, ...], Any] = {
        ("state_dict", name): _mark(value) for name, value in (checkpoint.get("state_dict") or {}).items()
    }
    optimizer_states = checkpoint.get("optimizer_states") or []
    marks[("optimizer_states",)] = len(optimizer_states)
    for index, entries in (optimizer_states[0].get("state", {}) if optimizer_states else {}).items():
        marks[("optimizer", index)] = True
        marks.update({("optimizer", index, key): _mark(value) for key, value in entries.items()})
    return marks


def _mark(value: Any) -> tuple[Any, bool]:
    return (value.detach().clone(), True) if isinstance(value, Tensor) else (value, False)


def edited(mark: Optional[tuple[Any, bool]], value: Any) -> bool:
    """Whether ``value`` differs from what its :func:`checkpoint_marks` mark noted (no mark: a new entry)."""
    if mark is None:
        return True
    noted, was_tensor = mark
    if isinstance(value, Tensor) != was_tensor:
        return True
    if not was_tensor:
        return bool(value != noted)
    return value.shape != noted.shape or value.dtype != noted.dtype or not torch.equal(value.to(noted.device), noted)


@torch.no_grad()
def take_edited_state_(
    optimizer: Optimizer,
    central_state: Mapping[int, Mapping[str, Any]],
    marks: Mapping[tuple[Any, ...], Any],
    stacked: Collection[Tensor],
) -> None:
    """``optimizer``, loaded from the replicas' own copy of its state, takes each entry of the checkpoint's central
    state (``optimizer_states``) edited since it was loaded (:func:`checkpoint_marks`): a stacked parameter's every
    row the edited value (a momentum buffer zeroed in ``on_load_checkpoint``), another's the value; an entry, or a
    parameter's whole state, removed is removed. Unedited, it changes nothing."""
    stacked_ids = {id(leaf) for leaf in stacked}
    params = [param for group in optimizer.param_groups for param in group["params"]]
    for index, param in enumerate(params):
        saved = central_state.get(index)
        if saved is None:
            if marks.get(("optimizer", index)):
                optimizer.state.pop(param, None)
            continue
        own = optimizer.state[param]
        for key in [key for key in own if key not in saved and ("optimizer", index, key) in marks]:
            del own[key]
        for key, value in saved.items():
            if not edited(marks.get(("optimizer", index, key)), value):
                continue
            current = own.get(key)
            if isinstance(value, Tensor) and isinstance(current, Tensor):
                rows = id(param) in stacked_ids and current.shape == (param.shape[0], *value.shape)
                if rows or current.shape == value.shape:
                    current.copy_(value.expand_as(current))
                    continue
            own[key] = value.clone() if isinstance(value, Tensor) else value


@torch.no_grad()
def resize_stacked_state_(optimizer: Optimizer, new_params: Mapping[int, Tensor], num_replicas: int) -> None:
    """Re-points ``optimizer`` from stacked params to ``new_params[id(old)]`` with ``num_replicas`` rows.

    Per-replica state (tensors shaped like the old stacked parameter) keeps its first rows; each
    new row is the mean of the old rows, the state of an average replica, consistent with a new
    replica that starts as z (close to the replicas' mean). Other state (Adam's ``step``...) is kept.
    """
    _replace_params(optimizer, new_params, lambda value: resize_rows(value, num_replicas))


def _replace_params(
    optimizer: Optimizer, replacements: Mapping[int, Tensor], convert: Callable[[Tensor], Tensor]
) -> None:
    """Puts ``replacements[id(p)]`` in place of each ``p`` in the param groups, moving ``p``'s state to it;
    state tensors shaped like ``p`` go through ``convert``, other state is kept as it is."""
    for group in optimizer.param_groups:
        params = []
        for old in group["params"]:
            new = replacements.get(id(old))
            if new is None:
                params.append(old)
                continue
            state = optimizer.state.pop(old, None)
            if state:
                optimizer.state[new] = {
                    key: convert(value) if _is_per_element(key, value, old.shape) else value
                    for key, value in state.items()
                }
            params.append(new)
        group["params"] = params


@torch.no_grad()
def reset_state_rows_(optimizer: Optimizer, rows: Tensor, stacked: Collection[Tensor]) -> None:
    """Zeroes the per-replica optimizer state (momentum, moments, ...) of the replicas in ``rows``, over the
    ``stacked`` parameters. State that the replicas share (Adam's ``step`` count) goes on."""
    for param in stacked:
        for key, value in optimizer.state.get(param, {}).items():
            if _is_per_element(key, value, param.shape):
                value[rows] = 0


class HeldRows:
    """Rows of the stacked parameters and of their per-replica optimizer state, copied before an optimizer
    step and put back after it: in each stacked leaf of ``rows`` (leaf, bool mask of its rows), the replicas
    masked do not take the step (momentum and moments stay as they were). State the step creates (an
    optimizer's first step) is zero in those rows, as for a fresh replica. Shared state (Adam's ``step``
    count) is not per replica and moves for all. Leaves the optimizer does not step are left out."""

    @torch.no_grad()
    def __init__(self, optimizer: Optimizer, rows: Iterable[tuple[Tensor, Tensor]]) -> None:
        self.optimizer = optimizer
        masks = {id(leaf): mask for leaf, mask in rows}
        self.held = [(param, masks[id(param)]) for param in stacked_params(optimizer) if id(param) in masks]
        self.copies: dict[tuple[int, str], Tensor] = {}
        for param, mask in self.held:
            self.copies[(id(param), "")] = param[mask].clone()
            for key, value in optimizer.state.get(param, {}).items():
                if _is_per_element(key, value, param.shape):
                    self.copies[(id(param), key)] = value[mask].clone()

    @torch.no_grad()
    def restore_(self) -> None:
        """Puts the held rows back (their state created by the step: zero)."""
        for param, mask in self.held:
            param[mask] = self.copies[(id(param), "")]
            for key, value in self.optimizer.state.get(param, {}).items():
                if _is_per_element(key, value, param.shape):
                    kept = self.copies.get((id(param), key))
                    value[mask] = 0 if kept is None else kept


@torch.no_grad()
def clip_grad_norm_per_replica_(
    params: Sequence[Tensor], stacked: Collection[Tensor], max_norm: float, norm_type: float = 2.0
) -> Tensor:
    """Clips each replica's gradient to total ``norm_type``-norm ``max_norm``; returns the ``(k,)`` norms.

    Row ``j`` of every stacked gradient (``params`` that are in ``stacked``, ``(k, *shape)``, 0-dim parameters'
    ``(k,)``) belongs to replica ``j``: its total norm is taken over that row of all of them, in ``params``' order,
    as ``torch.nn.utils.clip_grad_norm_`` would for a lone replica. A gradient that every replica shares (a tensor
    the optimizer steps that has no replicas) counts whole in every replica's total, and is scaled by the mean of
    the replicas' scales. With one replica, ``clip_grad_norm_`` exactly.
    """
    ids = {id(leaf) for leaf in stacked}
    grads = [(param.grad, id(param) in ids) for param in params if param.grad is not None]
    if not grads:
        return torch.zeros(0)
    k = next((grad.shape[0] for grad, rows in grads if rows), 1)
    per_tensor = torch.stack(
        [
            torch.linalg.vector_norm(grad.reshape(k, -1), norm_type, dim=1)
            if rows
            else torch.linalg.vector_norm(grad, norm_type).expand(k)
            for grad, rows in grads
        ]
    )
    norms = torch.linalg.vector_norm(per_tensor, norm_type, dim=0)
    scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    per_replica = [grad for grad, rows in grads if rows]
    if per_replica:
        torch._foreach_mul_(per_replica, [scale.view(-1, *([1] * (g.dim() - 1))).to(g.dtype) for g in per_replica])
    for grad, rows in grads:
        if not rows:
            grad.mul_(scale.mean().to(grad.dtype))
    return norms


@contextmanager
def learning_rates_scaled(optimizer: Optimizer, factor: float) -> Iterator[Optional[list[float]]]:
    """Inside the block every param group's ``lr`` is ``factor`` times its own; after it, each is the value it had
    before (a learning-rate scheduler's, untouched). Yields those values from before (what a checkpoint saved
    inside the block holds, :func:`with_learning_rates`), or None where ``factor == 1``, which changes nothing."""
    if factor == 1.0:
        yield None
        return
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor
    try:
        yield list(saved)
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr


def with_learning_rates(state_dict: dict[str, Any], learning_rates: Optional[Sequence[float]]) -> dict[str, Any]:
    """``state_dict`` (an ``optimizer.state_dict()``, whose param groups are its own copies) with its param groups'
    ``lr`` set to ``learning_rates`` in order; unchanged where that is None."""
    if learning_rates is not None:
        for group, lr in zip(state_dict["param_groups"], learning_rates, strict=True):
            group["lr"] = lr
    return state_dict
