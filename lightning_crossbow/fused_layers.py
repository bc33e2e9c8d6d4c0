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
``vmap``'s rule (cross-entropy; 0.56 against 0.73 ms for ``nll_loss``; one run of 15 repetitions each). Inside
Lightning, the MNIST-1D CNN at k=8 trained 1.06x and 1.10x the samples/s with it as without it (medians of
per-round ratios, 9 and 7 interleaved rounds of 200 steps, 2 CPU threads; single rounds 0.83-1.37x); its forward,
backward and SGD step alone, outside Lightning, gained 0-5% in three runs of 20-30 rounds. While the fused engine runs,
``torch.nn.functional.cross_entropy`` and ``nll_loss`` (which ``nn.CrossEntropyLoss`` and ``nn.NLLLoss`` call) are
these forms. They take the plain case (``(n, C)`` scores batched over the replicas by the engine's ``vmap`` as the
innermost transform, ``(n,)`` class indices, no class weights, no label smoothing) and pass every other call, inside
``vmap`` or not, to PyTorch's own function unchanged. Code that bound a function before the step (``from
torch.nn.functional import cross_entropy``) keeps ``vmap``'s rule; another thread's calls during the step go through
the fused forms too, with the same values. Under autocast the fused cross-entropy computes in float32, as PyTorch's
function does for one replica (``vmap``'s rule returns the autocast dtype: its decomposition runs below autocast's
float32 policy).

**Runs of layers in an ``nn.Sequential``.** ``vmap``'s dispatch sees every operation while it is active, also one
on physical tensors, and each layer between two fused ones (a ReLU, a Flatten) pays it in full. While the fused
engine runs, an ``nn.Sequential`` (not a subclass) computes each run of consecutive layers that have a form over the
replicas on the physical ``(k, ...)`` tensor, unwrapped once at the run's start and wrapped once at its end, with
``vmap``'s layer popped off functorch's stack meanwhile (as the fused forms above also compute). The layers with such a
form (:data:`_IN_RUN`, each of that exact type, with no hooks of its own, and neither its ``forward`` nor the function
it calls replaced, by a profiler, say):
``Conv1d`` in the plain case above, ``Linear`` (:func:`linear_over_replicas`, one ``baddbmm``), ``Flatten``,
``Unflatten`` and the element-wise activations. A layer's weight must be batched over the replicas (weights that
the replicas share keep ``vmap``'s rule, which computes them once). Every other layer runs as itself under ``vmap``,
and so does every layer under autocast, while global module hooks are set, or while ``nn.Sequential.forward`` is
replaced. The same values up to float rounding. Inside a run a ``Conv1d`` whose output another ``Conv1d`` reads next
(through element-wise layers only) leaves it in its product's memory, ``(k, o, n, L_out)`` seen transposed, which the
element-wise layers keep and the next ``Conv1d`` reads without a copy (and their backward likewise); any other
``Conv1d`` output is made contiguous at once, as the layer's own call gives it. With the
MNIST-1D CNN at k=8, b=16 that made the forward, backward and SGD step alone 1.13x as fast (median of per-round
ratios, 8 rounds in alternating processes, 2 threads of an Intel Xeon; 0.82 to 0.91 of one model at b=128).
With the MNIST-1D CNN at k=8 and b=16, its forward and backward took 0.73 of the time they took with the fused
``Conv1d`` and cross-entropy alone (median of per-round ratios, 8 rounds in alternating processes, 2 CPU threads);
inside Lightning the fused engine ran 1.20x the samples/s (8 rounds of 300 steps, alternating processes).

Only on CPU: on CUDA ``vmap``'s rules are kept, as they were not measured against these.

It reads ``vmap``'s batched tensors with ``torch._C._functorch`` (the functions ``torch.func`` itself
uses); where a PyTorch release lacks them, the operations are left to ``vmap``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_functorch: Any = getattr(torch._C, "_functorch", None)
_AVAILABLE = _functorch is not None and all(
    hasattr(_functorch, name)
    for name in (
        "current_level",
        "maybe_get_level",
        "_unwrap_batched",
        "_add_batch_dim",
        "is_functorch_wrapped_tensor",
        "pop_dynamic_layer_stack",
        "push_dynamic_layer_stack",
    )
)


