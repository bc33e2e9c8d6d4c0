"""``torch.func.vmap`` for the fused engine's one call a step, without the per-call work of its Python wrapper.

The fused engine runs the user's ``training_step`` once a step under ``vmap``, with every tensor of its arguments
batched over the replicas on dimension 0 and every output a tensor, batched the same way. On each call
``torch.func.vmap`` builds its wrapper, flattens the arguments and broadcasts ``in_dims`` over them, wraps each
tensor, then flattens the outputs and broadcasts ``out_dims`` over them, through its Python layers: 0.13 ms a call
for the engine's arguments with the MNIST-1D CNN (8 parameter tensors, a batch of two), against 0.02 ms for the same
wrapping done directly (2 CPU threads). :func:`lean_vmap` does the one call with the functions of
``torch._C._functorch`` that ``torch.func.vmap`` itself ends in (as :mod:`~lightning_crossbow.fused_layers` uses
them), walking dicts, tuples and lists itself (``torch.utils._pytree`` walks any other container), and is
``torch.func.vmap`` where a PyTorch release lacks those functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

_functorch: Any = getattr(torch._C, "_functorch", None)
try:  # (loads the rules that vmap implements as decompositions, once; torch.func.vmap calls it on every call)
    from torch._functorch.vmap import lazy_load_decompositions as _load_decompositions
except ImportError:  # pragma: no cover - a PyTorch release without it takes torch.func.vmap
    _load_decompositions = None

_AVAILABLE = (
    _functorch is not None
    and _load_decompositions is not None
    and all(
        hasattr(_functorch, name)
        for name in ("_vmap_increment_nesting", "_vmap_decrement_nesting", "_add_batch_dim", "_remove_batch_dim")
    )
)


def lean_vmap(func: Callable[..., Any], num_replicas: int, *args: Any) -> Any:
    """``torch.func.vmap(func, in_dims, out_dims=0, randomness="different")(*args)``, with ``in_dims`` 0 for every
    tensor in ``args`` (a pytree) and None for everything else: each tensor's dimension 0 holds the ``num_replicas``
    replicas; every output must be a tensor, and comes back with the replicas on its dimension 0 (expanded where
    ``func`` returned it unbatched, as ``vmap`` does). ValueError where ``vmap`` raises one (in words of its own): no
    tensor to batch, a tensor whose dimension 0 is not ``num_replicas``, an output that is not a tensor."""
    if not _AVAILABLE:
        return _torch_func_vmap(func, *args)
    tensors = 0

    def check(tensor: Tensor) -> Tensor:
        nonlocal tensors
        if tensor.dim() == 0 or tensor.shape[0] != num_replicas:
            raise ValueError(
                f"lean_vmap: every tensor argument must hold the {num_replicas} replicas on its dimension 0; got one"
                f" of shape {tuple(tensor.shape)}."
            )
        tensors += 1
        return tensor

    _map_tensors(check, args, lambda leaf: leaf)
    if not tensors:
        raise ValueError("lean_vmap: at least one argument must be a tensor to batch over the replicas.")
    _load_decompositions()
    level = _functorch._vmap_increment_nesting(num_replicas, "different")
    try:
        inputs = _map_tensors(lambda tensor: _functorch._add_batch_dim(tensor, 0, level), args, lambda leaf: leaf)
        return _map_tensors(
            lambda tensor: _functorch._remove_batch_dim(tensor, level, num_replicas, 0), func(*inputs), _not_a_tensor
        )
    finally:
        _functorch._vmap_decrement_nesting()


def _map_tensors(on_tensor: Callable[[Tensor], Any], tree: Any, on_other: Callable[[Any], Any]) -> Any:
    """``tree`` (a pytree) with ``on_tensor`` applied to its tensors and ``on_other`` to its other leaves. Dicts,
    tuples and lists (of exactly those types: the engine's arguments and outputs) are walked here; every other
    container through ``torch.utils._pytree``, as ``vmap`` walks them all."""
    if isinstance(tree, Tensor):
        return on_tensor(tree)
    kind = type(tree)
    if kind is dict:
        return {key: _map_tensors(on_tensor, value, on_other) for key, value in tree.items()}
    if kind is tuple or kind is list:
        return kind(_map_tensors(on_tensor, value, on_other) for value in tree)
    leaves, spec = tree_flatten(tree)
    if spec.num_leaves == 1 and leaves[0] is tree:  # a leaf
        return on_other(tree)
    return tree_unflatten([_map_tensors(on_tensor, leaf, on_other) for leaf in leaves], spec)


def _not_a_tensor(leaf: Any) -> Any:
    raise ValueError(f"lean_vmap: the function must return only tensors, got type {type(leaf)}.")


def _torch_func_vmap(func: Callable[..., Any], *args: Any) -> Any:
    """:func:`lean_vmap` through ``torch.func.vmap`` itself."""
    flat, spec = tree_flatten(args)
    in_dims = tree_unflatten([0 if isinstance(leaf, Tensor) else None for leaf in flat], spec)
    return torch.func.vmap(func, in_dims=in_dims, randomness="different")(*args)
