"""Reparametrizer: functional_call's swap with the names resolved once, equal to functional_call."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap
from torch.nn.utils.parametrizations import weight_norm

from lightning_crossbow import CrossbowStrategy
from lightning_crossbow.stateless import Reparametrizer
from tests.helpers import Classifier, assert_one_replica_is_plain_lightning, loader, make_data, trainer


class _Tied(nn.Module):
    """Tied weights (one Parameter under two names), a submodule registered twice, a BatchNorm's buffers and a
    parametrized layer: every way a tensor can be held."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(4, 4)
        self.decoder = nn.Linear(4, 4)
        self.decoder.weight = self.encoder.weight
        self.shared = nn.Linear(4, 4)
        self.again = self.shared
        self.norm = nn.BatchNorm1d(4)
        self.head = weight_norm(nn.Linear(4, 2))

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(self.decoder(torch.tanh(self.encoder(x))))
        return self.head(self.again(torch.tanh(self.shared(h))))


def _replacements(module: nn.Module, scale: float) -> dict[str, Tensor]:
    tensors = {n: p.detach() * scale + 0.1 for n, p in module.named_parameters()}
    tensors.update({n: b.clone() for n, b in module.named_buffers() if b.is_floating_point()})
    return tensors


def test_it_computes_what_functional_call_with_tied_weights_computes_and_restores_the_module() -> None:
    net = _Tied()
    originals = {n: t for n, t in [*net.named_parameters(), *net.named_buffers()]}
    x = torch.randn(5, 4)
    params = dict(net.named_parameters())
    expected_tensors = {n: t.clone().requires_grad_(n in params) for n, t in _replacements(net, 0.5).items()}
    ours_tensors = {n: t.clone().requires_grad_(n in params) for n, t in _replacements(net, 0.5).items()}
    # (on a copy: functional_call leaves a submodule registered twice holding its tensors, torch 2.13)
    expected = functional_call(copy.deepcopy(net), expected_tensors, (x,), tie_weights=True)
    reparametrize = Reparametrizer(net, ours_tensors)
    with reparametrize(ours_tensors):
        actual = net(x)
        assert net.decoder.weight is ours_tensors["encoder.weight"]  # the tied alias too
    torch.testing.assert_close(actual, expected)
    expected.sum().backward()
    actual.sum().backward()
    for name, tensor in ours_tensors.items():
        if tensor.requires_grad:
            torch.testing.assert_close(tensor.grad, expected_tensors[name].grad, msg=name)
    for name, tensor in expected_tensors.items():  # BatchNorm's running statistics, updated in place
        if not tensor.requires_grad:
            torch.testing.assert_close(ours_tensors[name], tensor, msg=name)
    for name, tensor in [*net.named_parameters(), *net.named_buffers()]:
        assert tensor is originals[name], name
    assert net.decoder.weight is net.encoder.weight and net.again is net.shared


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.utils.weight_norm(nn.Linear(4, 3)),  # a pre-hook that sets the weight from weight_g, weight_v
        lambda: nn.utils.spectral_norm(nn.Linear(4, 3)),  # the same with buffers (u, v)
        lambda: nn.LSTM(4, 3, batch_first=True),  # flat weights, refreshed in forward
    ],
    ids=["weight_norm", "spectral_norm", "lstm"],
)
def test_modules_that_derive_tensors_from_their_parameters_run_as_with_functional_call(make) -> None:
    torch.manual_seed(0)
    net = make()
    torch.manual_seed(0)
    reference = make()  # the same module, for functional_call
    tensors = _replacements(net, 0.5)
    x = torch.randn(2, 5, 4)
    expected = functional_call(reference, {n: t.clone() for n, t in tensors.items()}, (x,))
    with Reparametrizer(net, tensors)(tensors):
        actual = net(x)
    pick = (lambda out: out[0]) if isinstance(actual, tuple) else (lambda out: out)
    torch.testing.assert_close(pick(actual), pick(expected))
    assert not torch.allclose(pick(actual), pick(net(x)))  # (the replacements did change the output)


def test_an_error_inside_the_block_leaves_the_module_as_it_was() -> None:
    net = _Tied()
    before = {n: t for n, t in [*net.named_parameters(), *net.named_buffers()]}
    tensors = _replacements(net, 2.0)
    with pytest.raises(RuntimeError, match="inside"), Reparametrizer(net, tensors)(tensors):
        raise RuntimeError("inside")
    assert {n: t for n, t in [*net.named_parameters(), *net.named_buffers()]} == before


def test_under_vmap_each_row_runs_with_its_own_tensors() -> None:
    net = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    stacked = {n: torch.randn(4, *p.shape) for n, p in net.named_parameters()}
    x = torch.randn(4, 6, 3)
    reparametrize = Reparametrizer(net, stacked)

    def ours(tensors: dict[str, Tensor], xb: Tensor) -> Tensor:
        with reparametrize(tensors):
            return net(xb)

    expected = vmap(lambda tensors, xb: functional_call(net, tensors, (xb,)))(stacked, x)
    torch.testing.assert_close(vmap(ours)(stacked, x), expected)


def test_a_name_the_module_does_not_have_is_refused() -> None:
    with pytest.raises(KeyError, match=r"Linear has no parameter or buffer named 'weights'"):
        Reparametrizer(nn.Linear(2, 2), ["weights"])


class _TiedClassifier(Classifier):
    """The tests' classifier behind an embedding and its transpose-free twin: one weight under two names."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 6, bias=False)
        self.unembed = nn.Linear(6, 6, bias=False)
        self.unembed.weight = self.embed.weight

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(torch.tanh(self.unembed(torch.tanh(self.embed(x)))))


def test_one_replica_of_a_module_with_tied_weights_trains_as_plain_lightning() -> None:
    assert_one_replica_is_plain_lightning(_TiedClassifier, make_data(num_samples=48))


class _ForwardingWrapper(nn.Module):
    """Forwards attribute access to the module it wraps, as ``torch.compile``'s ``OptimizedModule`` does."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._orig_mod = module

    def forward(self, x: Tensor) -> Tensor:
        return self._orig_mod(x)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_orig_mod"], name)


