"""Fused forms of operations whose ``vmap`` batching rule is slow (HFTA's lesson: one fused operator per layer type).

**Conv1d.** Under ``torch.func.vmap`` a convolution whose weights differ per replica becomes one grouped convolution
(``groups = k``). On CPU, PyTorch's grouped convolution and its backward run much slower than one
batched matrix product doing the same arithmetic: with the MNIST-1D CNN at k=8 and b=16, forward
and backward took 5.4 ms with the fused ``Conv1d`` here against 6.5 ms with ``vmap``'s rule (plain
model at b=128: 4.3 ms; medians of 25 interleaved runs, 2 CPU threads; ``benchmarks/throughput.py``
times the same with the SGD step, its "kernels alone" rows). For replica ``j``:

.. math::

    y_j[n, o, l] = b_j[o] + \\sum_{c, t} W_j[o, c, t] \\, x_j^{pad}[n, c, s l + t]
    \\quad\\Longleftrightarrow\\quad
    Y_j^\\top = W_j \\, \\mathrm{cols}(x_j)^\\top + b_j \\mathbf{1}^\\top

with ``cols(x_j)[(n, l), (c, t)] = x_j^pad[n, c, s l + t]`` (im2col, gathered from a view of the padded input):
one ``baddbmm`` over the replicas. While the fused engine runs the module under ``vmap``, its own
``nn.Conv1d`` layers take this form where the call is the plain case
(``groups=1``, ``dilation=1``, zero padding given as a number, weights batched over the replicas by
the engine's ``vmap`` as the innermost transform, no autocast); every other call, and every call outside
``vmap``, runs ``nn.Conv1d``'s own code. The im2col matrix holds every input value ``kernel_size / stride``
times over (the grouped convolution holds none), a cost that is small next to a small model's activations.

**Cross-entropy and negative log-likelihood.** ``vmap`` runs ``nll_loss`` (also inside ``F.cross_entropy``) through
PyTorch's Python decomposition: about ten small operations, each dispatched through ``vmap``. The fused form flattens
the replicas into one batch: one ``F.cross_entropy`` (or ``F.nll_loss``) with ``reduction="none"`` over the ``k n``
rows, then each replica's own reduction,

.. math::

    \\ell_j = \\frac{\\sum_{i:\\, y_{ji} \\ne \\mathrm{ignore}} -\\log \\mathrm{softmax}(x_{ji})[y_{ji}]}
                  {|\\{i : y_{ji} \\ne \\mathrm{ignore}\\}|}
    \\quad(\\text{"mean"; "sum" drops the division, "none" keeps the rows; } \\texttt{nll\\_loss}
    \\text{ takes } x_{ji}[y_{ji}] \\text{ as it is}).

The gain is small: at k=8 and b=16, one loss's forward and backward under ``vmap`` took 0.61 ms against 0.70 ms for
``vmap``'s rule (cross-entropy; 0.56 against 0.73 ms for ``nll_loss``; one run of 15 repetitions each). Inside Lightning, the MNIST-1D CNN at k=8
trained 1.06x and 1.10x the samples/s with it as without it (medians of per-round ratios, 9 and 7 interleaved rounds
of 200 steps, 2 CPU threads; single rounds 0.83-1.37x); its forward, backward and SGD step alone, outside
Lightning, gained 0-5% in three runs of 20-30 rounds. While the fused engine runs,
``torch.nn.functional.cross_entropy`` and ``nll_loss`` (which ``nn.CrossEntropyLoss`` and ``nn.NLLLoss`` call) are
these forms. They take the plain case (``(n, C)`` scores batched over the replicas by the engine's ``vmap`` as the
innermost transform, ``(n,)`` class indices, no class weights, no label smoothing) and pass every other call, inside
``vmap`` or not, to PyTorch's own function unchanged. Code that bound a function before the step (``from
torch.nn.functional import cross_entropy``) keeps ``vmap``'s rule; another thread's calls during the step go through
the fused forms too, with the same values. Under autocast the fused cross-entropy computes in float32, as PyTorch's
function does for one replica (``vmap``'s rule returns the autocast dtype: its decomposition runs below autocast's
float32 policy).

Only on CPU: on CUDA ``vmap``'s rules are kept, as they were not measured against these.

It reads ``vmap``'s batched tensors with ``torch._C._functorch`` (the functions ``torch.func`` itself
uses); where a PyTorch release lacks them, the operations are left to ``vmap``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
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
    ``F.conv1d(input[j], weight[j], bias[j], stride, padding)`` up to float rounding.

    The product is ``W_j cols(x_j)^T``, ``(o, c t)`` by ``(c t, n L_out)``: the im2col copy then reads the padded
    input along its length and the result is copied back along its length (the other order, ``cols(x_j) W_j^T``,
    gathers across channels both ways; the MNIST-1D CNN's forward, backward and SGD step at k=8, b=16 reached 3% and 6%
    more samples/s in this order, medians of 11 and 9 interleaved rounds in two runs, 2 CPU threads)."""
    k, n, channels, _ = input.shape
    out_channels, taps = weight.shape[1], weight.shape[3]
    padded = F.pad(input, (padding, padding)) if padding else input
    windows = padded.unfold(3, taps, stride)  # (k, n, c, L_out, t): a view
    length = windows.shape[3]
    columns_t = windows.permute(0, 2, 4, 1, 3).reshape(k, channels * taps, n * length)
    matrix = weight.reshape(k, out_channels, channels * taps)
    out = torch.bmm(matrix, columns_t) if bias is None else torch.baddbmm(bias.unsqueeze(2), matrix, columns_t)
    return out.view(k, out_channels, n, length).transpose(1, 2).contiguous()


