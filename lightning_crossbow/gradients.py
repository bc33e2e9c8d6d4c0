"""The gradients that hooks and callbacks see, and change: the mean over replicas, on the module's own parameters.

Plain Lightning's ``on_after_backward``, ``on_before_optimizer_step`` and ``configure_gradient_clipping`` read
(and may change) ``p.grad`` of the module's parameters (``lightning.pytorch.utilities.grad_norm`` reads them), and
``on_before_zero_grad`` (and ``on_train_batch_end``) still see the step's.
Under crossbow the optimizer steps the stacked replicas, so the module's parameters (z) get no gradient of
their own. While someone reads them, each module parameter's ``.grad`` is kept equal to

.. math::

    \\bar g = \\frac{1}{k} \\sum_{j=1}^{k} g_j

the mean of its replicas' gradients, set whenever backward accumulates into the stacked gradient
(so it also covers ``accumulate_grad_batches``). With scaled averaging every learner starts the step
at z, and :math:`\\bar g` is exactly the gradient at z of the mean loss over the step's k batches:
what plain Lightning shows for one batch of ``k`` times the size.

The mean is over the replicas that take the step (a replica that skips it, or whose loss is not finite, is left
out of both). A change that those hooks make to :math:`\\bar g` (in place, through ``.data``, or a new ``.grad``) is
given to every replica:

.. math::

    g_j \\leftarrow g_j + (\\bar g' - \\bar g) \\quad (k > 1), \\qquad g_1 \\leftarrow \\bar g' \\quad (k = 1)

so the replicas' mean gradient is what the hook left (``None``: no replica has a gradient for the parameter, which
the optimizer then skips, as plain Lightning's does). An element that the hook set to exactly zero (from a value
that was not) is zero in every replica's gradient: a layer, or rows of it, held where it is, whatever the optimizer
(with Adam each replica's shifted gradient would give it a step of its own, which their mean does not cancel).
At ``k = 1`` that is plain Lightning's step exactly. With
scaled averaging and an optimizer linear in the gradient (SGD, with momentum), z then moves by the outer learning
rate times what plain Lightning's optimizer would do with the hook's gradient; a change that is not a shift
(clipping ``\\bar g`` by a factor) reaches each replica as the same shift.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import partial
from typing import Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn

#: The hooks that run between backward and the optimizer step, where gradients are read and changed.
GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step")
#: The module's own hook among them, which callbacks do not have.
MODULE_GRADIENT_HOOKS = (*GRADIENT_HOOKS, "configure_gradient_clipping")
#: A hook that runs after the optimizer step, where plain Lightning still shows the step's gradients, made to read
#: them (Lightning's and crossbow's callbacks do not). ``on_train_batch_end`` also shows them, but it is not made
#: for that, and forming the mean for every hook that ends a step would cost each one: a timing callback's
#: ``on_train_batch_end`` took the MNIST-1D CNN at k=1 from 0.86 to 0.76 of plain Lightning's samples/s.
HOOKS_AFTER_THE_STEP = ("on_before_zero_grad",)


def hooks_read_gradients(module: pl.LightningModule, callbacks: Iterable[pl.Callback]) -> bool:
    """Whether the module or a callback has its own ``on_after_backward`` or ``on_before_optimizer_step``, the module
    its own ``configure_gradient_clipping``, or the module or a callback of the user's own (not Lightning's or
    crossbow's) its own ``on_before_zero_grad``."""
    callbacks = list(callbacks)
    users = [c for c in callbacks if not type(c).__module__.startswith(("lightning.", "lightning_crossbow."))]
    return (
        any(is_overridden(hook, module) for hook in (*MODULE_GRADIENT_HOOKS, *HOOKS_AFTER_THE_STEP))
        or any(is_overridden(hook, callback) for callback in callbacks for hook in GRADIENT_HOOKS)
        or any(is_overridden(hook, callback) for callback in users for hook in HOOKS_AFTER_THE_STEP)
    )