def test_names_taken_before_a_submodule_was_wrapped_still_reach_their_tensors() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    tensors = {name: p.detach() * 2.0 for name, p in net.named_parameters()}  # names such as "0.weight"
    holder = nn.Module()
    holder.net = net
    names = {f"net.{name}": t for name, t in tensors.items()}
    holder.net = _ForwardingWrapper(net)  # now "net._orig_mod.0.weight"
    x = torch.randn(5, 3)
    with Reparametrizer(holder, names)(names):
        actual = holder.net(x)
    torch.testing.assert_close(actual, functional_call(net, tensors, (x,)))


def test_two_names_of_one_tensor_are_refused() -> None:
    net = nn.Linear(2, 2)
    net.register_buffer("alias", net.weight)  # a parameter also registered as a buffer
    with pytest.raises(ValueError, match=r"'weight' and 'alias' name the same tensor"):
        Reparametrizer(net, ["weight", "alias"])


class _RunningMean(nn.Module):
    """Keeps a running mean of its inputs by replacing its buffers (not in place), as many modules do."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            self.mean = 0.9 * self.mean + 0.1 * x.mean(0)
            self.calls = self.calls + 1
        return self.linear(x - self.mean)


def test_a_buffer_replaced_in_the_block_is_put_in_the_callers_dict_as_functional_call_puts_it() -> None:
    net, x = _RunningMean(), torch.randn(5, 4)
    expected = {name: t.clone() for name, t in net.named_buffers()}
    functional_call(net, expected, (x,))  # (puts the replaced buffers in its dict)
    before = {name: t.clone() for name, t in net.named_buffers()}
    ours = dict(before)
    _run(net, ours, x)
    for name in expected:
        assert torch.equal(ours[name], expected[name]), name
        assert ours[name] is not before[name] and not before[name].any()  # the replaced tensor is left as it was
    assert net.calls.item() == 0 and not net.mean.any()  # the module's own are back
    rows = {name: t.expand(3, *t.shape).clone() for name, t in net.named_buffers()}  # under vmap: each row's own

    def replaced_rows(b: dict[str, Tensor], xb: Tensor) -> dict[str, Tensor]:
        _run(net, b, xb)
        return b

    new_rows = vmap(replaced_rows)(rows, x.expand(3, 5, 4))
    assert new_rows["calls"].tolist() == [1, 1, 1] and rows["calls"].tolist() == [0, 0, 0]
    torch.testing.assert_close(new_rows["mean"][2], expected["mean"])


def _run(net: nn.Module, tensors: dict[str, Tensor], x: Tensor) -> Tensor:
    with Reparametrizer(net, tensors)(tensors):
        return net(x)


def test_a_buffer_set_to_none_is_not_put_in_the_dict() -> None:
    class Drops(_RunningMean):
        def forward(self, x: Tensor) -> Tensor:
            self.mean = None
            return self.linear(x)

    net = Drops()
    tensors = {name: t.clone() for name, t in net.named_buffers()}
    before = dict(tensors)
    _run(net, tensors, torch.randn(5, 4))
    assert tensors["mean"] is before["mean"] and net.mean is not None


def test_a_buffer_replaced_with_another_shape_is_refused_by_name() -> None:
    class Grows(_RunningMean):
        def forward(self, x: Tensor) -> Tensor:
            self.mean = torch.cat([self.mean, self.mean])
            return self.linear(x)

    net = Grows()
    tensors = {name: t.clone() for name, t in net.named_buffers()}
    with pytest.raises(RuntimeError, match=r"the buffer 'mean' was replaced with shape \(8,\); a buffer replaced"):
        _run(net, tensors, torch.randn(5, 4))
    assert net.mean.shape == (4,)  # the module's own is back


class _SavedScale(nn.Module):
    """Scales by a buffer that autograd saves for the backward, then replaces it (a running statistic)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x: Tensor) -> Tensor:
        out = x * self.scale
        self.scale = 0.9 * self.scale + 0.1 * x.detach().abs().mean(0)
        return out


class _Replacing(Classifier):
    def __init__(self, layer: type[nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        head = [] if layer is _RunningMean else [nn.Linear(4, 3)]  # (_RunningMean ends in 3 classes itself)
        self.net = nn.Sequential(nn.Linear(6, 4), layer(), *head)


@pytest.mark.parametrize("layer", [_RunningMean, _SavedScale], ids=["running mean", "saved for the backward"])
def test_a_module_that_replaces_its_buffers_trains_as_plain_lightning_and_alike_fused(layer: type[nn.Module]) -> None:
    """k=1 bitwise plain Lightning; k=2 fused as sequential. The replaced tensor is left as it was, so a backward
    that saved it runs (writing the new value into it would fail there)."""
    assert_one_replica_is_plain_lightning(lambda: _Replacing(layer), make_data())
    models = {}
    for engine in ("fused", "sequential"):
        models[engine] = _Replacing(layer)
        trainer(strategy=CrossbowStrategy(replicas_per_device=2, engine=engine), max_epochs=1).fit(
            models[engine], loader(make_data())
        )
    fused, sequential = (dict(models[e].named_buffers()) for e in ("fused", "sequential"))
    for name in sequential:
        torch.testing.assert_close(fused[name], sequential[name])
    assert any(not torch.equal(t, _Replacing(layer).get_buffer(n)) for n, t in sequential.items())  # (they moved)