def _torchs_own(function: Any) -> bool:
    """Whether ``function`` is PyTorch's own: defined in a ``torch`` module, and not a wrapper made with
    ``functools.wraps`` (which keeps the name and module and adds ``__wrapped__``). The functions and methods that the
    fused forms stand in for are taken as this module is imported and checked with this, so that a replacement made
    before then (a profiler's, say) is not taken for PyTorch's own; one made later is told by its identity."""
    module = getattr(function, "__module__", None) or ""
    return (module == "torch" or module.startswith("torch.")) and not hasattr(function, "__wrapped__")


def conv1d_over_replicas(
    input: Tensor, weight: Tensor, bias: Optional[Tensor], stride: int, padding: int, contiguous: bool = True
) -> Tensor:
    """``k`` one-dimensional convolutions in one batched matrix product: ``input`` ``(k, n, c, L)``, ``weight``
    ``(k, o, c, t)``, ``bias`` ``(k, o)`` or None; returns ``(k, n, o, L_out)``, row ``j`` equal to
    ``F.conv1d(input[j], weight[j], bias[j], stride, padding)`` up to float rounding. With ``contiguous=False`` the
    result is the product's own memory, ``(k, o, n, L_out)``, seen transposed: an ``input`` laid out so (the output of
    another such convolution, or of an element-wise function of it) is read without a copy.

    The product is ``W_j cols(x_j)^T``, ``(o, c t)`` by ``(c t, n L_out)``: the im2col copy then reads the padded
    input along its length and the result is copied back along its length (the other order, ``cols(x_j) W_j^T``,
    gathers across channels both ways; the MNIST-1D CNN's forward, backward and SGD step at k=8, b=16 reached 3% and 6%
    more samples/s in this order, medians of 11 and 9 interleaved rounds in two runs, 2 CPU threads). ``cols`` is
    stacked from ``t`` strided slices of the input, one per tap, already in the product's layout, whose backward is
    ``t`` strided additions; ``Tensor.unfold``'s backward (the im2col as a view) is a generic scatter that took a
    fifth of the three convolutions' forward and backward more (5.2 ms against 4.0 ms, plain model at b=128 4.0 ms;
    medians of 15 interleaved rounds, 2 threads of an Intel Xeon)."""
    k, n, channels, _ = input.shape
    out_channels, taps = weight.shape[1], weight.shape[3]
    by_channel = input.transpose(1, 2)  # (k, c, n, L): a view
    by_channel = F.pad(by_channel, (padding, padding)) if padding else by_channel
    length = (by_channel.shape[3] - taps) // stride + 1
    span = stride * (length - 1) + 1  # the input positions one tap reads, first to last
    columns_t = torch.stack([by_channel[..., tap : tap + span : stride] for tap in range(taps)], dim=2)
    # (k, c t, n L_out): a view of the stacked slices, contiguous unless the input's channels were innermost in memory
    # (x.transpose(1, 2) of (n, L, c) data: the stack then keeps that layout, and this copies)
    columns_t = columns_t.reshape(k, channels * taps, n * length)
    matrix = weight.reshape(k, out_channels, channels * taps)
    out = torch.bmm(matrix, columns_t) if bias is None else torch.baddbmm(bias.unsqueeze(2), matrix, columns_t)
    out = out.view(k, out_channels, n, length).transpose(1, 2)
    return out.contiguous() if contiguous else out


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
    return level, _replicas_first(physical, dim)


def _over_replicas(tensor: Tensor, level: int, replicas: int) -> Optional[Tensor]:
    """``tensor`` as the physical ``(k, ...)`` tensor behind ``vmap`` level ``level`` (expanded when it is the
    same for every replica); None when it is wrapped by another transform (a nested ``vmap``, ``grad``)."""
    physical, dim = _functorch._unwrap_batched(tensor, level)
    if _functorch.is_functorch_wrapped_tensor(physical):
        return None
    return _replicas_first(physical, dim) if dim is not None else physical.expand(replicas, *physical.shape)