class MeanGradients:
    """Sets ``module``'s parameter ``name``'s ``.grad`` to the mean over rows of ``stacked[name].grad`` every time
    backward accumulates into it (post-accumulate-grad hooks on the stacked leaves), until :meth:`remove`; and gives
    the replicas what hooks changed in it (:meth:`apply_changes_`). The mean is over the replicas that take the
    step (:attr:`rows`): one that skips it or diverged is left out, as it is left out of the step."""

    def __init__(self, module: nn.Module, stacked: Mapping[str, Tensor]) -> None:
        self._pairs = [(module.get_parameter(name), leaf) for name, leaf in stacked.items()]
        #: per pair: the ``.grad`` shown (or None), and a copy of it, to see any change (``.data`` edits included)
        self._shown: list[Optional[Tensor]] = [None] * len(self._pairs)
        self._copies: list[Optional[Tensor]] = [None] * len(self._pairs)
        #: the replicas that take this step (a bool mask over rows); None: all of them
        self.rows: Optional[Tensor] = None
        self._handles = [
            leaf.register_post_accumulate_grad_hook(partial(self._show, index))
            for index, (_, leaf) in enumerate(self._pairs)
        ]

    def _mean(self, leaf: Tensor) -> Optional[Tensor]:
        """The mean over :attr:`rows` of ``leaf``'s gradient (over all rows when none takes the step)."""
        if leaf.grad is None:
            return None
        if self.rows is None or not bool(self.rows.any()):
            return leaf.grad.mean(0)
        return leaf.grad[self.rows].mean(0)

    def _show(self, index: int, _leaf: Optional[Tensor] = None) -> None:
        parameter, leaf = self._pairs[index]
        grad = self._mean(leaf)
        parameter.grad = grad
        self._shown[index], self._copies[index] = grad, None if grad is None else grad.clone()

    def refresh(self) -> None:
        """Sets every mean again from the stacked gradients as they are now (after a gradient scaler
        unscaled them in place, before ``on_before_optimizer_step``; after clipping)."""
        for index in range(len(self._pairs)):
            self._show(index)

    @torch.no_grad()
    def apply_changes_(self) -> None:
        """Gives the replicas' gradients the change that hooks made to the mean shown on the module's parameters
        (see the module's docstring), and shows the new mean."""
        for index, (parameter, leaf) in enumerate(self._pairs):
            grad, shown, copy = parameter.grad, self._shown[index], self._copies[index]
            if grad is shown and (grad is None or _same_bits(grad, copy)):
                continue
            if grad is None:
                leaf.grad = None
            elif leaf.grad is None:
                leaf.grad = grad.unsqueeze(0).expand_as(leaf).clone()  # (from no gradient: every replica gets it)
            elif leaf.shape[0] == 1:
                leaf.grad.copy_(grad.unsqueeze(0))
            else:
                before = copy if copy is not None else self._mean(leaf)
                leaf.grad.add_((grad - before).unsqueeze(0))
                leaf.grad.masked_fill_(((grad == 0) & (before != 0)).unsqueeze(0), 0.0)  # (held elements)
            self._show(index)

    def remove(self) -> None:
        """Removes the hooks and the module parameters' gradients."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for parameter, _ in self._pairs:
            parameter.grad = None


def _same_bits(tensor: Tensor, other: Optional[Tensor]) -> bool:
    """Whether two tensors hold the same bits (NaN equal to the same NaN; changes made through ``.data`` seen),
    compared as the widest integers their bytes make (``torch.equal`` on bytes is several times slower)."""
    if other is None or tensor.shape != other.shape or tensor.dtype != other.dtype:
        return False
    size = tensor.numel() * tensor.element_size()
    as_int = next(dtype for dtype in _BIT_VIEWS if size % dtype.itemsize == 0)
    try:
        bytes_, other_bytes = (t.contiguous().reshape(-1).view(torch.uint8) for t in (tensor, other))
    except RuntimeError:  # (a conjugate or negative view, a sparse tensor: compared by value)
        return torch.equal(tensor, other)
    try:
        return torch.equal(bytes_.view(as_int), other_bytes.view(as_int))
    except RuntimeError:  # (a view whose offset into its storage does not align with the wider integers)
        return torch.equal(bytes_, other_bytes)


_BIT_VIEWS = (torch.int64, torch.int32, torch.int16, torch.uint8)
