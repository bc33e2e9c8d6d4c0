"""The fused Conv1d and losses: the same values as vmap's own rules, taken only where they apply, and restored
afterwards."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader, TensorDataset

from lightning_crossbow import CrossbowStrategy
from lightning_crossbow import fused_layers as fl
from tests.helpers import ReplicaSnapshot, trainer

CPU = torch.device("cpu")


def _shapes_reaching(monkeypatch: pytest.MonkeyPatch, *functions: str) -> list[tuple[int, ...]]:
    """The shapes of the first argument of every call that reaches one of ``fl.<functions>`` from now on."""
    calls: list[tuple[int, ...]] = []
    for function in functions:

        def counted(input: Tensor, *args: Any, original: Any = getattr(fl, function), **kwargs: Any) -> Tensor:
            calls.append(tuple(input.shape))
            return original(input, *args, **kwargs)

        monkeypatch.setattr(fl, function, counted)
    return calls


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The input shapes that reached the fused convolution."""
    return _shapes_reaching(monkeypatch, "conv1d_over_replicas")


@pytest.mark.parametrize(
    ("channels", "taps", "stride", "padding", "bias"),
    [(1, 3, 1, 0, True), (3, 3, 2, 1, True), (4, 3, 3, 2, False), (2, 21, 2, 2, True)],
    ids=["stride 1", "stride 2", "stride 3, a remainder", "one output per row"],
)
@pytest.mark.parametrize("channels_innermost", [False, True], ids=["(n, c, L) data", "(n, L, c) data transposed"])
def test_conv1d_over_replicas_is_each_replicas_own_convolution_and_gradient(
    channels: int, taps: int, stride: int, padding: int, bias: bool, channels_innermost: bool
) -> None:
    """Also for an input whose channels are innermost in memory (``x.transpose(1, 2)`` of ``(n, L, c)`` data), whose
    columns, stacked in that layout, raised "view size is not compatible" (and engine="auto" fell back to sequential
    for good)."""
    torch.manual_seed(0)
    k, n, out_channels, length = 3, 5, 6, 17
    if channels_innermost:
        x = torch.randn(k, n, length, channels).transpose(2, 3).requires_grad_()
    else:
        x = torch.randn(k, n, channels, length, requires_grad=True)
    w = torch.randn(k, out_channels, channels, taps, requires_grad=True)
    b = torch.randn(k, out_channels, requires_grad=True) if bias else None
    out = fl.conv1d_over_replicas(x, w, b, stride, padding)
    out_grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, w] + ([b] if bias else []), out_grad)
    for j in range(k):
        own = [t[j].detach().requires_grad_() for t in [x, w] + ([b] if bias else [])]
        expected = nn.functional.conv1d(*own[:2], own[2] if bias else None, stride=stride, padding=padding)
        torch.testing.assert_close(out[j], expected)
        for fused_grad, expected_grad in zip(got, torch.autograd.grad(expected, own, out_grad[j]), strict=True):
            torch.testing.assert_close(fused_grad[j], expected_grad)
    assert out.is_contiguous()


