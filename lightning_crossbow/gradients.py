"""The gradients that hooks and callbacks see: the mean over replicas, on the module's own parameters.

Plain Lightning's ``on_after_backward`` and ``on_before_optimizer_step`` read ``p.grad`` of the
module's parameters (``lightning.pytorch.utilities.grad_norm`` does). Under crossbow the optimizer
steps the stacked replicas, so the module's parameters (z) get no gradient of their own. While
someone reads them, each module parameter's ``.grad`` is kept equal to

.. math::

    \\bar g = \\frac{1}{k} \\sum_{j=1}^{k} g_j

the mean of its replicas' gradients, set whenever backward accumulates into the stacked gradient
(so it also covers ``accumulate_grad_batches``). With scaled averaging every learner starts the step
at z, and :math:`\\bar g` is exactly the gradient at z of the mean loss over the step's k batches:
what plain Lightning shows for one batch of ``k`` times the size.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import partial

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn

#: The hooks that run between backward and the optimizer step, where gradients are read.
GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step")


def hooks_read_gradients(module: pl.LightningModule, callbacks: Iterable[pl.Callback]) -> bool:
    """Whether the module or a callback has its own ``on_after_backward`` or ``on_before_optimizer_step``."""
    return any(is_overridden(hook, owner) for owner in (module, *callbacks) for hook in GRADIENT_HOOKS)


def _set_mean_gradient(parameter: nn.Parameter, stacked: Tensor) -> None:
    parameter.grad = None if stacked.grad is None else stacked.grad.mean(0)


class MeanGradients:
    """Sets ``module``'s parameter ``name``'s ``.grad`` to the mean over rows of ``stacked[name].grad`` every time
    backward accumulates into it (post-accumulate-grad hooks on the stacked leaves), until :meth:`remove`."""

    def __init__(self, module: nn.Module, stacked: Mapping[str, Tensor]) -> None:
        self._pairs = [(module.get_parameter(name), leaf) for name, leaf in stacked.items()]
        self._handles = [
            leaf.register_post_accumulate_grad_hook(partial(_set_mean_gradient, parameter))
            for parameter, leaf in self._pairs
        ]

    def refresh(self) -> None:
        """Sets every mean again from the stacked gradients as they are now (after a gradient scaler
        unscaled them in place, before ``on_before_optimizer_step``)."""
        for parameter, leaf in self._pairs:
            _set_mean_gradient(parameter, leaf)

    def remove(self) -> None:
        """Removes the hooks and the module parameters' gradients."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for parameter, _ in self._pairs:
            parameter.grad = None
