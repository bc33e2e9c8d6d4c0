"""The averaging rules beside Crossbow's SMA: scaled averaging (the default) and EASGD, value for value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_crossbow import CrossbowStrategy
from lightning_crossbow.algorithms import (
    ScaledAveraging,
    StepContext,
    gain_ratio,
    make_averaging,
    noise_and_signal,
    warmed_up,
)
from lightning_crossbow.replicas import FlatBucket
from tests.helpers import (
    Classifier,
    ReferenceGossip,
    ReferenceScaledAveraging,
    ReplicaSnapshot,
    assert_one_replica_is_plain_lightning,
    loader,
    make_data,
    make_net,
    make_optimizer,
    reference_run,
    reference_sma,
    trainer,
)


def _context(num_learners: int, all_reduce_sum: Any, step: int = 0, **fields: Any) -> StepContext:
    """A step's context for a rule called directly: 10% into training, an SGD optimizer nothing reads."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    pull_rows = fields.pop("pull_rows", lambda rows, shift: rows)
    return StepContext(num_learners, step, 0.1, optimizer, all_reduce_sum, pull_rows, **fields)


# ------------------------------------------------------------------------------ the math alone
def test_noise_and_signal_are_the_sample_variance_and_the_debiased_squared_mean() -> None:
    generator = torch.Generator().manual_seed(0)
    steps = torch.randn(5, 100, generator=generator, dtype=torch.float64) + 0.3
    mean = steps.mean(0)
    variance = float(((steps - mean) ** 2).sum(1).sum()) / 4  # sum over coordinates of the per-coordinate variance
    noise, signal = noise_and_signal(float((steps**2).sum(1).mean()), float((mean**2).sum()), 5)
    assert noise == pytest.approx(variance)
    assert signal == pytest.approx(float((mean**2).sum()) - variance / 5)


def test_gain_is_k_for_pure_noise_and_one_when_every_step_agrees() -> None:
    assert gain_ratio(noise=1.0, signal=0.0, num_learners=8) == 8.0
    assert gain_ratio(noise=0.0, signal=1.0, num_learners=8) == 1.0
    assert gain_ratio(noise=1.0, signal=-0.5, num_learners=8) == 8.0  # a negative estimate means no signal
    assert gain_ratio(noise=1.0, signal=1.0, num_learners=8) == pytest.approx(2.0 / (1.0 / 8 + 1.0))


def test_warm_up_is_linear_in_epochs() -> None:
    assert warmed_up(8.0, 0.0, 2.0) == 1.0
    assert warmed_up(8.0, 1.0, 2.0) == 4.5
    assert warmed_up(8.0, 3.0, 2.0) == 8.0
    assert warmed_up(8.0, 0.0, 0.0) == 8.0


# ------------------------------------------------------------------ inside Lightning, exactly
SCALED_CASES = [
    # k, optimizer, outer_lr, central_momentum, warmup_epochs, engine
    (4, "sgd", "adaptive", None, 0.0, "fused"),
    (2, "sgd", "adaptive", 0.5, 1.0, "sequential"),
    (4, "sgd", "linear", None, 0.5, "fused"),
    (4, "sgd_nesterov_wd", 2.5, None, 0.0, "sequential"),
    (4, "adam", "adaptive", None, 0.0, "fused"),
    # one learner: z_next = w_1 (copied) where eta = 1 and mu = 0; the rule's arithmetic otherwise
    (1, "sgd", "adaptive", None, 0.0, "sequential"),
    (1, "sgd", 2.5, None, 0.0, "sequential"),
    (1, "sgd", "linear", 0.5, 0.0, "sequential"),
]


