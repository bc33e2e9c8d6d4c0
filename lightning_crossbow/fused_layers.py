"""Fused forms of layers whose ``vmap`` batching rule is slow (HFTA's lesson: one fused operator per layer type).

Under ``torch.func.vmap`` a convolution whose weights differ per replica becomes one grouped convolution
(``groups = k``). On CPU, PyTorch's grouped convolution and its backward run much slower than one
batched matrix product doing the same arithmetic: with the MNIST-1D CNN at k=8 and b=16, forward
and backward took 5.4 ms with the fused ``Conv1d`` here against 6.5 ms with ``vmap``'s rule (plain
model at b=128: 4.3 ms; medians of 25 interleaved runs, 2 CPU threads; ``benchmarks/throughput.py``
times the same with the SGD step, its "kernels alone" rows). For replica ``j``:

.. math::

    y_j[n, o, l] = b_j[o] + \\sum_{c, t} W_j[o, c, t] \\, x_j^{pad}[n, c, s l + t]
    \\quad\\Longleftrightarrow\\quad
    Y_j = \\mathrm{cols}(x_j) \\, W_j^\\top + b_j

with ``cols(x_j)[(n, l), (c, t)] = x_j^pad[n, c, s l + t]`` (im2col, a view of the padded input):
one ``baddbmm`` over the replicas. While the fused engine runs the module under ``vmap``, its own
``nn.Conv1d`` layers take this form where the call is the plain case
(``groups=1``, ``dilation=1``, zero padding given as a number, weights batched over the replicas by
the engine's ``vmap`` as the innermost transform, no autocast); every other call, and every call outside
``vmap``, runs ``nn.Conv1d``'s own code. The im2col matrix holds every input value ``kernel_size / stride``
times over (the grouped convolution holds none), a cost that is small next to a small model's activations. Only on CPU: on
CUDA ``vmap``'s grouped convolution (cuDNN) is kept, as it was not measured against this.

It reads ``vmap``'s batched tensors with ``torch._C._functorch`` (the functions ``torch.func`` itself
uses); where a PyTorch release lacks them, the layers are left to ``vmap``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_functorch: Any = getattr(torch._C, "_functorch", None)
_AVAILABLE = _functorch is not None and all(
    hasattr(_functorch, name)
    for name in ("current_level", "maybe_get_level", "_unwrap_batched", "_add_batch_dim", "is_functorch_wrapped_tensor")
)


def conv1d_over_replicas(input: Tensor, weight: Tensor, bias: Optional[Tensor], stride: int, padding: int) -> Tensor:
    """``k`` one-dimensional convolutions in one batched matrix product: ``input`` ``(k, n, c, L)``, ``weight``
    ``(k, o, c, t)``, ``bias`` ``(k, o)`` or None; returns ``(k, n, o, L_out)``, row ``j`` equal to
    ``F.conv1d(input[j], weight[j], bias[j], stride, padding)`` up to float rounding."""
    k, n, channels, _ = input.shape
    out_channels, taps = weight.shape[1], weight.shape[3]
    padded = F.pad(input, (padding, padding)) if padding else input
    windows = padded.unfold(3, taps, stride)  # (k, n, c, L_out, t): a view
    length = windows.shape[3]
    columns = windows.permute(0, 1, 3, 2, 4).reshape(k, n * length, channels * taps)
    matrix = weight.reshape(k, out_channels, channels * taps).transpose(1, 2)
    out = torch.bmm(columns, matrix) if bias is None else torch.baddbmm(bias.unsqueeze(1), columns, matrix)
    return out.view(k, n, length, out_channels).transpose(2, 3).contiguous()


def _over_replicas(tensor: Tensor, level: int, replicas: int) -> Optional[Tensor]:
    """``tensor`` as the physical ``(k, ...)`` tensor behind ``vmap`` level ``level`` (expanded when it is the
    same for every replica); None when it is wrapped by another transform (a nested ``vmap``, ``grad``)."""
    physical, dim = _functorch._unwrap_batched(tensor, level)
    if _functorch.is_functorch_wrapped_tensor(physical):
        return None
    return physical.movedim(dim, 0) if dim is not None else physical.expand(replicas, *physical.shape)


def _fused_conv1d(layer: nn.Conv1d, input: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``nn.Conv1d._conv_forward``, through :func:`conv1d_over_replicas` when ``vmap`` batches ``weight`` over the
    replicas and is the innermost transform (not under a ``grad`` or ``jvp`` of the user's own), outside autocast
    (where ``vmap``'s rule keeps the convolution in float32), and the call is one that ``F.conv1d`` accepts."""
    level = _functorch.maybe_get_level(weight)
    if (
        level >= 0
        and level == _functorch.current_level()
        and _functorch.maybe_get_level(input) in (-1, level)
        and input.dim() == 3  # (n, c, L): batched
        and _plain_case(layer)  # (still: a callback may have changed the layer since it was found)
        and not torch.is_autocast_enabled(input.device.type)
        and input.dtype == weight.dtype
        and (bias is None or bias.dtype == weight.dtype)
        and input.shape[1] == weight.shape[1]  # in_channels (otherwise F.conv1d's own error)
        and input.shape[2] + 2 * int(layer.padding[0]) >= weight.shape[2]  # the kernel fits (idem)
    ):
        physical_weight, dim = _functorch._unwrap_batched(weight, level)
        if dim is not None and not _functorch.is_functorch_wrapped_tensor(physical_weight):
            replicas = physical_weight.shape[dim]
            inputs = _over_replicas(input, level, replicas)
            biases = None if bias is None else _over_replicas(bias, level, replicas)
            if inputs is not None and (bias is None or biases is not None):
                out = conv1d_over_replicas(
                    inputs, physical_weight.movedim(dim, 0), biases, layer.stride[0], int(layer.padding[0])
                )
                return _functorch._add_batch_dim(out, 0, level)
    return nn.Conv1d._conv_forward(layer, input, weight, bias)


def _plain_case(layer: nn.Conv1d) -> bool:
    """``groups=1``, ``dilation=1`` and zero padding given as a number: the convolution
    :func:`conv1d_over_replicas` computes."""
    return (
        layer.groups == 1
        and tuple(layer.dilation) == (1,)
        and layer.padding_mode == "zeros"
        and not isinstance(layer.padding, str)
    )


def _fusable(layer: nn.Module) -> bool:
    """A ``Conv1d`` in the plain case, whose ``_conv_forward`` nobody has replaced."""
    return (
        isinstance(layer, nn.Conv1d)
        and type(layer)._conv_forward is nn.Conv1d._conv_forward
        and "_conv_forward" not in vars(layer)
        and _plain_case(layer)
    )


def fusable_layers(module: nn.Module, device: torch.device) -> list[nn.Module]:
    """The layers of ``module`` that :func:`fused_layers` fuses on ``device``: the plain-case ``nn.Conv1d`` layers
    on CPU (none elsewhere, or without the functorch functions)."""
    return [m for m in module.modules() if _fusable(m)] if _AVAILABLE and device.type == "cpu" else []


@contextmanager
def fused_layers(layers: Sequence[nn.Module]) -> Iterator[None]:
    """While active, ``layers`` (from :func:`fusable_layers`) run as :func:`conv1d_over_replicas` when ``vmap``
    batches their weights over the replicas, and as themselves otherwise. Restored on exit."""
    for layer in layers:
        layer._conv_forward = _fused_conv1d.__get__(layer)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for layer in layers:
            del layer._conv_forward