def cross_entropy_over_replicas(input: Tensor, target: Tensor, ignore_index: int, reduction: str) -> Tensor:
    """``k`` cross-entropy losses of class-index targets in one call: ``input`` ``(k, n, C)``, ``target`` ``(k, n)``;
    row ``j`` equal to ``F.cross_entropy(input[j], target[j], ignore_index=ignore_index, reduction=reduction)`` up to
    float rounding (``reduction`` ``"mean"``, ``"sum"`` or ``"none"``)."""
    return _class_loss_over_replicas(_OWN["cross_entropy"], input, target, ignore_index, reduction)


def nll_loss_over_replicas(input: Tensor, target: Tensor, ignore_index: int, reduction: str) -> Tensor:
    """:func:`cross_entropy_over_replicas` for ``F.nll_loss`` (``input``: log-probabilities)."""
    return _class_loss_over_replicas(_OWN["nll_loss"], input, target, ignore_index, reduction)


def _class_loss_over_replicas(
    function: Callable[..., Tensor], input: Tensor, target: Tensor, ignore_index: int, reduction: str
) -> Tensor:
    """``function`` (PyTorch's own ``F.cross_entropy`` or ``F.nll_loss``) over the ``k n`` rows, unreduced, then each
    replica's reduction: ``"sum"``, or ``"mean"`` over the targets it does not ignore."""
    k, n = target.shape
    scores = input.reshape(k * n, input.shape[-1])  # (the class count given: n may be 0)
    rows = function(scores, target.reshape(k * n), ignore_index=ignore_index, reduction="none")
    losses = rows.view(k, n)
    if reduction == "none":
        return losses
    total = losses.sum(1)
    return total if reduction == "sum" else total / (target != ignore_index).sum(1).to(total.dtype)


def _batched_by_innermost_vmap(tensor: Tensor) -> Optional[tuple[int, Tensor]]:
    """``(level, physical (k, ...) tensor)`` when ``tensor`` is batched directly by a ``vmap`` that is the innermost
    transform running (not under a ``grad`` or ``jvp`` of the user's own, nor a ``vmap`` nested inside); else None."""
    level = _functorch.maybe_get_level(tensor)
    if level < 0 or level != _functorch.current_level():
        return None
    physical, dim = _functorch._unwrap_batched(tensor, level)
    if dim is None or _functorch.is_functorch_wrapped_tensor(physical):
        return None
    return level, physical.movedim(dim, 0)


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
    batched = _batched_by_innermost_vmap(weight)
    if (
        batched is not None
        and _functorch.maybe_get_level(input) in (-1, batched[0])
        and input.dim() == 3  # (n, c, L): batched
        and _plain_case(layer)  # (still: a callback may have changed the layer since it was found)
        and not torch.is_autocast_enabled(input.device.type)
        and input.dtype == weight.dtype
        and (bias is None or bias.dtype == weight.dtype)
        and input.shape[1] == weight.shape[1]  # in_channels (otherwise F.conv1d's own error)
        and input.shape[2] + 2 * int(layer.padding[0]) >= weight.shape[2]  # the kernel fits (idem)
    ):
        level, weights = batched
        inputs = _over_replicas(input, level, weights.shape[0])
        biases = None if bias is None else _over_replicas(bias, level, weights.shape[0])
        if inputs is not None and (bias is None or biases is not None):
            out = conv1d_over_replicas(inputs, weights, biases, layer.stride[0], int(layer.padding[0]))
            return _functorch._add_batch_dim(out, 0, level)
    return nn.Conv1d._conv_forward(layer, input, weight, bias)