@pytest.mark.parametrize("shape", [(), (5,), (2, 3), (0,)], ids=["one sample", "rows", "rows of rows", "no rows"])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_over_replicas_is_each_replicas_own_linear_map(shape: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(0)
    k, features, out_features = 3, 4, 6
    x, w = torch.randn(k, *shape, features), torch.randn(k, out_features, features)
    b = torch.randn(k, out_features) if bias else None
    out = fl.linear_over_replicas(x, w, b)
    assert out.shape == (k, *shape, out_features)
    for j in range(k):
        torch.testing.assert_close(out[j], nn.functional.linear(x[j], w[j], None if b is None else b[j]))


@pytest.fixture
def fused_losses(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The score shapes that reached the fused losses (cross-entropy and negative log-likelihood)."""
    return _shapes_reaching(monkeypatch, "cross_entropy_over_replicas", "nll_loss_over_replicas")


#: The losses fused, as ``torch.nn.functional`` names them, and the module form of each.
LOSSES = {"cross_entropy": nn.CrossEntropyLoss, "nll_loss": nn.NLLLoss}


def _scores_for(loss: str, scores: Tensor) -> Tensor:
    """Scores as ``loss`` takes them: logits for cross-entropy, log-probabilities for the negative log-likelihood."""
    return scores if loss == "cross_entropy" else torch.log_softmax(scores, -1)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_an_empty_batch_gives_each_replicas_own_loss(
    name: str, reduction: str, fused_losses: list[tuple[int, ...]]
) -> None:
    scores, targets = torch.randn(3, 0, 4), torch.zeros(3, 0, dtype=torch.long)  # ("mean": nan, "sum": 0)

    def loss(s: Tensor, t: Tensor) -> Tensor:
        return getattr(nn.functional, name)(s, t, reduction=reduction)

    expected = torch.stack([loss(scores[j], targets[j]) for j in range(3)])
    with fl.fused_layers([], losses=True):
        actual = vmap(loss)(scores, targets)
    assert fused_losses == [(3, 0, 4)]
    torch.testing.assert_close(actual, expected, equal_nan=True)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_a_loss_over_replicas_is_each_replicas_own_loss(name: str, reduction: str) -> None:
    torch.manual_seed(0)
    k, n, classes = 4, 6, 5
    scores = _scores_for(name, torch.randn(k, n, classes))
    targets = torch.randint(0, classes, (k, n))
    targets[1, :2] = 7  # some targets ignored...
    targets[3] = 7  # ...and every one of a replica's ("mean": 0/0, as PyTorch's own)
    out = getattr(fl, f"{name}_over_replicas")(scores, targets, 7, reduction)
    for j in range(k):
        expected = getattr(nn.functional, name)(scores[j], targets[j], ignore_index=7, reduction=reduction)
        torch.testing.assert_close(out[j], expected, equal_nan=True)
    if reduction == "mean":
        assert out[3].isnan()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv1d(2, 4, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv1d(4, 4, 3, bias=False),
        nn.Flatten(),
        nn.Linear(20, 3),
    )


def _losses_and_grads(
    net: nn.Module, params: dict[str, Tensor], x: Tensor, y: Tensor, data_dim: int | None = 0
) -> tuple[Tensor, list[Tensor]]:
    def loss(p: dict[str, Tensor], xb: Tensor, yb: Tensor) -> Tensor:
        return nn.functional.cross_entropy(functional_call(net, p, (xb,)), yb)

    losses = vmap(loss, in_dims=(0, data_dim, data_dim))(params, x, y)
    return losses.detach(), list(torch.autograd.grad(losses.sum(), list(params.values())))


@pytest.mark.parametrize("shared_batch", [False, True], ids=["own batches", "one batch for all"])
def test_under_vmap_the_fused_layers_give_vmaps_values_and_gradients(
    shared_batch: bool, fused_calls: list[tuple[int, ...]], fused_losses: list[tuple[int, ...]]
) -> None:
    net, k = _net(), 4
    params = {name: p.detach().expand(k, *p.shape).clone().requires_grad_() for name, p in net.named_parameters()}
    params = {name: p + 0.1 * torch.randn_like(p) for name, p in params.items()}  # replicas that differ
    x, y = torch.randn(k, 5, 2, 13), torch.randint(0, 3, (k, 5))
    if shared_batch:  # not batched over the replicas: the first layer expands it
        x, y = x[0], y[0]
    data_dim = None if shared_batch else 0
    expected = _losses_and_grads(net, params, x, y, data_dim)
    with fl.fused_layers(fl.fusable_layers(net, CPU), losses=True):
        actual = _losses_and_grads(net, params, x, y, data_dim)
    assert fused_calls == [(k, 5, 2, 13), (k, 5, 4, 7)]  # both convolutions took the fused form
    assert fused_losses == [(k, 5, 3)]  # and so did the loss
    torch.testing.assert_close(actual[0], expected[0])
    for a, b in zip(actual[1], expected[1], strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "layer",
    [
        nn.Conv1d(4, 4, 3, groups=2),
        nn.Conv1d(4, 4, 3, dilation=2),
        nn.Conv1d(4, 4, 3, padding="same"),
        nn.Conv1d(4, 4, 3, padding=1, padding_mode="circular"),
    ],
    ids=["groups", "dilation", "same", "circular"],
)
def test_other_convolutions_keep_vmaps_rule(layer: nn.Conv1d, fused_calls: list[tuple[int, ...]]) -> None:
    params = {name: torch.randn(3, *p.shape) for name, p in layer.named_parameters()}
    x = torch.randn(3, 2, 4, 11)
    expected = vmap(lambda p, xb: functional_call(layer, p, (xb,)))(params, x)
    with fl.fused_layers(fl.fusable_layers(layer, CPU)):
        actual = vmap(lambda p, xb: functional_call(layer, p, (xb,)))(params, x)
    assert fused_calls == []
    torch.testing.assert_close(actual, expected)


def _stacked(layer: nn.Module, k: int = 3) -> dict[str, Tensor]:
    torch.manual_seed(1)
    return {name: p.detach() + 0.1 * torch.randn(k, *p.shape) for name, p in layer.named_parameters()}


def test_under_autocast_vmaps_rule_runs_as_without_fusing(fused_calls: list[tuple[int, ...]]) -> None:
    """vmap's rule keeps the convolution in float32 under autocast; so does the fused engine (a BatchNorm after it
    then meets the dtype it expects)."""
    net = nn.Sequential(nn.Conv1d(2, 4, 3, padding=1), nn.BatchNorm1d(4))
    params, buffers = _stacked(net), {name: b.expand(3, *b.shape).clone() for name, b in net.named_buffers()}
    x = torch.randn(3, 5, 2, 11)

    def run() -> Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return vmap(lambda p, bf, xb: functional_call(net, (p, bf), (xb,)))(params, buffers, x)

    expected = run()
    with fl.fused_layers(fl.fusable_layers(net, CPU)):
        actual = run()
    assert fused_calls == []
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected)


def test_a_grad_of_the_users_own_inside_the_step_keeps_vmaps_rule(
    fused_calls: list[tuple[int, ...]], fused_losses: list[tuple[int, ...]]
) -> None:
    """A step that differentiates with torch.func.grad (here: one inner step on the head alone, as in meta-learning)
    runs the convolution and the loss under that transform: not the engine's vmap as the innermost one, so no fusing
    there."""
    net = nn.Sequential(nn.Conv1d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(44, 3))
    params = _stacked(net)
    x, y = torch.randn(3, 5, 2, 11), torch.randint(0, 3, (3, 5))

    def step(p: dict[str, Tensor], xb: Tensor, yb: Tensor) -> Tensor:
        head = {n: v for n, v in p.items() if n.startswith("3.")}

        def inner(h: dict[str, Tensor]) -> Tensor:
            return nn.functional.cross_entropy(functional_call(net, {**p, **h}, (xb,)), yb)

        adapted = {n: v - 0.1 * g for (n, v), g in zip(head.items(), grad(inner)(head).values(), strict=True)}
        return nn.functional.cross_entropy(functional_call(net, {**p, **adapted}, (xb,)), yb)

    expected = vmap(step)(params, x, y)
    with fl.fused_layers(fl.fusable_layers(net, CPU), losses=True):
        actual = vmap(step)(params, x, y)
    assert len(fused_calls) == 1  # the outer forward only (the one under grad keeps vmap's rule)
    assert len(fused_losses) == 1  # idem
    torch.testing.assert_close(actual, expected)


def _scores_and_grads(loss: Any, scores: Tensor, targets: Tensor, target_dim: int | None = 0) -> tuple[Tensor, Tensor]:
    scores = scores.clone().requires_grad_()
    losses = vmap(loss, in_dims=(0, target_dim))(scores, targets)
    return losses.detach(), torch.autograd.grad(losses.sum(), scores)[0]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shared_targets", [False, True], ids=["own targets", "one target batch for all"])
@pytest.mark.parametrize("as_module", [False, True], ids=["function", "module"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_under_vmap_the_fused_losses_give_vmaps_values_and_gradients(
    name: str, reduction: str, shared_targets: bool, as_module: bool, fused_losses: list[tuple[int, ...]]
) -> None:
    torch.manual_seed(0)
    scores, targets = _scores_for(name, torch.randn(3, 6, 4)), torch.randint(0, 4, (3, 6))
    targets[0, 1] = -100  # (ignored, by the default ignore_index)
    if shared_targets:
        targets = targets[0]

    def loss(s: Tensor, t: Tensor) -> Tensor:
        if as_module:
            return LOSSES[name](reduction=reduction)(s, t)
        return getattr(nn.functional, name)(s, t, reduction=reduction)

    target_dim = None if shared_targets else 0
    expected = _scores_and_grads(loss, scores, targets, target_dim)
    with fl.fused_layers([], losses=True):
        actual = _scores_and_grads(loss, scores, targets, target_dim)
    assert fused_losses == [(3, 6, 4)]
    torch.testing.assert_close(actual[0], expected[0])
    torch.testing.assert_close(actual[1], expected[1])


def test_under_autocast_the_fused_cross_entropy_is_each_replicas_own_float32_loss(
    fused_losses: list[tuple[int, ...]],
) -> None:
    """Autocast runs cross-entropy in float32, as plain Lightning (and the sequential engine) computes it; so does the
    fused form. (vmap's own rule returns bfloat16 here: its decomposition runs below autocast's float32 policy.)"""
    torch.manual_seed(0)
    scores, targets = torch.randn(3, 6, 4).bfloat16(), torch.randint(0, 4, (3, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        vmaps_rule = vmap(nn.functional.cross_entropy)(scores, targets)
        expected = torch.stack([nn.functional.cross_entropy(scores[j], targets[j]) for j in range(3)])
        with fl.fused_layers([], losses=True):
            actual = vmap(nn.functional.cross_entropy)(scores, targets)
    assert fused_losses == [(3, 6, 4)]
    assert vmaps_rule.dtype == torch.bfloat16
    assert actual.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(actual, expected)


OTHER_CALLS = {  # id: (the losses that take it, options, scores' shape, targets)
    "class weights": (LOSSES, dict(weight=torch.tensor([1.0, 2.0, 0.5, 1.0])), (6, 4), "indices"),
    "label smoothing": (["cross_entropy"], dict(label_smoothing=0.1), (6, 4), "indices"),
    "legacy reduce": (LOSSES, dict(reduce=False), (6, 4), "indices"),
    "probabilities": (["cross_entropy"], {}, (6, 4), "probabilities"),
    "(n, C, d)": (LOSSES, {}, (6, 4, 2), "indices"),  # scores per position
    "(C,)": (LOSSES, {}, (4,), "indices"),  # one sample
    "int32": (LOSSES, {}, (6, 4), "int32 indices"),
    "bad": (LOSSES, {}, (6, 4, 2), "one index per sample"),  # (PyTorch's error: (n, d) indices expected)
}


@pytest.mark.parametrize(
    ("name", "options", "scores_shape", "targets_of"),
    [
        pytest.param(name, options, shape, targets_of, id=f"{name}: {call}")
        for call, (names, options, shape, targets_of) in OTHER_CALLS.items()
        for name in names
    ],
)
def test_other_loss_calls_keep_vmaps_rule(
    name: str,
    options: dict[str, Any],
    scores_shape: tuple[int, ...],
    targets_of: str,
    fused_losses: list[tuple[int, ...]],
) -> None:
    torch.manual_seed(0)
    scores = torch.randn(3, *scores_shape)
    target_shape = (3, *scores_shape[:1], *scores_shape[2:]) if len(scores_shape) > 1 else (3,)
    targets: Tensor = torch.randint(0, 4, target_shape)
    if targets_of == "probabilities":
        targets = torch.softmax(torch.randn(3, *scores_shape), -1)
    elif targets_of == "int32 indices":
        targets = targets.int()
    elif targets_of == "one index per sample":
        targets = targets[..., 0]

    def loss(s: Tensor, t: Tensor) -> Tensor:
        return getattr(nn.functional, name)(s, t, **options)

    def run() -> Any:
        try:
            return _scores_and_grads(loss, scores, targets)
        except RuntimeError as error:  # (int32 or misshapen indices: PyTorch's own error, with and without fusing)
            return str(error)

    expected = run()
    with fl.fused_layers([], losses=True):
        actual = run()
    assert fused_losses == []
    if isinstance(expected, str):
        assert actual == expected
    else:
        torch.testing.assert_close(actual, expected)


def test_a_layer_changed_after_it_was_found_and_bad_calls_keep_conv1ds_own_behaviour(
    fused_calls: list[tuple[int, ...]],
) -> None:
    layer = nn.Conv1d(2, 4, 5, padding=1)
    params, x = _stacked(layer), torch.randn(3, 5, 2, 11)

    def run(xb: Tensor) -> Tensor:
        return vmap(lambda p, b: functional_call(layer, p, (b,)))(params, xb)

    with fl.fused_layers(fl.fusable_layers(layer, CPU)):
        layer.padding_mode = "circular"  # (a callback's change) not a plain case any more: vmap's rule
        changed = run(x)
        layer.padding_mode = "zeros"
        with pytest.raises(RuntimeError, match="Kernel size can't be greater than actual input size"):
            run(torch.randn(3, 5, 2, 2))
        with pytest.raises(RuntimeError, match="to have 6 channels, but got 9 channels"):  # (vmap's grouped form)
            run(torch.randn(3, 5, 3, 11))
    assert fused_calls == []
    layer.padding_mode = "circular"
    torch.testing.assert_close(changed, run(x))


def test_calls_outside_vmap_and_shared_weights_run_conv1ds_own_code(fused_calls: list[tuple[int, ...]]) -> None:
    net = _net()
    x = torch.randn(5, 2, 13)
    with torch.no_grad(), fl.fused_layers(fl.fusable_layers(net, CPU)):
        plain = net(x)
        shared = vmap(net)(x.expand(3, *x.shape))  # weights not batched: nothing to fuse
        unbatched_input = net[0](x[0])  # (c, L): one sample
    assert fused_calls == []
    with torch.no_grad():
        torch.testing.assert_close(plain, net(x))
        torch.testing.assert_close(shared[1], net(x))
        torch.testing.assert_close(unbatched_input, net[0](x[0]))


@pytest.mark.parametrize("name", list(LOSSES))
def test_a_loss_outside_vmap_is_pytorchs_own_and_is_restored_on_exit_and_on_error(
    name: str, fused_losses: list[tuple[int, ...]]
) -> None:
    original = getattr(nn.functional, name)
    scores, targets = _scores_for(name, torch.randn(6, 4)), torch.randint(0, 4, (6,))
    with fl.fused_layers([], losses=True):
        assert getattr(nn.functional, name) is not original
        inside = getattr(nn.functional, name)(scores, targets)
    assert getattr(nn.functional, name) is original
    assert fused_losses == []
    torch.testing.assert_close(inside, original(scores, targets), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="boom"), fl.fused_layers([], losses=True):
        raise RuntimeError("boom")
    assert getattr(nn.functional, name) is original
    with fl.fused_layers([]):  # (not asked for)
        assert getattr(nn.functional, name) is original

    def someone_elses(*args: Any, **kwargs: Any) -> Tensor:
        return original(*args, **kwargs)

    try:
        with fl.fused_layers([], losses=True):  # a replacement made meanwhile (a profiler's, say) stays
            setattr(nn.functional, name, someone_elses)
        assert getattr(nn.functional, name) is someone_elses
        with fl.fused_layers([], losses=True):  # and one found in place is left in place, and after
            assert getattr(nn.functional, name) is someone_elses
        assert getattr(nn.functional, name) is someone_elses
    finally:
        setattr(nn.functional, name, original)


def test_the_layers_are_restored_on_exit_and_on_error_and_left_alone_off_cpu() -> None:
    net = _net()
    convolutions = [m for m in net.modules() if isinstance(m, nn.Conv1d)]
    with fl.fused_layers(fl.fusable_layers(net, CPU)):
        assert all("_conv_forward" in vars(m) for m in convolutions) and "forward" in vars(net)
    assert not any("_conv_forward" in vars(m) for m in convolutions) and "forward" not in vars(net)
    with pytest.raises(RuntimeError, match="boom"), fl.fused_layers(fl.fusable_layers(net, CPU)):
        raise RuntimeError("boom")
    assert not any("_conv_forward" in vars(m) for m in convolutions) and "forward" not in vars(net)
    assert fl.fusable_layers(net, torch.device("cuda")) == []  # (nothing runs on it: only the device type is read)
    assert fl.fuses_on(CPU) and not fl.fuses_on(torch.device("cuda"))


def _runs_taken(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of layers each run takes from now on."""
    taken: list[int] = []

    def counted(layers: Any, x: Any, original: Any = fl._run) -> Any:
        ran = original(layers, x)
        if ran is not None:
            taken.append(ran[1])
        return ran

    monkeypatch.setattr(fl, "_run", counted)
    return taken


def _replicas_call(module: nn.Module, params: dict[str, Tensor], x: Tensor) -> Tensor:
    """``module`` called under ``vmap`` with each replica's own ``params`` and ``x``."""
    return vmap(lambda p, xb: functional_call(module, p, (xb,)))(params, x)


def _unfused_then_fused(
    net: nn.Module, params: dict[str, Tensor], x: Tensor, monkeypatch: pytest.MonkeyPatch
) -> tuple[Tensor, Tensor, list[int]]:
    """``net``'s output over the replicas without and with its fused layers, and the runs taken with them."""
    expected = _replicas_call(net, params, x)
    taken = _runs_taken(monkeypatch)
    with fl.fused_layers(fl.fusable_layers(net, CPU)):
        return expected, _replicas_call(net, params, x), taken


def _sequential_with_runs() -> nn.Sequential:
    """Every layer type a run takes, around a LayerNorm, which runs as itself, between two runs."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Unflatten(1, (2, -1)),  # (n, 26) -> (n, 2, 13)
        nn.Conv1d(2, 4, 3, stride=2, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv1d(4, 4, 3, bias=False),
        nn.Flatten(),  # (n, 20)
        nn.LayerNorm(20),
        nn.Linear(20, 16),
        *(kind() for kind in (nn.Identity, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh)),
        *(kind() for kind in (nn.Sigmoid, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus)),
        nn.Unflatten(-1, (4, 4)),
        nn.Flatten(-2, -1),
        nn.Linear(16, 3, bias=False),
    )


def test_a_sequentials_runs_give_vmaps_values_and_gradients_outside_vmaps_dispatch(
    monkeypatch: pytest.MonkeyPatch, fused_losses: list[tuple[int, ...]]
) -> None:
    net, k = _sequential_with_runs(), 4
    params = {name: p.detach() + 0.1 * torch.randn(k, *p.shape) for name, p in net.named_parameters()}
    params = {name: p.requires_grad_() for name, p in params.items()}
    x, y = torch.randn(k, 5, 26), torch.randint(0, 3, (k, 5))
    expected = _losses_and_grads(net, params, x, y)
    taken = _runs_taken(monkeypatch)
    convolutions, linears = _shapes_reaching(monkeypatch, "conv1d_over_replicas"), []
    original_linear = fl.linear_over_replicas

    def linear(input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        linears.append((tuple(input.shape), torch._C._functorch.peek_interpreter_stack() is None))
        return original_linear(input, weight, bias)

    monkeypatch.setattr(fl, "linear_over_replicas", linear)
    with fl.fused_layers(fl.fusable_layers(net, CPU), losses=True):
        actual = _losses_and_grads(net, params, x, y)
    assert taken == [5, 17]  # the LayerNorm between the runs ran as itself
    assert convolutions == [(k, 5, 2, 13), (k, 5, 4, 7)]
    assert linears == [((k, 5, 20), True), ((k, 5, 16), True)]  # computed with vmap's layer off the stack
    assert fused_losses == [(k, 5, 3)]
    torch.testing.assert_close(actual[0], expected[0])
    for a, b in zip(actual[1], expected[1], strict=True):
        torch.testing.assert_close(a, b)
    assert "forward" not in vars(net)


def test_inside_a_run_a_convolution_reads_the_last_ones_layout_and_the_run_hands_on_a_contiguous_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A convolution in a run leaves its output in the product's layout, which the next one (through an element-wise
    layer) reads as it is; what leaves the run is contiguous, as the layers' own calls give it: a ``.view`` works."""
    torch.manual_seed(0)
    net, k = nn.Sequential(nn.Conv1d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv1d(4, 4, 3, stride=2), nn.ReLU()), 3
    params = {name: torch.randn(k, *p.shape, requires_grad=True) for name, p in net.named_parameters()}
    x = torch.randn(k, 5, 2, 13)

    def flattened(p: dict[str, Tensor], xb: Tensor) -> Tensor:
        out = functional_call(net, p, (xb,))
        return out.view(out.shape[0], -1)  # (a view: needs the layers' contiguous output)

    expected = vmap(flattened)(params, x)
    expected_grads = torch.autograd.grad(expected.square().sum(), list(params.values()))
    taken, contiguous_inputs = _runs_taken(monkeypatch), []
    original = fl.conv1d_over_replicas

    def convolution(input: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        contiguous_inputs.append(input.is_contiguous())
        return original(input, *args, **kwargs)

    monkeypatch.setattr(fl, "conv1d_over_replicas", convolution)
    with fl.fused_layers(fl.fusable_layers(net, CPU)):
        actual = vmap(flattened)(params, x)
    assert taken == [4]
    assert contiguous_inputs == [True, False]  # the second reads the first's (k, o, n, L) memory, transposed
    torch.testing.assert_close(actual, expected)
    for got, want in zip(
        torch.autograd.grad(actual.square().sum(), list(params.values())), expected_grads, strict=True
    ):
        torch.testing.assert_close(got, want)

    def edited_in_place(p: dict[str, Tensor], xb: Tensor) -> Tensor:
        return functional_call(net, p, (xb,)).mul_(2)  # the ReLU's output, which its backward reads

    for fused in (False, True):  # autograd's error on both paths: the run hands on the tensor the ReLU saved
        with fl.fused_layers(fl.fusable_layers(net, CPU)) if fused else contextlib.nullcontext():
            edited = vmap(edited_in_place)(params, x)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(edited.sum(), list(params.values()))


class DoubledLinear(nn.Linear):
    def forward(self, input: Tensor) -> Tensor:
        return 2 * super().forward(input)


def test_layers_with_hooks_or_of_other_types_run_as_themselves_and_their_hooks_see_vmaps_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), DoubledLinear(8, 8), nn.Tanh(), nn.Linear(8, 3), nn.ReLU())
    seen: list[tuple[int, ...]] = []
    net[1].register_forward_hook(lambda module, args, out: seen.append(tuple(out.shape)))
    expected, actual, taken = _unfused_then_fused(net, _stacked(net, k=3), torch.randn(3, 5, 6), monkeypatch)
    assert taken == [1, 3]  # Linear; (the hooked ReLU and DoubledLinear as themselves) Tanh, Linear, ReLU
    assert seen == [(5, 8), (5, 8)]  # one sample's shape, as vmap shows it, with and without fusing
    torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize(
    "layer",
    [nn.Flatten(1, 0), nn.Flatten(0, 2), nn.Flatten(-3, -1), nn.Unflatten(1, (4, 4)), nn.Unflatten(-3, (3, -1))],
    ids=["start after end", "end outside", "start outside", "sizes that do not fit", "dimension outside"],
)
def test_a_flatten_or_unflatten_outside_a_samples_dimensions_raises_pytorchs_error(
    layer: nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sample is (4, 6) here: dimension -3 or 2 would name the replicas' dimension of the physical tensor."""
    net = nn.Sequential(nn.Linear(6, 6), layer)
    params, x = _stacked(net, k=3), torch.randn(3, 4, 6)

    def error() -> tuple[type, str]:
        with pytest.raises((RuntimeError, IndexError)) as raised:
            vmap(lambda p, xb: functional_call(net, p, (xb,)))(params, x)
        return type(raised.value), str(raised.value)

    expected = error()
    taken = _runs_taken(monkeypatch)
    with fl.fused_layers(fl.fusable_layers(net, CPU)):
        assert error() == expected
    assert taken == [1]  # the Linear; the layer itself raised


def test_global_module_hooks_see_every_layer_as_without_fusing() -> None:
    net = _net()
    calls: list[str] = []
    handle = nn.modules.module.register_module_forward_hook(lambda m, args, out: calls.append(type(m).__name__))
    try:
        params, x = _stacked(net, k=3), torch.randn(3, 5, 2, 13)

        expected = _replicas_call(net, params, x)
        unfused, calls[:] = list(calls), []
        with fl.fused_layers(fl.fusable_layers(net, CPU)):
            actual = _replicas_call(net, params, x)
    finally:
        handle.remove()
    assert calls == unfused == ["Conv1d", "ReLU", "Conv1d", "Flatten", "Linear", "Sequential"]
    torch.testing.assert_close(actual, expected)


def test_a_sequential_subclass_or_one_without_runs_is_left_alone() -> None:
    class Residual(nn.Sequential):
        def forward(self, input: Tensor) -> Tensor:
            return input + super().forward(input)

    assert fl.fusable_layers(Residual(nn.Linear(3, 3), nn.ReLU()), CPU) == []
    assert fl.fusable_layers(nn.Sequential(nn.LayerNorm(3), nn.Dropout()), CPU) == []
    shared = nn.Sequential(nn.Linear(3, 3))
    assert fl.fusable_layers(shared, CPU) == [shared]


def test_weights_shared_by_the_replicas_keep_vmaps_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(3, 5, 6)
    taken = _runs_taken(monkeypatch)
    with torch.no_grad(), fl.fused_layers(fl.fusable_layers(net, CPU)):
        shared = vmap(net)(x)
    assert taken == [1]  # the ReLU only: the linear layers' weights are not batched
    with torch.no_grad():
        torch.testing.assert_close(shared, net(x))


@pytest.mark.parametrize("bias_shape", [(), (1, 3), (5, 3)], ids=["scalar", "one row", "a row per sample"])
def test_a_bias_that_is_not_one_value_per_output_runs_as_the_layer_itself(
    bias_shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``F.linear`` broadcasts such a bias (reviewer's case: it crashed in the run)."""
    net = nn.Sequential(nn.Linear(6, 3), nn.ReLU())
    params = {**_stacked(net, k=3), "0.bias": torch.randn(3, *bias_shape)}
    expected, actual, taken = _unfused_then_fused(net, params, torch.randn(3, 5, 6), monkeypatch)
    assert taken == [1]  # the ReLU only
    torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("padding, stride", [(-1, 1), (1, 0)], ids=["negative padding", "zero stride"])
def test_a_convolution_pytorch_refuses_gives_pytorchs_error(padding: int, stride: int) -> None:
    layer = nn.Conv1d(2, 4, 3)
    layer.padding, layer.stride = (padding,), (stride,)
    net = nn.Sequential(layer, nn.ReLU())
    params, x = _stacked(net, k=3), torch.randn(3, 5, 2, 11)

    def error() -> tuple[type, str]:
        with pytest.raises(RuntimeError) as raised:
            vmap(lambda p, xb: functional_call(net, p, (xb,)))(params, x)
        return type(raised.value), str(raised.value)

    expected = error()
    for fused in (fl.fusable_layers(net, CPU), fl.fusable_layers(layer, CPU)):  # in a run, and alone
        with fl.fused_layers(fused):
            assert error() == expected


def test_a_forward_set_on_a_layer_after_it_was_found_is_kept_and_called() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv1d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(36, 3))
    found = fl.fusable_layers(net, CPU)  # (the engine finds them at its first step)
    net.forward = lambda x: 2.0 * nn.Sequential.forward(net, x)  # type: ignore[method-assign]
    net[0]._conv_forward = lambda x, w, b: 3.0 * nn.functional.conv1d(x, w, b)  # type: ignore[method-assign]
    params, x = _stacked(net, k=3), torch.randn(3, 5, 2, 11)

    expected = _replicas_call(net, params, x)
    with fl.fused_layers(found):
        actual = _replicas_call(net, params, x)
    torch.testing.assert_close(actual, expected)
    assert "forward" in vars(net) and "_conv_forward" in vars(net[0])  # still theirs


#: Functions and methods a profiler or a FLOP counter may replace, as (owner, name).
REPLACEABLE = {
    "F.linear": (nn.functional, "linear"),
    "F.conv1d": (nn.functional, "conv1d"),
    "F.relu": (nn.functional, "relu"),
    "nn.Linear.forward": (nn.Linear, "forward"),
    "nn.Conv1d._conv_forward": (nn.Conv1d, "_conv_forward"),
    "nn.Sequential.forward": (nn.Sequential, "forward"),
}


@pytest.mark.parametrize("where", list(REPLACEABLE))
def test_a_replaced_function_or_method_is_called_as_without_fusing(where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each call it sees, with the same shapes (one replica's), in a run and for a Conv1d alone."""
    seen: list[tuple[int, ...]] = []
    owner, name = REPLACEABLE[where]
    original = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Tensor:
        seen.append(next(tuple(a.shape) for a in args if isinstance(a, Tensor)))
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv1d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(36, 3))
    params, x = _stacked(net, k=3), torch.randn(3, 5, 2, 11)

    expected, unfused = _replicas_call(net, params, x), list(seen)
    with fl.fused_layers(fl.fusable_layers(net, CPU)):
        actual = _replicas_call(net, params, x)
    assert len(unfused) >= 1 and seen == unfused * 2
    torch.testing.assert_close(actual, expected)
    if where in ("F.conv1d", "nn.Conv1d._conv_forward"):
        alone, seen[:] = {n[2:]: p for n, p in params.items() if n.startswith("0.")}, []
        expected = _replicas_call(net[0], alone, x)
        with fl.fused_layers(fl.fusable_layers(net[0], CPU)):
            actual = _replicas_call(net[0], alone, x)
        assert len(seen) == 2
        torch.testing.assert_close(actual, expected)


def test_a_replacement_made_before_crossbow_was_imported_is_called_as_without_fusing() -> None:
    """A profiler set up first: what is installed when the module is imported is not taken for PyTorch's own."""
    script = """
import functools, torch
from torch import nn
calls = []
def counting(function):
    @functools.wraps(function)
    def counted(*args, **kwargs):
        calls.append(function.__name__)
        return function(*args, **kwargs)
    return counted
nn.functional.linear = counting(nn.functional.linear)
nn.Linear.forward = counting(nn.Linear.forward)
from lightning_crossbow import fused_layers as fl
from torch.func import functional_call, vmap
net = nn.Sequential(nn.Linear(6, 3), nn.ReLU())
params = {n: p.detach() + torch.randn(3, *p.shape) for n, p in net.named_parameters()}
run = lambda: vmap(lambda p, xb: functional_call(net, p, (xb,)))(params, torch.randn(3, 5, 6))
run()
unfused, calls[:] = list(calls), []
with fl.fused_layers(fl.fusable_layers(net, torch.device("cpu"))):
    run()
print(unfused, calls)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "['forward', 'linear'] ['forward', 'linear']"


def test_the_forms_set_before_an_error_in_setting_them_are_taken_away() -> None:
    class Refusing(nn.Sequential):
        def __setattr__(self, name: str, value: Any) -> None:
            if name == "forward":
                raise RuntimeError("refused")
            super().__setattr__(name, value)

    first = nn.Sequential(nn.Linear(3, 3))
    with pytest.raises(RuntimeError, match="refused"), fl.fused_layers([first, Refusing(nn.Linear(3, 3))]):
        pass
    assert "forward" not in vars(first)


def test_a_sequential_called_with_other_arguments_gives_pytorchs_error() -> None:
    net = nn.Sequential(nn.Linear(6, 3))
    x = torch.randn(3, 5, 6)

    def error() -> str:
        with pytest.raises(TypeError) as raised:
            vmap(lambda p, xb: functional_call(net, p, (xb, xb)))(_stacked(net, k=3), x)
        return str(raised.value)

    expected = error()
    with fl.fused_layers(fl.fusable_layers(net, CPU)):
        assert error() == expected
        by_keyword = vmap(lambda p, xb: functional_call(net, p, (), {"input": xb}))(_stacked(net, k=3), x)
    torch.testing.assert_close(by_keyword, vmap(lambda p, xb: functional_call(net, p, (xb,)))(_stacked(net, k=3), x))


class ConvClassifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_the_fused_engine_trains_a_conv1d_model_as_the_sequential_engine_does(
    fused_calls: list[tuple[int, ...]], fused_losses: list[tuple[int, ...]]
) -> None:
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 2, 13, generator=generator), torch.randint(0, 3, (48,), generator=generator))
    results = {}
    for engine in ("fused", "sequential"):
        snapshot = ReplicaSnapshot()
        model = ConvClassifier()
        trainer(
            strategy=CrossbowStrategy(replicas_per_device=3, engine=engine), max_epochs=2, callbacks=[snapshot]
        ).fit(model, DataLoader(data, batch_size=4))
        results[engine] = (dict(model.named_parameters()), snapshot.params)
    assert len(fused_calls) == 2 * 2 * 4  # two layers, every step of both epochs
    assert fused_losses == [(3, 4, 3)] * 2 * 4  # the loss, every step of both epochs
    assert nn.functional.cross_entropy is fl._OWN["cross_entropy"]  # (PyTorch's own again after the steps)
    for name, value in results["fused"][0].items():
        torch.testing.assert_close(value, results["sequential"][0][name], rtol=1e-5, atol=1e-6)
    for name, value in results["fused"][1].items():
        torch.testing.assert_close(value, results["sequential"][1][name], rtol=1e-5, atol=1e-6)