def _replicas_first(physical: Tensor, dim: int) -> Tensor:
    """``physical`` with its replica dimension ``dim`` first (itself where it is first already: no view, and no
    node in the autograd graph)."""
    return physical if dim == 0 else physical.movedim(dim, 0)


@contextmanager
def _vmap_popped() -> Iterator[None]:
    """The innermost transform (the engine's ``vmap``) off functorch's stack while active, for code that computes on
    physical tensors only: ``vmap``'s dispatch would otherwise see each of its operations, though none is on a
    batched tensor (the MNIST-1D CNN's fused forward and backward at k=8, b=16 took 2.57 ms with it against 2.94 ms
    without, medians of 11 interleaved rounds of 100 steps, 2 CPU threads). Back on the stack however it ends."""
    layer = _functorch.pop_dynamic_layer_stack()
    try:
        yield
    finally:
        _functorch.push_dynamic_layer_stack(layer)


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
            with _vmap_popped():
                out = conv1d_over_replicas(inputs, weights, biases, layer.stride[0], int(layer.padding[0]))
            return _functorch._add_batch_dim(out, 0, level)
    return type(layer)._conv_forward(layer, input, weight, bias)  # (the class's: PyTorch's, or its replacement)


# Runs of layers in an ``nn.Sequential``. Each layer type below has a form over the replicas in two parts: ``prepare``
# takes the layer's parameters as physical ``(k, ...)`` tensors while ``vmap`` runs (None where the layer is not its
# plain case), and ``compute`` takes and gives the physical tensor with ``vmap``'s layer popped (None where the input is
# not the plain case). A layer that gives None runs as itself, under ``vmap``.


def _weights_over_replicas(weight: Tensor, level: int) -> Optional[Tensor]:
    """``weight`` as the physical ``(k, ...)`` tensor where ``vmap`` level ``level`` batches it directly; else None
    (weights shared by the replicas keep ``vmap``'s rule, which computes them once)."""
    batched = _batched_by_innermost_vmap(weight)
    return batched[1] if batched is not None and batched[0] == level else None


def _weight_and_bias(layer: nn.Module, level: int, weight_dims: int) -> Optional[tuple[Tensor, Optional[Tensor]]]:
    """``layer``'s ``weight`` and ``bias`` over the replicas: a weight of ``weight_dims`` dimensions per replica,
    batched by ``vmap``, and a bias of one value per output, batched or shared; None where they are not (a weight or
    bias of another shape, which the layer's own call broadcasts or refuses)."""
    weights = _weights_over_replicas(layer.weight, level)
    if weights is None or weights.dim() != weight_dims + 1:
        return None
    if layer.bias is None:
        return weights, None
    biases = _over_replicas(layer.bias, level, weights.shape[0])
    if biases is None or biases.shape != weights.shape[:2] or biases.dtype != weights.dtype:
        return None
    return weights, biases


def _prepare_conv1d(layer: nn.Conv1d, level: int) -> Optional[tuple[Tensor, Optional[Tensor]]]:
    """A plain-case ``Conv1d`` whose ``_conv_forward`` is its own or its fused form (not someone else's)."""
    replaced = vars(layer).get("_conv_forward")
    if not _plain_case(layer) or (replaced is not None and getattr(replaced, "__func__", None) is not _fused_conv1d):
        return None
    return _weight_and_bias(layer, level, weight_dims=3)


def _prepare_linear(layer: nn.Linear, level: int) -> Optional[tuple[Tensor, Optional[Tensor]]]:
    """A ``Linear``'s weight and bias."""
    return _weight_and_bias(layer, level, weight_dims=2)


