"""Synchronous model averaging (SMA), Crossbow's rule, as pure functions over flat buffers.

Notation: ``W`` is a ``(k, N)`` buffer whose row ``j`` holds the flattened weights ``w_j`` of one
local learner, ``z`` the ``(N,)`` central model, ``z_prev`` its value one step earlier, ``alpha``
the correction strength and ``mu`` the central momentum. One SMA step over ``K`` learners in all
(``k`` per process):

.. math::

    c_j &= \\alpha (w_j - z)                       && \\text{(from the weights before the local step)} \\\\
    w_j &\\leftarrow \\mathrm{local\\_step}(w_j) - c_j \\\\
    z_{next} &= z + \\sum_{j=1}^{K} c_j + \\mu (z - z_{prev})

The sum is a sum, not a mean: with ``alpha = 1/K`` and ``mu = 0``, ``z_next`` is the mean of the
pre-step replicas. Every function works on whole flat buffers, so one step costs a handful of
kernels whatever the number of parameter tensors, and the cross-process reduction
(:func:`lightning_crossbow.collectives.all_reduce_sum_`) is one all-reduce per buffer.
"""

from __future__ import annotations

import torch
from torch import Tensor


def default_alpha(num_learners: int) -> float:
    """Crossbow's default correction strength, ``alpha = 1/K`` for ``K`` learners in all."""
    if num_learners < 1:
        raise ValueError(f"The number of learners must be positive, got {num_learners}.")
    return 1.0 / num_learners


def corrections_(out: Tensor, replicas: Tensor, center: Tensor, alpha: float) -> Tensor:
    """``out[j] = alpha * (replicas[j] - center)`` for every row ``j``; returns ``out``."""
    torch.sub(replicas, center, out=out)
    return out.mul_(alpha)


def apply_corrections_(replicas: Tensor, corrections: Tensor) -> Tensor:
    """``w_j <- w_j - c_j`` for every row ``j``, in place; returns ``replicas``."""
    return replicas.sub_(corrections)


def update_center_(center: Tensor, center_prev: Tensor, correction_sum: Tensor, momentum: float) -> None:
    """``z <- z + sum_j c_j + mu * (z - z_prev)`` and ``z_prev <- z`` (old value), in place."""
    if momentum == 0.0:
        center_prev.copy_(center)
        center.add_(correction_sum)
        return
    velocity = center - center_prev
    center_prev.copy_(center)
    center.add_(correction_sum).add_(velocity, alpha=momentum)
