"""lean_vmap: torch.func.vmap's values, random draws, gradients and errors for the fused engine's call."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import lightning_crossbow.lean_vmap as lean
from lightning_crossbow.lean_vmap import lean_vmap

K = 3
Pair = namedtuple("Pair", ["tensor", "note"])  # (a container that torch's pytree walks)


def step(params: dict[str, Tensor], buffers: dict[str, Tensor], batch: tuple[Any, ...]) -> Any:
    """A replica's work: a linear map with dropout, a buffer read, a constant output and nested outputs."""
    x, tag, nothing, (y,), pair = batch
    assert tag == "tag" and nothing is None and pair.note == "note" and x.dim() == 2  # (the replicas' dim is gone)
    hidden = F.dropout(x @ params["weight"].T + params["bias"], p=0.5, training=True)
    loss = ((hidden - y) ** 2).mean() + buffers["scale"].sum() + pair.tensor.sum()
    return loss, {"hidden": hidden, "constant": torch.ones(2)}, [Pair(loss * 2, torch.zeros(1))]


def arguments(requires_grad: bool = False) -> tuple[Any, ...]:
    generator = torch.Generator().manual_seed(0)
    params = {
        "weight": torch.randn(K, 4, 5, generator=generator, requires_grad=requires_grad),
        "bias": torch.randn(K, 4, generator=generator, requires_grad=requires_grad),
    }
    buffers = {"scale": torch.rand(K, 2, generator=generator)}
    batch = (
        torch.randn(K, 6, 5, generator=generator),
        "tag",
        None,
        [torch.randn(K, 6, 4, generator=generator)],
        Pair(torch.randn(K, 2, generator=generator), "note"),
    )
    return params, buffers, batch


def torch_func_vmap(*args: Any) -> Any:
    in_dims = ({"weight": 0, "bias": 0}, {"scale": 0}, (0, None, None, [0], Pair(0, None)))
    return torch.func.vmap(step, in_dims=in_dims, randomness="different")(*args)


@pytest.mark.parametrize("available", [True, False], ids=["functorch primitives", "torch.func.vmap fallback"])
def test_values_random_draws_and_gradients_are_torch_func_vmaps(available: bool, monkeypatch: Any) -> None:
    monkeypatch.setattr(lean, "_AVAILABLE", available and lean._AVAILABLE)
    results = []
    for call in (torch_func_vmap, lambda *args: lean_vmap(step, K, *args)):
        params, buffers, batch = arguments(requires_grad=True)
        torch.manual_seed(1)
        loss, extras, (pair,) = call(params, buffers, batch)
        gradients = torch.autograd.grad(loss.sum() + extras["hidden"].sum(), list(params.values()))
        assert type(pair) is Pair
        results.append((loss, extras["hidden"], extras["constant"], *pair, *gradients))
    assert results[1][2].shape == (K, 2) and results[1][4].shape == (K, 1)  # (shared outputs: one per replica)
    for expected, got in zip(*results):
        assert torch.equal(expected, got)
    assert not torch.equal(results[1][1][0], results[1][1][1])  # ("different": each replica its own dropout)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("no tensor", None), "at least one argument must be a tensor"),
        ((torch.zeros(K + 1, 2),), "hold the 3 replicas on its dimension 0; got one of shape (4, 2)"),
        ((torch.zeros(K, 2), torch.tensor(1.0)), "got one of shape ()"),
    ],
    ids=["no tensor", "another count", "no dimension"],
)
def test_arguments_that_do_not_hold_the_replicas_are_refused(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        lean_vmap(lambda *a: torch.zeros(()), K, *args)
    assert torch._C._functorch.maybe_current_level() is None


@pytest.mark.parametrize(
    ("func", "error", "message"),
    [
        (lambda x: (x.sum(), "text"), ValueError, "must return only tensors, got type <class 'str'>"),
        (lambda x: x.view(-1, 7), RuntimeError, "invalid for input of size"),
    ],
    ids=["not a tensor", "raised inside"],
)
def test_an_error_leaves_no_vmap_level_behind(func: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        lean_vmap(func, K, torch.zeros(K, 2))
    assert torch._C._functorch.maybe_current_level() is None
    assert torch.equal(lean_vmap(lambda x: x * 2, K, torch.ones(K, 2)), torch.full((K, 2), 2.0))