@pytest.mark.parametrize(("k", "optimizer", "outer_lr", "mu", "warmup", "engine"), SCALED_CASES)
def test_scaled_averaging_matches_reference(k: int, optimizer: str, outer_lr, mu, warmup: float, engine: str) -> None:
    dataset = make_data(num_samples=80)  # 10 batches of 8; k=4 skips 2 per epoch, so the warm-up counts 2 steps/epoch
    epochs = 3
    model = Classifier(optimizer=optimizer)
    strategy = CrossbowStrategy(
        replicas_per_device=k, outer_lr=outer_lr, central_momentum=mu, warmup_epochs=warmup, engine=engine
    )
    trainer(strategy=strategy, max_epochs=epochs).fit(model, loader(dataset))

    rule = ReferenceScaledAveraging(outer_lr, mu=mu or 0.0, warmup_epochs=warmup)
    z, learners = reference_run(
        make_net(), list(loader(dataset)), k, epochs, lambda params: make_optimizer(optimizer, params, 0.1), rule
    )
    for (name, param), expected in zip(model.net.named_parameters(), z, strict=True):
        torch.testing.assert_close(param.detach(), expected, msg=f"z differs in {name}")
    assert strategy.averaging.last_eta == pytest.approx(rule.eta_used)


def test_one_learner_with_scaled_averaging_is_plain_lightning() -> None:
    assert_one_replica_is_plain_lightning(Classifier, make_data(num_samples=48))


@pytest.mark.parametrize("optimizer", ["sgd", "sgd_nesterov_wd", "plain_sgd"])
@pytest.mark.parametrize("engine", ["fused", "sequential"])
def test_scaled_averaging_with_the_linear_rule_is_plain_lightning_at_k_times_the_batch_and_the_lr(
    optimizer: str, engine: str
) -> None:
    """With an optimizer linear in the gradients (SGD with or without momentum, Nesterov, weight decay), every
    learner starting each step at z with its own momentum ``m_j``: ``d_j = -lr m_j``, and the mean of the ``m_j``
    follows momentum on the mean gradient of the ``k`` batches. So ``eta = k`` is plain Lightning's step on one batch
    of ``k b`` samples at ``k`` times the learning rate, up to rounding (no BatchNorm or dropout, whose statistics
    and draws are per replica)."""
    k, epochs = 4, 3
    dataset = make_data(num_samples=96)  # 12 batches of 8: 3 steps of 4 per epoch, no batch left out
    model = Classifier(optimizer=optimizer)
    trainer(strategy=CrossbowStrategy(k, outer_lr="linear", engine=engine), max_epochs=epochs).fit(
        model, loader(dataset)
    )
    plain = Classifier(optimizer=optimizer, lr=0.1 * k)
    trainer(max_epochs=epochs).fit(plain, loader(dataset, batch_size=8 * k))
    for (name, param), expected in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(param, expected, msg=f"{name} differs from plain Lightning at k times the batch")


def test_easgd_is_sma_without_central_momentum() -> None:
    dataset = make_data(num_samples=64)
    model, snapshot = Classifier(), ReplicaSnapshot()
    trainer(
        strategy=CrossbowStrategy(replicas_per_device=4, algorithm="easgd"), max_epochs=2, callbacks=[snapshot]
    ).fit(model, loader(dataset))
    z, learners = reference_sma(
        make_net(), list(loader(dataset)), 4, 2, lambda params: make_optimizer("sgd", params, 0.1), alpha=0.25, mu=0.0
    )
    for param, expected in zip(model.net.parameters(), z, strict=True):
        torch.testing.assert_close(param.detach(), expected)
    for index, stacked in enumerate(snapshot.params.values()):
        for j in range(4):
            torch.testing.assert_close(stacked[j], learners[j][index])


@pytest.mark.parametrize(("k", "engine"), [(4, "fused"), (3, "sequential")])
def test_gossip_matches_reference(k: int, engine: str) -> None:
    dataset = make_data(num_samples=96)
    model, snapshot = Classifier(), ReplicaSnapshot()
    strategy = CrossbowStrategy(replicas_per_device=k, algorithm="gossip", engine=engine)
    trainer(strategy=strategy, max_epochs=2, callbacks=[snapshot]).fit(model, loader(dataset))
    z, learners = reference_run(
        make_net(), list(loader(dataset)), k, 2, lambda params: make_optimizer("sgd", params, 0.1), ReferenceGossip()
    )
    for param, expected in zip(model.net.parameters(), z, strict=True):  # z = the learners' mean, formed at the end
        torch.testing.assert_close(param.detach(), expected)
    for index, stacked in enumerate(snapshot.params.values()):
        for j in range(k):
            torch.testing.assert_close(stacked[j], learners[j][index])
    assert not all(torch.equal(stacked[0], stacked[1]) for stacked in snapshot.params.values())  # learners differ


