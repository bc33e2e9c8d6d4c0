"""The corrected embedding: under vmap, each replica's own ``F.embedding`` (values and gradients); outside, PyTorch's
own function; restored afterwards."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.func import vmap

from lightning_crossbow import vmap_corrections as vc


def _replicas_and_indices() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(3, 6, 4, generator=generator, dtype=torch.float64)
    indices = torch.tensor([[0, 1, 0, 2], [0, 3, 0, 0], [1, 5, 5, 4]])  # replica 2 pads with 5 (= -1)
    return weights, indices


@pytest.mark.parametrize(
    "options", [dict(padding_idx=0), dict(padding_idx=-1), dict(padding_idx=5, max_norm=0.5), dict()]
)
def test_under_vmap_each_replica_gets_its_own_embedding_values_and_gradients(options: dict[str, Any]) -> None:
    weights, indices = _replicas_and_indices()
    scale = torch.arange(1.0, 5.0, dtype=torch.float64)  # (a loss that weighs each coordinate differently)

    def loss(weight: torch.Tensor, index: torch.Tensor, embedding: Any) -> torch.Tensor:
        return (embedding(index, weight, **options) * scale).sum()

    fused = weights.clone().requires_grad_()
    with vc.corrected_under_vmap():
        vmap(loss, in_dims=(0, 0, None))(fused, indices, nn.functional.embedding).sum().backward()
    looped = weights.clone().requires_grad_()
    sum(loss(looped[j], indices[j], nn.functional.embedding) for j in range(3)).backward()
    torch.testing.assert_close(fused, looped, rtol=0, atol=0)  # (max_norm renormalises the same rows in place)
    torch.testing.assert_close(fused.grad, looped.grad, rtol=0, atol=0)
    if "padding_idx" in options:
        assert not looped.grad[:, options["padding_idx"]].any()
        uncorrected = weights.clone().requires_grad_()
        vmap(loss, in_dims=(0, 0, None))(uncorrected, indices, vc._own_embedding).sum().backward()
        assert uncorrected.grad[:, options["padding_idx"]].any()  # what the correction is for: vmap's own rule


def test_outside_vmap_and_for_an_unbatched_weight_it_is_pytorchs_own_function(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(vc, "_own_embedding", lambda *args: calls.append(args) or nn.functional.embedding(*args))
    weights, indices = _replicas_and_indices()
    vc.embedding_over_replicas(indices[0], weights[0], 0)
    vmap(lambda index: vc.embedding_over_replicas(index, weights[0], 0))(indices)  # (a frozen, shared weight)
    assert [args[2] for args in calls] == [0, 0]  # padding_idx passed on as it was


def test_a_sparse_embedding_is_refused_in_the_forward_and_an_out_of_range_padding_gets_pytorchs_error() -> None:
    weights, indices = _replicas_and_indices()
    trained = weights.clone().requires_grad_()
    with pytest.raises(RuntimeError, match=r"F.embedding\(sparse=True\) on the replicas' weights: vmap cannot"):
        vmap(lambda w, i: vc.embedding_over_replicas(i, w, sparse=True))(trained, indices)
    # A table without a gradient (a buffer, batched with the replicas' other buffers) is PyTorch's own call:
    looked_up = vmap(lambda w, i: vc.embedding_over_replicas(i, w, padding_idx=0, sparse=True))(weights, indices)
    torch.testing.assert_close(looked_up, torch.stack([weights[j][indices[j]] for j in range(3)]), rtol=0, atol=0)
    with pytest.raises(AssertionError, match="Padding_idx must be within num_embeddings"):
        vmap(lambda w, i: vc.embedding_over_replicas(i, w, padding_idx=6))(weights, indices)


def test_the_correction_is_undone_on_exit_but_never_someone_elses_function() -> None:
    own = nn.functional.embedding
    with pytest.raises(ValueError), vc.corrected_under_vmap():
        assert nn.functional.embedding is vc.embedding_over_replicas
        raise ValueError
    assert nn.functional.embedding is own

    def theirs(*args: Any, **kwargs: Any) -> torch.Tensor:
        return own(*args, **kwargs)

    try:
        nn.functional.embedding = theirs
        with vc.corrected_under_vmap():
            assert nn.functional.embedding is theirs  # someone else's function is left in place
        assert nn.functional.embedding is theirs
        nn.functional.embedding = own
        with vc.corrected_under_vmap():
            nn.functional.embedding = theirs  # replaced meanwhile: theirs stays
        assert nn.functional.embedding is theirs
    finally:
        nn.functional.embedding = own
