"""Tensors that a fused ``training_step`` keeps on the module, where they would escape ``vmap``.

Lightning's own idiom keeps a step's tensors on the module for a later hook (``self.outputs.append(preds)`` in
``training_step``, ``torch.cat(self.outputs)`` in ``on_train_epoch_end``; or ``self.last_logits = logits``).
Under ``torch.func.vmap`` such a tensor is one of ``vmap``'s batched wrappers: once the fused step returns it is
dead, and the first use of it fails inside PyTorch. The sequential engine keeps each replica's own tensor (k
per step), as ``training_step`` would in a loop.

:class:`KeptTensors` copies, before each fused step, the LightningModule's own attributes (not Lightning's, nor its
submodules'), and the lists, deques and dicts among them of at most :data:`LOOKED_THROUGH` items (two levels
down). After the step it looks for such tensors there: an attribute set to one, or a list, deque, dict or tuple
holding one (a container of more items in its last :data:`LOOKED_THROUGH` only, where appending puts new items; a
dict keeps its keys in insertion order). Where the attempt failed, for that or any other reason, what it did to
those attributes is undone: an attribute it set is set back (a counter it raised), one it added is removed, the
small containers are put back, and the ``vmap`` tensors are taken out of the larger ones' last items (other items
it added to a larger container stay). ``engine="auto"`` then runs the step again sequentially; ``engine="fused"``
refuses it. Where a module hook runs during the step (a forward hook that a callback registered, say), the
callbacks' attributes are looked at and undone alike (an activation-statistics callback keeping a layer's output in
a dict of its own). Not looked at: sets, other objects' attributes, a submodule's attributes, and an earlier item of
a large container replaced (a tensor kept there still fails inside PyTorch).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Reversible, Sequence
from functools import cache
from itertools import islice
from typing import Any, Optional

import lightning.pytorch as pl
from torch import Tensor, nn

from lightning_crossbow.fused_layers import global_module_hooks

try:
    from torch._C._functorch import is_functorch_wrapped_tensor
except ImportError:  # pragma: no cover - every supported PyTorch release has it

    def is_functorch_wrapped_tensor(tensor: Tensor) -> bool:
        return False


#: Containers up to this many items are looked through whole; larger ones at their last this many.
LOOKED_THROUGH = 64
_MISSING = object()


#: What Lightning's ``save_hyperparameters`` sets on the module.
_HYPERPARAMETERS = frozenset({"_hparams", "_hparams_initial", "_hparams_name"})


@cache
def _own_attributes(cls: type[nn.Module]) -> frozenset[str]:
    """The attributes every instance of ``cls``'s framework base holds from its ``__init__`` (parameters, buffers,
    submodules, hooks, Lightning's state), and Lightning's hyperparameters: not the user's, nor a step's tensors."""
    if not issubclass(cls, pl.LightningModule):
        return frozenset(vars(nn.Module()))
    return frozenset(vars(pl.LightningModule())) | _HYPERPARAMETERS


def _recent(items: Reversible[Any], length: int) -> list[Any]:
    """The last :data:`LOOKED_THROUGH` of ``length`` items (all of them when there are no more), in order."""
    if length <= LOOKED_THROUGH:
        return list(items)
    return list(islice(reversed(items), LOOKED_THROUGH))[::-1]


def _escaped(value: Any, depth: int = 2) -> bool:
    """Whether ``value`` is a tensor of a ``vmap`` (or another functorch transform), or a tuple, list, deque or dict
    that holds one among its recent items, ``depth`` levels down."""
    if isinstance(value, Tensor):
        return is_functorch_wrapped_tensor(value)
    if depth == 0:
        return False
    if isinstance(value, (list, tuple, deque)):
        return any(_escaped(item, depth - 1) for item in _recent(value, len(value)))
    if isinstance(value, dict):
        return any(_escaped(item, depth - 1) for item in _recent(value.values(), len(value)))
    return False


def _recent_slots(container: Any) -> list[tuple[Any, Any]]:
    """``(key or index, item)`` of the recent items of a dict, list or deque (see :func:`_recent`); none for others."""
    if isinstance(container, dict):
        return [(key, container[key]) for key in _recent(container.keys(), len(container))]
    if isinstance(container, (list, deque)):
        return [(index, container[index]) for index in range(max(0, len(container) - LOOKED_THROUGH), len(container))]
    return []


def _take_out(container: Any, depth: int = 2) -> bool:
    """Takes the escaped tensors (and the tuples that hold one) out of the recent items of a list, deque or dict,
    ``depth`` levels down, in place (in a tuple, out of the lists, deques and dicts it holds); whether it took any."""
    if isinstance(container, tuple):
        return any([_take_out(value, depth - 1) for value in container]) if depth > 1 else False
    took = False
    for slot, value in reversed(_recent_slots(container)):  # (from the end: the indices before stay valid)
        if isinstance(value, (Tensor, tuple)) and _escaped(value, depth - 1):
            del container[slot]
            took = True
        elif depth > 1:
            took |= _take_out(value, depth - 1)
    return took


def _copy(container: Any, depth: int = 2) -> Optional[tuple[Any, list[Any]]]:
    """``(container, its items)`` for a list, deque or dict of at most :data:`LOOKED_THROUGH` items, with the
    same for the containers among them, ``depth`` levels down; None for anything else."""
    if depth == 0 or not isinstance(container, (list, deque, dict)) or len(container) > LOOKED_THROUGH:
        return None
    items = list(container.items()) if isinstance(container, dict) else list(container)
    inner = [_copy(item[1] if isinstance(container, dict) else item, depth - 1) for item in items]
    return container, list(zip(items, inner))


def _put_back(copy: tuple[Any, list[Any]]) -> None:
    """Puts a container (and the containers in it) back to what :func:`_copy` saw, in place."""
    container, items = copy
    container.clear()
    if isinstance(container, dict):
        container.update(item for item, _ in items)
    else:
        container.extend(item for item, _ in items)
    for _, inner in items:
        if inner is not None:
            _put_back(inner)


class _AttributesOf:
    """One object's attributes before a fused step (and copies of its small containers), named ``label`` in messages;
    ``excluded`` names attributes that are not the user's (a framework base's own)."""

    def __init__(self, holder: object, label: str, excluded: frozenset[str]) -> None:
        self.holder, self.label, self.excluded = holder, label, excluded
        self.attributes = self._user_attributes()
        self.copies = {name: _copy(value) for name, value in self.attributes.items()}

    def _user_attributes(self) -> dict[str, Any]:
        return {name: value for name, value in vars(self.holder).items() if name not in self.excluded}

    def escaped(self) -> list[str]:
        return [
            f"{self.label}.{name}"
            if value is not self.attributes.get(name, _MISSING)
            else f"{self.label}.{name} (a {type(value).__name__})"
            for name, value in self._user_attributes().items()
            if _escaped(value)
        ]

    def undo(self) -> None:
        current = vars(self.holder)
        for name in self._user_attributes():
            if name not in self.attributes:
                del current[name]  # (set by the step)
        for name, before in self.attributes.items():
            current[name] = before
            if self.copies[name] is not None:
                _put_back(self.copies[name])
            _take_out(before)


def has_module_hooks(modules: Iterable[nn.Module]) -> bool:
    """Whether a hook of one of ``modules`` (a module and its submodules), or a global module hook, runs during their
    forward or backward (where it may keep a step's tensors elsewhere: an activation-statistics callback's own dict)."""
    return global_module_hooks() or any(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks for m in modules
    )


class KeptTensors:
    """The module's attributes before a fused step (and copies of its small containers), and the callbacks' where a
    module hook runs during the step (one may keep a layer's output in a callback, as activation-statistics callbacks
    do): :meth:`escaped` then says where the step kept ``vmap``'s tensors, and :meth:`undo` undoes what the step did
    to those attributes."""

    def __init__(self, module: nn.Module, callbacks: Sequence[object] = (), hooks: bool = False) -> None:
        """``hooks``: whether a module hook runs during the step (:func:`has_module_hooks`); the callbacks are looked
        at only then."""
        self.module = module
        self.holders = [_AttributesOf(module, "self", _own_attributes(type(module)))]
        if callbacks and hooks:
            self.holders += [
                _AttributesOf(callback, type(callback).__name__, frozenset())
                for callback in callbacks
                if hasattr(callback, "__dict__")  # (not one of __slots__ only)
            ]

    def escaped(self) -> Optional[str]:
        """Where the step kept ``vmap``'s tensors (None: nowhere)."""
        return ", ".join(place for holder in self.holders for place in holder.escaped()) or None

    def undo(self) -> None:
        """Undoes what the step did to the attributes: those it set are set back, those it added removed, the small
        containers put back; then no ``vmap`` tensor is left in them (nor in a large container's last items, nor in
        the containers a tuple holds)."""
        for holder in self.holders:
            holder.undo()