def test_resume_keeps_the_measured_gain_and_the_trajectory(tmp_path: Path) -> None:
    dataset = make_data(num_samples=64)
    straight = Classifier()
    trainer(strategy=CrossbowStrategy(replicas_per_device=4), max_epochs=4).fit(straight, loader(dataset))

    first = Classifier()
    half = trainer(strategy=CrossbowStrategy(replicas_per_device=4), max_epochs=2)
    half.fit(first, loader(dataset))
    half.save_checkpoint(tmp_path / "half.ckpt")
    resumed = Classifier(seed=1)  # other initial weights: everything must come from the checkpoint
    strategy = CrossbowStrategy(replicas_per_device=4)
    trainer(strategy=strategy, max_epochs=4).fit(resumed, loader(dataset), ckpt_path=tmp_path / "half.ckpt")
    assert strategy.averaging.steps_measured == 4 * 2  # 2 steps per epoch, none measured twice or lost
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_outer_learning_rate_is_logged() -> None:
    model = Classifier()
    t = trainer(strategy=CrossbowStrategy(replicas_per_device=2), max_epochs=1, log_every_n_steps=1)
    t.fit(model, loader(make_data()))
    assert 1.0 <= float(t.logged_metrics["crossbow/outer_lr"]) <= 2.0


class _GrowAtStep(L.Callback):
    """Asks for k=5 after step 2; records the learners as the first step at k=5 starts its backward."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == 2:
            trainer.strategy.set_replicas_per_device(5)

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if trainer.strategy.replicas_per_device == 5 and not hasattr(self, "rows"):
            self.rows = [bucket.replicas.detach().clone() for bucket in trainer.strategy.stack.buckets]


class _CenterAndLearners(L.Callback):
    """z (the module's parameters) after step 0, and the learners' weights (the stacked replicas) after step 1."""

    def __init__(self) -> None:
        self.center, self.learners = {}, {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == 1:
            self.center = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        if trainer.global_step == 2:
            self.learners = {n: p.detach().clone() for n, p in trainer.strategy.stack.params.items()}


@pytest.mark.parametrize("k", [1, 3], ids=["one learner", "three learners"])
def test_gossip_learners_that_diverge_without_a_finite_peer_restart_from_z(k: int) -> None:
    """Every learner of step 1 diverges (k=3: each one's peer too; k=1: it has none): each restarts from z as last
    formed (on one process: after step 0), with fresh optimizer state, and training goes on, finite."""
    x, y = make_data(num_samples=k * 8 * 4)[:]
    for replica in range(k):
        x[(k + replica) * 8] = float("nan")  # step 1's batches
    model, probe, snapshot = Classifier(), _CenterAndLearners(), ReplicaSnapshot()
    with pytest.warns(UserWarning, match="non-finite loss") as record:
        trainer(
            strategy=CrossbowStrategy(replicas_per_device=k, algorithm="gossip"),
            max_steps=4,
            callbacks=[probe, snapshot],
        ).fit(model, loader(TensorDataset(x, y)))
    diverged = [str(w.message) for w in record if "non-finite loss" in str(w.message)]
    assert sorted({int(message.split(" at step ")[1].split(";")[0]) for message in diverged}) == [1]
    for name, learners in probe.learners.items():
        assert torch.equal(learners, probe.center[name].expand_as(learners))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.isfinite(p).all() for p in snapshot.params.values())


def test_gossip_learners_added_by_a_k_change_start_from_the_learners_mean() -> None:
    grow = _GrowAtStep()
    trainer(strategy=CrossbowStrategy(replicas_per_device=3, algorithm="gossip"), max_epochs=1, callbacks=[grow]).fit(
        Classifier(), loader(make_data(num_samples=128))
    )
    for rows in grow.rows:
        assert not torch.equal(rows[0], rows[1])  # the three learners had drifted apart
        for new in (rows[3], rows[4]):
            torch.testing.assert_close(new, rows[:3].mean(0))


# ------------------------------------------------------------------ communication per step
@pytest.mark.parametrize(("dtype", "collectives"), [(torch.float32, 1), (torch.float64, 1), (torch.bfloat16, 2)])
def test_adaptive_scaled_averaging_sums_steps_and_statistics_in_one_all_reduce(
    dtype: torch.dtype, collectives: int
) -> None:
    """The gain's statistics ride in the all-reduce of the summed steps (a second one only for 16-bit buckets).

    A stand-in all-reduce plays a second process whose learners took exactly this process's steps, so
    ``K = 2k`` and the reference below computes the gain from the ``2k`` steps written out."""
    k, n = 3, 7
    generator = torch.Generator().manual_seed(0)
    center = torch.randn(n, generator=generator, dtype=torch.float64)
    steps = torch.randn(k, n, generator=generator, dtype=torch.float64) * 0.1 + 0.05
    bucket = FlatBucket(
        names=["w"],
        shapes=[torch.Size([n])],
        offsets=[0],
        center=center.to(dtype, copy=True),
        center_prev=center.to(dtype, copy=True),
        replicas=(center + steps).to(dtype),
        corrections=torch.empty(k, n, dtype=dtype),
    )
    calls: list[int] = []

    def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:  # two processes with the same learners
        calls.append(tensor.numel())
        return tensor.mul_(2)

    rule = ScaledAveraging(smoothing=0.0)
    rule.after_local_step([bucket], _context(2 * k, all_reduce_sum))

    assert len(calls) == collectives
    all_steps = (bucket_steps := (center + steps).to(dtype).double() - center.to(dtype).double()).repeat(2, 1)
    mean = all_steps.mean(0)
    noise, signal = noise_and_signal(float((all_steps**2).sum(1).mean()), float(mean @ mean), 2 * k)
    eta = gain_ratio(noise, signal, 2 * k)
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype != torch.bfloat16 else dict(rtol=2e-2, atol=2e-2)
    assert rule.last_eta == pytest.approx(eta, rel=tolerance["rtol"])
    expected_center = center.to(dtype).double() + eta / (2 * k) * 2 * bucket_steps.sum(0)
    torch.testing.assert_close(bucket.center.double(), expected_center, **tolerance)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_the_statistics_ride_in_a_wide_bucket_wherever_it_sits(dtypes: tuple[torch.dtype, torch.dtype]) -> None:
    """Mixed-precision parameters make a float32 and a bf16 bucket: one all-reduce per bucket, whichever comes
    last, and the statistics still count the learners of both processes (``K = 2k``: a gain is measured)."""
    k = 3
    buckets = _buckets(dtypes, k)
    calls: list[torch.dtype] = []

    def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:  # two processes with the same learners
        calls.append(tensor.dtype)
        return tensor.mul_(2)

    rule = ScaledAveraging(smoothing=0.0)
    rule.after_local_step(buckets, _context(2 * k, all_reduce_sum))
    assert sorted(calls, key=str) == sorted(dtypes, key=str)  # one per bucket, none for the statistics alone
    assert rule.steps_measured == 1 and 1.0 <= rule.last_eta <= 2 * k


class _LoggedWithTheStep(L.Callback):
    """What crossbow logged in each step, and the truth after that step's averaging: the replicas' spread around
    their mean (for the rules that log it) or the outer learning rate the step used (scaled averaging)."""

    def __init__(self) -> None:
        self.pairs: list[tuple[float, float]] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        strategy = trainer.strategy
        if isinstance(strategy.averaging, ScaledAveraging):
            truth, name = strategy.averaging.last_eta, "crossbow/outer_lr"
        else:
            rows = torch.cat([b.replicas for b in strategy.stack.buckets], dim=1)
            mean = rows.mean(0)
            truth, name = float(((rows - mean).norm(dim=1) / mean.norm()).mean()), "crossbow/replica_divergence"
        self.pairs.append((truth, float(trainer.callback_metrics[name])))


@pytest.mark.parametrize("algorithm", ["gossip", "scaled_averaging"])
def test_the_logged_spread_or_outer_lr_is_the_steps_own(algorithm: str) -> None:
    """Logged once the step's averaging has run: gossip's spread is measured from the learners' mean (it keeps no z
    while training, so z is formed then), and scaled averaging's outer learning rate is the one the step used."""
    seen = _LoggedWithTheStep()
    strategy = CrossbowStrategy(replicas_per_device=3, algorithm=algorithm, engine="sequential")
    trainer(strategy=strategy, max_epochs=1, callbacks=[seen], log_every_n_steps=1).fit(
        Classifier(), loader(make_data(num_samples=96))
    )
    assert len(seen.pairs) == 4 and seen.pairs[0][0] > (1.0 if algorithm == "scaled_averaging" else 0.0)
    for truth, logged in seen.pairs:
        assert logged == pytest.approx(truth, rel=1e-5, abs=1e-7)


# ------------------------------------------------------------------------------ riders (the SIGTERM vote)
def _buckets(dtypes: tuple[torch.dtype, ...], k: int = 3, n: int = 5) -> list[FlatBucket]:
    generator = torch.Generator().manual_seed(0)
    buckets = []
    for dtype in dtypes:
        center = torch.randn(n, generator=generator)
        replicas = center + torch.randn(k, n, generator=generator) * 0.1 + 0.05
        buckets.append(
            FlatBucket(
                names=["w"],
                shapes=[torch.Size([n])],
                offsets=[0],
                center=center.to(dtype, copy=True),
                center_prev=center.to(dtype, copy=True),
                replicas=replicas.to(dtype),
                corrections=torch.empty(k, n, dtype=dtype),
            )
        )
    return buckets


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.bfloat16, torch.float64), (torch.bfloat16,)])
@pytest.mark.parametrize("algorithm", ["sma", "easgd", "scaled_averaging", "gossip"])
def test_riders_are_summed_in_the_rules_own_all_reduce_and_change_nothing_else(
    algorithm: str, dtypes: tuple[torch.dtype, ...]
) -> None:
    """``context.riders`` come back summed over processes (here two alike: the fake all-reduce doubles), in
    place, with no all-reduce of their own while a float32/float64 bucket can carry them; z and the learners
    end exactly as in the same step without riders."""
    k = 3
    rules = [make_averaging(algorithm, None, None, "adaptive", 0.0) for _ in range(2)]
    if algorithm == "scaled_averaging":
        for rule in rules:
            rule.smoothing = 0.0
    runs = []
    for rule, riders in zip(rules, [None, torch.tensor([1.0, 0.0, 3.0], dtype=torch.float64)]):
        buckets, calls = _buckets(dtypes, k), []

        def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
            calls.append(tensor.numel())
            return tensor.mul_(2)

        context = _context(2 * k, all_reduce_sum, step=1, pull_rows=lambda rows, shift: rows.flip(0), riders=riders)
        rule.before_local_step(buckets, 2 * k)
        rule.after_local_step(buckets, context)
        runs.append((buckets, calls, context.riders))
    (plain, plain_calls, _), (riding, riding_calls, riders) = runs
    assert riders.tolist() == [2.0, 0.0, 6.0]
    # An all-reduce of their own only for gossip, which has none to ride in. (With 16-bit buckets only, they ride
    # in one, as they are only compared with 0; scaled_averaging's statistics, which must stay exact, take an
    # all-reduce of their own then, and the riders go with them.)
    assert len(riding_calls) == len(plain_calls) + (algorithm == "gossip")
    narrow = all(dtype == torch.bfloat16 for dtype in dtypes)
    if algorithm != "gossip":
        assert len(plain_calls) == len(dtypes) + (narrow and algorithm == "scaled_averaging")
    for a, b in zip(plain, riding, strict=True):
        assert torch.equal(a.center, b.center) and torch.equal(a.replicas, b.replicas)


