r"""Forms of ``torch.nn.functional`` operations whose ``vmap`` batching rule is wrong for the replicas.

**Embedding with** ``padding_idx``. With each replica's own indices, PyTorch's batching rule keeps the padding row's
gradient at zero for the first replica only, and the others train it (padding-row gradients ``[0, 12, 8]`` for
three replicas, in a check against a loop over them). The form here looks the rows up without ``padding_idx`` and
takes the padding positions out of the graph:

.. math::

    y_j[i] = \begin{cases} \mathrm{sg}(W_j[x_j[i]]) & x_j[i] = p \\ W_j[x_j[i]] & \text{otherwise} \end{cases}

(``sg``: stop-gradient): each replica's ``F.embedding(x_j, W_j, padding_idx=p)``, values and gradients. A weight
renormalised by ``max_norm`` is renormalised as by PyTorch's own function, which does not spare the padding row.

**Embedding with** ``sparse=True``. Sparse gradients cannot be batched, and PyTorch says so only in the backward,
after the step has run: the form here raises in the forward, where ``engine="auto"`` can still fall back.

While the fused engine runs (:func:`corrected_under_vmap`), on every device, ``torch.nn.functional.embedding``
(which ``nn.Embedding`` calls) is this form; calls whose weight ``vmap`` does not batch or that has no gradient (a
frozen embedding, a buffer, calls outside the replicas' step) pass to PyTorch's own function unchanged. Code that
bound the function before the step (``from torch.nn.functional import embedding``) keeps ``vmap``'s rule.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

_own_embedding = F.embedding


def _batched_and_trained(tensor: Tensor) -> bool:
    """Whether ``vmap`` batches ``tensor`` (the replicas' stacked weights, inside their step) and a gradient reaches
    it: the tensor under the transforms' wrappers requires one, or a transform that differentiates wraps it. (A
    buffer, say a fixed lookup table, is batched too, but has no gradient to get wrong.)"""
    functorch = torch._C._functorch
    if not functorch.is_batchedtensor(tensor):
        return False
    while functorch.is_functorch_wrapped_tensor(tensor):
        if not functorch.is_batchedtensor(tensor):
            return True  # (the wrapper of a grad or jvp transform)
        tensor = functorch.get_unwrapped(tensor)
    return tensor.requires_grad


def embedding_over_replicas(
    input: Tensor,
    weight: Tensor,
    padding_idx: Optional[int] = None,
    max_norm: Optional[float] = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> Tensor:
    """``F.embedding``, right for every replica when ``vmap`` batches a trained ``weight``: the padding positions'
    rows detached rather than ``padding_idx`` given to ``vmap``'s rule; ``sparse=True`` refused."""
    if not _batched_and_trained(weight):
        return _own_embedding(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
    if sparse:
        raise RuntimeError(
            "F.embedding(sparse=True) on the replicas' weights: vmap cannot batch sparse gradients (PyTorch says so"
            " only in the backward, after the step); engine='sequential' runs it"
        )
    rows = weight.shape[0]
    if padding_idx is None or not -rows <= padding_idx < rows:  # (out of range: PyTorch's own error)
        return _own_embedding(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
    looked_up = _own_embedding(input, weight, None, max_norm, norm_type, scale_grad_by_freq, sparse)
    padding = (input == padding_idx % rows).unsqueeze(-1)
    return torch.where(padding, looked_up.detach(), looked_up)


@contextmanager
def corrected_under_vmap() -> Iterator[None]:
    """While active, ``torch.nn.functional.embedding`` is :func:`embedding_over_replicas` (unless someone else's
    function was there). Restored on exit, however it ends (unless someone else replaced it meanwhile: theirs
    stays)."""
    replaced = F.embedding is _own_embedding
    if replaced:
        F.embedding = embedding_over_replicas
    try:
        yield
    finally:
        if replaced and F.embedding is embedding_over_replicas:
            F.embedding = _own_embedding