#: PyTorch's own functions that the fused forms stand in for (and pass every other call to), by name in
#: ``torch.nn.functional``.
_OWN: dict[str, Callable[..., Tensor]] = {"cross_entropy": F.cross_entropy, "nll_loss": F.nll_loss}


def _plain_class_loss(
    input: Any, target: Any, weight: Any, size_average: Any, reduce: Any, reduction: str
) -> Optional[tuple[int, Tensor, Tensor]]:
    """``(level, scores (k, n, C), targets (k, n))`` when a class-index loss call is the plain case: ``(n, C)`` scores
    batched over the replicas by the innermost ``vmap``, ``(n,)`` long class indices (batched by it too, or the same
    for every replica), no class weights, no legacy ``size_average``/``reduce``; else None."""
    batched = _batched_by_innermost_vmap(input) if isinstance(input, Tensor) and isinstance(target, Tensor) else None
    if (
        batched is None
        or weight is not None
        or size_average is not None
        or reduce is not None
        or reduction not in ("mean", "sum", "none")
        or input.dim() != 2
        or not input.is_floating_point()
        or target.dim() != 1
        or target.dtype != torch.long
        or input.shape[0] != target.shape[0]
        or _functorch.maybe_get_level(target) not in (-1, batched[0])
    ):
        return None
    level, scores = batched
    targets = _over_replicas(target, level, scores.shape[0])
    return None if targets is None else (level, scores, targets)


def _fused_cross_entropy(
    input: Tensor,
    target: Tensor,
    weight: Optional[Tensor] = None,
    size_average: Optional[bool] = None,
    ignore_index: int = -100,
    reduce: Optional[bool] = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """``F.cross_entropy``, through :func:`cross_entropy_over_replicas` in the plain case (:func:`_plain_class_loss`,
    and no label smoothing)."""
    plain = _plain_class_loss(input, target, weight, size_average, reduce, reduction)
    if plain is not None and label_smoothing == 0.0:
        level, scores, targets = plain
        return _functorch._add_batch_dim(
            cross_entropy_over_replicas(scores, targets, ignore_index, reduction), 0, level
        )
    return _OWN["cross_entropy"](input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)


def _fused_nll_loss(
    input: Tensor,
    target: Tensor,
    weight: Optional[Tensor] = None,
    size_average: Optional[bool] = None,
    ignore_index: int = -100,
    reduce: Optional[bool] = None,
    reduction: str = "mean",
) -> Tensor:
    """``F.nll_loss``, through :func:`nll_loss_over_replicas` in the plain case (:func:`_plain_class_loss`)."""
    plain = _plain_class_loss(input, target, weight, size_average, reduce, reduction)
    if plain is not None:
        level, scores, targets = plain
        return _functorch._add_batch_dim(nll_loss_over_replicas(scores, targets, ignore_index, reduction), 0, level)
    return _OWN["nll_loss"](input, target, weight, size_average, ignore_index, reduce, reduction)


#: The fused forms, by the name of the function of ``torch.nn.functional`` they stand in for.
_FUSED: dict[str, Callable[..., Tensor]] = {"cross_entropy": _fused_cross_entropy, "nll_loss": _fused_nll_loss}


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


def fuses_on(device: torch.device) -> bool:
    """Whether :func:`fused_layers` fuses anything on ``device``: on CPU, with the functorch functions."""
    return _AVAILABLE and device.type == "cpu"


def fusable_layers(module: nn.Module, device: torch.device) -> list[nn.Module]:
    """The layers of ``module`` that :func:`fused_layers` fuses on ``device``: the plain-case ``nn.Conv1d`` layers
    (none where :func:`fuses_on` says no)."""
    return [m for m in module.modules() if _fusable(m)] if fuses_on(device) else []


@contextmanager
def fused_layers(layers: Sequence[nn.Module], losses: bool = False) -> Iterator[None]:
    """While active, ``layers`` (from :func:`fusable_layers`) run as :func:`conv1d_over_replicas` when ``vmap``
    batches their weights over the replicas, and as themselves otherwise; with ``losses``,
    ``torch.nn.functional.cross_entropy`` and ``nll_loss`` are their fused forms (each unless someone else's function
    was there). Restored on exit, however it ends (unless someone else replaced one meanwhile: theirs stays)."""
    for layer in layers:
        layer._conv_forward = _fused_conv1d.__get__(layer)  # type: ignore[method-assign]
    replaced = [name for name in _FUSED if losses and getattr(F, name) is _OWN[name]]  # (never someone else's)
    for name in replaced:
        setattr(F, name, _FUSED[name])
    try:
        yield
    finally:
        for name in replaced:
            if getattr(F, name) is _FUSED[name]:  # (a replacement made meanwhile stays)
                setattr(F, name, _OWN[name])
        for layer in layers:
            del layer._conv_forward