@pytest.mark.parametrize("algorithm", ["sma", "scaled_averaging"])
@pytest.mark.parametrize("another_process_stepped", [False, True])
def test_z_stays_when_every_learner_of_every_process_was_left_out(
    algorithm: str, another_process_stepped: bool
) -> None:
    """Every learner of this process left out (skipped or diverged): z and its momentum stay unless a learner
    of another process stepped, which the count of learners that stepped, riding in the all-reduce, tells; the
    rule says which (the strategy then leaves skipped learners as they were), and left-out learners are not
    corrected."""
    k = 3
    rule = make_averaging(algorithm, None, 0.5, "adaptive", 0.0)
    buckets = _buckets((torch.float32,), k)
    buckets[0].center_prev.sub_(0.1)  # z has momentum: mu (z - z_prev) is not zero
    center, center_prev = buckets[0].center.clone(), buckets[0].center_prev.clone()
    replicas = buckets[0].replicas.clone()

    def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:  # the other process adds 1 everywhere, or nothing
        return tensor.add_(1.0) if another_process_stepped else tensor

    context = _context(2 * k, all_reduce_sum, step=1, dropped=torch.ones(k, dtype=torch.bool))
    rule.before_local_step(buckets, 2 * k)
    reported = rule.after_local_step(buckets, context)
    moved = not torch.equal(buckets[0].center, center)
    assert moved == another_process_stepped == reported
    assert torch.equal(buckets[0].center_prev, center if moved else center_prev)
    assert torch.equal(buckets[0].replicas, replicas)  # left-out learners take no correction


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.bfloat16, torch.float64)])
@pytest.mark.parametrize("left_out", ["none", "one", "all"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("algorithm", ["sma", "easgd", "scaled_averaging"])
def test_a_single_process_moves_z_and_the_learners_as_an_all_reduce_over_one_process_does_and_calls_none(
    algorithm: str, weighted: bool, left_out: str, dtypes: tuple[torch.dtype, ...]
) -> None:
    """``single_process``: the rule takes its sums as they are, without an all-reduce or riding slots; z, its
    momentum, the learners, the rule's measured gain and what it reports end bitwise as through an all-reduce that
    leaves every sum as it is (one process), learners left out and learner weights included."""
    k = 3
    dropped = {"none": None, "one": torch.tensor([False, True, False]), "all": torch.ones(k, dtype=torch.bool)}
    runs = []
    for single_process in (False, True):
        rule = make_averaging(algorithm, None, 0.5 if algorithm != "easgd" else None, "adaptive", 0.0)
        buckets, calls = _buckets(dtypes, k), []

        def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
            calls.append(tensor.numel())
            return tensor

        for bucket in buckets:
            bucket.center_prev.sub_(0.1)
        reported = []
        for step in range(2):  # (the second step's gain reads the first's measurement)
            context = _context(
                k,
                all_reduce_sum,
                step=step,
                dropped=dropped[left_out],
                learner_weights=torch.tensor([0.5, 1.5, 1.0]) if weighted else None,
                single_process=single_process,
            )
            rule.before_local_step(buckets, k)
            reported.append(rule.after_local_step(buckets, context))
            for bucket in buckets:
                bucket.replicas.add_(0.01 * (step + 1))
        runs.append((buckets, calls, reported, rule.state_dict()))
    (through, through_calls, through_reported, through_state), (alone, alone_calls, alone_reported, alone_state) = runs
    assert through_calls and not alone_calls
    assert alone_reported == through_reported and alone_state == through_state
    for a, b in zip(through, alone, strict=True):
        assert torch.equal(a.center, b.center) and torch.equal(a.center_prev, b.center_prev)
        assert torch.equal(a.replicas, b.replicas)
