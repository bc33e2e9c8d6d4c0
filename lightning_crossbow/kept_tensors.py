"""Tensors that a fused ``training_step`` keeps on the module, where they would escape ``vmap``.

Lightning's own idiom keeps a step's tensors on the module for a later hook (``self.outputs.append(preds)`` in
``training_step``, ``torch.cat(self.outputs)`` in ``on_train_epoch_end``; or ``self.last_logits = logits``).
Under ``torch.func.vmap`` such a tensor is one of ``vmap``'s batched wrappers: once the fused step returns it is
dead, and the first use of it fails inside PyTorch. The sequential engine keeps each replica's own tensor (k
per step), as ``training_step`` would in a loop.

:class:`KeptTensors` looks, after a fused step, at what the step changed in the LightningModule's own attributes:
a tensor set as an attribute, a tensor appended to a list attribute, a tensor put into a dict attribute (one
level down, as these idioms do). It undoes those changes and names the attribute, so that ``engine="auto"`` can
run the step again sequentially; ``engine="fused"`` refuses it. Submodules' attributes and deeper containers are
not looked at.
"""

from __future__ import annotations

from functools import cache
from typing import Any, Optional

import lightning.pytorch as pl
from torch import Tensor, nn

try:
    from torch._C._functorch import is_functorch_wrapped_tensor
except ImportError:  # pragma: no cover - every supported PyTorch release has it

    def is_functorch_wrapped_tensor(tensor: Tensor) -> bool:
        return False


_MISSING = object()


@cache
def _own_attributes(cls: type[nn.Module]) -> frozenset[str]:
    """The attributes every instance of ``cls``'s framework base holds from its ``__init__`` (parameters, buffers,
    submodules, hooks, Lightning's state): not the user's, and never a step's tensors."""
    base = pl.LightningModule if issubclass(cls, pl.LightningModule) else nn.Module
    return frozenset(vars(base()))


def _escaped(value: Any, depth: int = 2) -> bool:
    """Whether ``value`` is a tensor of a ``vmap`` (or another functorch transform), or a list, tuple or dict that
    holds one (``depth`` levels down)."""
    if isinstance(value, Tensor):
        return is_functorch_wrapped_tensor(value)
    if depth == 0:
        return False
    if isinstance(value, (list, tuple)):
        return any(_escaped(item, depth - 1) for item in value)
    if isinstance(value, dict):
        return any(_escaped(item, depth - 1) for item in value.values())
    return False


class KeptTensors:
    """What the module's attributes held before a fused step: :meth:`undo_escaped` then finds and undoes the
    tensors the step kept there."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        own = _own_attributes(type(module))
        self.attributes = {name: value for name, value in vars(module).items() if name not in own}
        self.list_lengths = {name: len(value) for name, value in self.attributes.items() if isinstance(value, list)}
        self.dicts = {name: dict(value) for name, value in self.attributes.items() if type(value) is dict}

    def undo_escaped(self) -> Optional[str]:
        """Undoes what the step kept that holds ``vmap``'s tensors, and says where it was (None: nothing)."""
        kept: list[str] = []
        current = vars(self.module)
        own = _own_attributes(type(self.module))
        for name, value in list(current.items()):
            if name in own:
                continue
            before = self.attributes.get(name, _MISSING)
            if value is not before:  # set during the step
                if _escaped(value):
                    kept.append(f"self.{name}")
                    if before is _MISSING:
                        del current[name]
                    else:
                        current[name] = before
            elif isinstance(value, list):
                added = value[self.list_lengths[name] :] if len(value) >= self.list_lengths[name] else value
                if _escaped(added):
                    kept.append(f"self.{name} (a list)")
                    value[:] = [item for item in value if not _escaped([item])]
            elif name in self.dicts and _escaped(value):
                kept.append(f"self.{name} (a dict)")
                value.clear()
                value.update(self.dicts[name])
        return ", ".join(kept) or None