def _conv1d_in_run(layer: nn.Conv1d, x: Tensor, parameters: tuple[Tensor, Optional[Tensor]]) -> Optional[Tensor]:
    """``layer`` on ``x`` ``(k, n, c, L)``, in any memory layout: :func:`conv1d_over_replicas`, its output left in the
    product's layout (:func:`_run` makes it contiguous unless another convolution reads it next)."""
    weights, biases = parameters
    padding = int(layer.padding[0])
    if (
        x.dim() != 4
        or x.dtype != weights.dtype
        or x.shape[2] != weights.shape[2]  # in_channels (otherwise F.conv1d's own error)
        or x.shape[3] + 2 * padding < weights.shape[3]  # the kernel fits (idem)
    ):
        return None
    return conv1d_over_replicas(x, weights, biases, layer.stride[0], padding, contiguous=False)


def linear_over_replicas(input: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``k`` linear maps in one batched matrix product: ``input`` ``(k, *, i)``, ``weight`` ``(k, o, i)``, ``bias``
    ``(k, o)`` or None; returns ``(k, *, o)``, row ``j`` equal to ``F.linear(input[j], weight[j], bias[j])`` up to
    float rounding: :math:`Y_j = X_j W_j^\\top + \\mathbf{1} b_j^\\top`."""
    rows = input.unsqueeze(1) if input.dim() == 2 else input.flatten(1, -2)  # (k, rows, i), also for no rows
    matrix = weight.transpose(1, 2)
    out = torch.bmm(rows, matrix) if bias is None else torch.baddbmm(bias.unsqueeze(1), rows, matrix)
    return out.view(*input.shape[:-1], weight.shape[1])


def _linear_in_run(layer: nn.Linear, x: Tensor, parameters: tuple[Tensor, Optional[Tensor]]) -> Optional[Tensor]:
    """``layer`` on ``x`` ``(k, *, i)``: :func:`linear_over_replicas`."""
    weights, biases = parameters
    if x.dim() < 2 or x.shape[-1] != weights.shape[2] or x.dtype != weights.dtype:
        return None
    return linear_over_replicas(x, weights, biases)


def _replica_dim(dim: int, dims: int) -> Optional[int]:
    """The physical tensor's dimension for dimension ``dim`` of a sample's ``dims``-dimensional tensor; None where
    ``dim`` is outside ``[-dims, dims)`` (the layer's own call then gives PyTorch's error)."""
    return dim % dims + 1 if -dims <= dim < dims else None


def _flatten_in_run(layer: nn.Flatten, x: Tensor, parameters: tuple[()]) -> Optional[Tensor]:
    """``layer`` on ``x``: the same dimensions flattened, one further on (the replicas' comes first)."""
    start, end = _replica_dim(layer.start_dim, x.dim() - 1), _replica_dim(layer.end_dim, x.dim() - 1)
    return None if start is None or end is None or start > end else x.flatten(start, end)


def _unflatten_in_run(layer: nn.Unflatten, x: Tensor, parameters: tuple[()]) -> Optional[Tensor]:
    """``layer`` on ``x``: the same dimension unflattened, one further on (the replicas' comes first)."""
    dim, sizes = _replica_dim(layer.dim, x.dim() - 1), layer.unflattened_size
    if dim is None or not all(type(size) is int for size in sizes):  # (a named shape: the layer's own call)
        return None
    known = math.prod(size for size in sizes if size != -1)
    if -1 in sizes:
        fits = list(sizes).count(-1) == 1 and known > 0 and x.shape[dim] % known == 0
    else:
        fits = x.shape[dim] == known
    return x.unflatten(dim, sizes) if fits else None


def _elementwise_in_run(layer: nn.Module, x: Tensor, parameters: tuple[()]) -> Tensor:
    """``layer``'s own forward, on ``x`` as it is: it acts on each element alone."""
    return type(layer).forward(layer, x)


def _no_parameters(layer: nn.Module, level: int) -> tuple[()]:
    """The parameters of a layer that has none."""
    return ()


class _RunForm(NamedTuple):
    """A layer type's form over the replicas (see above)."""

    prepare: Callable[[Any, int], Optional[tuple[Any, ...]]]
    compute: Callable[[Any, Tensor, Any], Optional[Tensor]]
    calls: Optional[tuple[Any, str]] = None  #: the function the layer's own forward calls, as (namespace, name)
    #: Whether the layer acts on each element alone (its output keeps its input's memory layout).
    elementwise: bool = False
    #: Whether ``compute`` reads its input in any layout and gives a convolution's product, seen transposed (which
    #: :func:`_run` hands on as it is only to another such layer).
    transposed_product: bool = False


#: The layers that take part in runs, by exact type.
_IN_RUN: dict[type, _RunForm] = {
    nn.Conv1d: _RunForm(_prepare_conv1d, _conv1d_in_run, (F, "conv1d"), transposed_product=True),
    nn.Linear: _RunForm(_prepare_linear, _linear_in_run, (F, "linear")),
    nn.Flatten: _RunForm(_no_parameters, _flatten_in_run),
    nn.Unflatten: _RunForm(_no_parameters, _unflatten_in_run),
    nn.Identity: _RunForm(_no_parameters, _elementwise_in_run, elementwise=True),
    **{
        elementwise: _RunForm(_no_parameters, _elementwise_in_run, calls, elementwise=True)
        for elementwise, calls in (
            (nn.ReLU, (F, "relu")),
            (nn.ReLU6, (F, "hardtanh")),
            (nn.LeakyReLU, (F, "leaky_relu")),
            (nn.ELU, (F, "elu")),
            (nn.GELU, (F, "gelu")),
            (nn.SiLU, (F, "silu")),
            (nn.Mish, (F, "mish")),
            (nn.Tanh, (torch, "tanh")),
            (nn.Sigmoid, (torch, "sigmoid")),
            (nn.Hardtanh, (F, "hardtanh")),
            (nn.Hardswish, (F, "hardswish")),
            (nn.Hardsigmoid, (F, "hardsigmoid")),
            (nn.Softplus, (F, "softplus")),
        )
    },
}

#: The forwards of :data:`_IN_RUN`'s types as PyTorch defines them (:func:`_torchs_own`), and the functions they call.
_OWN_FORWARD: dict[type, Callable[..., Any]] = {kind: kind.forward for kind in _IN_RUN if _torchs_own(kind.forward)}
_OWN_CALLED: dict[type, Optional[Callable[..., Any]]] = {
    kind: function if _torchs_own(function := getattr(*form.calls)) else None
    for kind, form in _IN_RUN.items()
    if form.calls is not None
}


def _calls_own(kind: type) -> bool:
    """Whether the function that ``kind``'s own forward calls is PyTorch's (where it is replaced, by a profiler or a
    FLOP counter, the layer runs as itself and calls the replacement)."""
    form = _IN_RUN[kind]
    return form.calls is None or (_OWN_CALLED[kind] is not None and getattr(*form.calls) is _OWN_CALLED[kind])


def _runs_over_replicas(layer: nn.Module) -> bool:
    """Whether ``layer`` can take part in a run: one of :data:`_IN_RUN`'s types, its forward and the function that
    calls not replaced (on the layer, its class or ``torch.nn.functional``), and no hooks of its own (a run calls no
    hooks)."""
    return (
        type(layer) in _IN_RUN
        and type(layer).forward is _OWN_FORWARD.get(type(layer))
        and _calls_own(type(layer))
        and "forward" not in vars(layer)
        and not (layer._forward_hooks or layer._forward_pre_hooks or layer._backward_hooks or layer._backward_pre_hooks)
    )


def global_module_hooks() -> bool:
    """Whether hooks are registered for every module (``nn.modules.module.register_module_forward_hook`` and the
    like): a run calls none, so none runs while there are any."""
    hooks = torch.nn.modules.module
    return bool(
        hooks._global_forward_hooks
        or hooks._global_forward_pre_hooks
        or hooks._global_backward_hooks
        or hooks._global_backward_pre_hooks
    )


def _run(layers: Sequence[nn.Module], x: Any) -> Optional[tuple[Tensor, int]]:
    """The run that starts with ``layers[0]``, on ``x``: ``(its output, the number of layers it took)``; None where
    it takes none. It takes the longest prefix of ``layers`` whose forms apply, computed on the physical tensor
    (:func:`_vmap_popped`)."""
    batched = _batched_by_innermost_vmap(x) if isinstance(x, Tensor) else None
    if batched is None:
        return None
    level, physical = batched
    prepared = []
    for layer in layers:
        form = _IN_RUN[type(layer)] if _runs_over_replicas(layer) else None
        parameters = None if form is None else form.prepare(layer, level)
        if form is None or parameters is None:
            break
        prepared.append((layer, form, parameters))
    if not prepared:
        return None
    taken, transposed = 0, False  # (transposed: ``physical`` is a convolution's product, seen transposed)
    with _vmap_popped():
        for index, (layer, form, parameters) in enumerate(prepared):
            out = form.compute(layer, physical, parameters)
            if out is None:
                break
            physical, taken = out, taken + 1
            if form.transposed_product:
                transposed = _convolution_reads_next(prepared[index + 1 :])
                physical = physical if transposed else physical.contiguous()
        if transposed:  # (a layer that refused its form ends the run: it runs as itself, on what its own call gives)
            physical = physical.contiguous()
    return None if taken == 0 else (_functorch._add_batch_dim(physical, 0, level), taken)


def _convolution_reads_next(layers: Sequence[tuple[nn.Module, _RunForm, Any]]) -> bool:
    """Whether the first of a run's ``layers`` that is not element-wise is a convolution: it reads the last one's
    product as it lies in memory; any other layer, and what leaves the run, gets it contiguous, as the layers' own
    calls give it (the tensors a user's ``.view()`` or in-place edit meets are then the ones autograd saved)."""
    following = next((form for _, form, _ in layers if not form.elementwise), None)
    return following is not None and following.transposed_product


#: ``nn.Sequential.forward`` as PyTorch defines it (:func:`_torchs_own`).
_OWN_SEQUENTIAL_FORWARD = nn.Sequential.forward if _torchs_own(nn.Sequential.forward) else None


def _fused_sequential(sequential: nn.Sequential, *args: Any, **kwargs: Any) -> Any:
    """``nn.Sequential.forward``, with each run of consecutive layers that have a form over the replicas computed on
    ``vmap``'s physical ``(k, ...)`` tensor (:func:`_run`): the run's input is unwrapped once and its output wrapped
    once. A run starts where its input is batched directly by the innermost ``vmap`` (as for
    :func:`_fused_conv1d`), outside autocast, while no global module hooks are set and while ``nn.Sequential.forward``
    is PyTorch's own."""
    input = args[0] if len(args) == 1 and not kwargs else kwargs.get("input") if not args and len(kwargs) == 1 else None
    if (
        not isinstance(input, Tensor)
        or nn.Sequential.forward is not _OWN_SEQUENTIAL_FORWARD  # (replaced on the class: the replacement runs)
        or torch.is_autocast_enabled(input.device.type)
        or global_module_hooks()
    ):
        return nn.Sequential.forward(sequential, *args, **kwargs)  # (with PyTorch's own error for other arguments)
    layers, x, index = list(sequential), input, 0
    while index < len(layers):
        ran = _run(layers[index:], x)
        if ran is None:
            x, index = layers[index](x), index + 1
        else:
            x, taken = ran
            index += taken
    return x


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
        with _vmap_popped():
            losses = cross_entropy_over_replicas(scores, targets, ignore_index, reduction)
        return _functorch._add_batch_dim(losses, 0, level)
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
        with _vmap_popped():
            losses = nll_loss_over_replicas(scores, targets, ignore_index, reduction)
        return _functorch._add_batch_dim(losses, 0, level)
    return _OWN["nll_loss"](input, target, weight, size_average, ignore_index, reduce, reduction)


#: The fused forms, by the name of the function of ``torch.nn.functional`` they stand in for.
_FUSED: dict[str, Callable[..., Tensor]] = {"cross_entropy": _fused_cross_entropy, "nll_loss": _fused_nll_loss}


def _plain_case(layer: nn.Conv1d) -> bool:
    """``groups=1``, ``dilation=1``, zero padding given as a non-negative number and a positive stride: the
    convolution :func:`conv1d_over_replicas` computes; and PyTorch's own ``_conv_forward`` and ``F.conv1d``, where
    those would run."""
    return (
        layer.groups == 1
        and tuple(layer.dilation) == (1,)
        and layer.padding_mode == "zeros"
        and not isinstance(layer.padding, str)
        and int(layer.padding[0]) >= 0  # (F.conv1d's own error otherwise, as for the stride)
        and int(layer.stride[0]) > 0
        and type(layer)._conv_forward is _OWN_CONV_FORWARD  # (replaced on the class: the replacement runs)
        and _calls_own(nn.Conv1d)  # (F.conv1d, which that calls; idem)
    )


#: ``nn.Conv1d._conv_forward`` as PyTorch defines it (:func:`_torchs_own`).
_OWN_CONV_FORWARD = nn.Conv1d._conv_forward if _torchs_own(nn.Conv1d._conv_forward) else None


def _fusable(layer: nn.Module) -> bool:
    """A ``Conv1d`` in the plain case, whose ``_conv_forward`` nobody has replaced; or an ``nn.Sequential`` (not a
    subclass) whose ``forward`` nobody has replaced, with a layer of a type that can take part in a run."""
    if type(layer) is nn.Sequential:
        return "forward" not in vars(layer) and any(type(child) in _IN_RUN for child in layer)
    return (
        isinstance(layer, nn.Conv1d)
        and type(layer)._conv_forward is _OWN_CONV_FORWARD
        and "_conv_forward" not in vars(layer)
        and _plain_case(layer)
    )


def _fused_form(layer: nn.Module) -> tuple[str, Callable[..., Any]]:
    """The method that :func:`fused_layers` replaces on ``layer``, and the fused form it puts there."""
    return ("forward", _fused_sequential) if isinstance(layer, nn.Sequential) else ("_conv_forward", _fused_conv1d)


def fuses_on(device: torch.device) -> bool:
    """Whether :func:`fused_layers` fuses anything on ``device``: on CPU, with the functorch functions."""
    return _AVAILABLE and device.type == "cpu"


def fusable_layers(module: nn.Module, device: torch.device) -> list[nn.Module]:
    """The layers of ``module`` that :func:`fused_layers` fuses on ``device``: the plain-case ``nn.Conv1d`` layers and
    the ``nn.Sequential`` containers with runs (none where :func:`fuses_on` says no)."""
    return [m for m in module.modules() if _fusable(m)] if fuses_on(device) else []


@contextmanager
def fused_layers(layers: Sequence[nn.Module], losses: bool = False) -> Iterator[None]:
    """While active, ``layers`` (from :func:`fusable_layers`) take their fused forms: a ``Conv1d`` runs as
    :func:`conv1d_over_replicas` when ``vmap`` batches its weights over the replicas, an ``nn.Sequential`` computes
    its runs over the replicas (:func:`_fused_sequential`), each as itself otherwise; with ``losses``,
    ``torch.nn.functional.cross_entropy`` and ``nll_loss`` are their fused forms (each unless someone else's function
    was there). A layer whose method someone else has replaced since :func:`fusable_layers` found it keeps theirs.
    Restored on exit, however it ends (unless someone else replaced one meanwhile: theirs stays)."""
    fused: list[nn.Module] = []  # (a method set since fusable_layers found the layer is someone else's: not these)
    replaced = [  # (never someone else's)
        name for name in _FUSED if losses and getattr(F, name) is _OWN[name] and _torchs_own(_OWN[name])
    ]
    try:
        for layer in layers:
            name, form = _fused_form(layer)
            if name not in vars(layer):
                setattr(layer, name, form.__get__(layer))
                fused.append(layer)
        for name in replaced:
            setattr(F, name, _FUSED[name])
        yield
    finally:
        for name in replaced:
            if getattr(F, name) is _FUSED[name]:  # (a replacement made meanwhile stays)
                setattr(F, name, _OWN[name])
        for layer in fused:
            name, form = _fused_form(layer)
            if getattr(vars(layer).get(name), "__func__", None) is form:  # (one set meanwhile stays)
                delattr(layer, name)
