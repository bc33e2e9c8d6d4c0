"""SMA across 2 CPU processes (gloo): exact values, identical z on every rank, resume, config mismatch."""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, Subset

from tests.forked_launch import ForkedLauncher, torchrun
from tests.helpers import (
    ReferenceGossip,
    ReferenceScaledAveraging,
    make_data,
    make_net,
    make_optimizer,
    reference_run,
    reference_sma,
)

SCRIPT = Path(__file__).with_name("multiprocess_script.py")
#: The launcher of tests about something else: torchrun's environment in 2 processes forked from one that has imported
#: torch, Lightning and crossbow (``tests/forked_launch.py``), which saves each run most of its start (under torchrun
#: the processes import them at once, some 2 s more a run here; Lightning's own launcher starts the second process
#: only when the first reaches ``fit``, some 4 s more).
ANY_LAUNCHER = "forked"
_FORKED = ForkedLauncher()
atexit.register(_FORKED.close)


def _run(tmp_path: Path, launcher: str, *args: str) -> subprocess.CompletedProcess:
    """Runs the script on 2 processes: Lightning launches them (popen, spawn), or torchrun does, or they are forked as
    torchrun would start them (forked). Either of the last two: Lightning finds TorchElasticEnvironment and launches
    nothing itself."""
    launcher_variables = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
    env = {key: value for key, value in os.environ.items() if key not in launcher_variables}
    if launcher == "forked":
        return _FORKED.run([str(tmp_path), "popen", *args], env, timeout=300)
    if launcher == "torchrun":
        return torchrun([str(tmp_path), "popen", *args], env, timeout=300)
    command = [sys.executable, str(SCRIPT), str(tmp_path), launcher, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def _per_rank_batches() -> list[list]:
    dataset = make_data(num_samples=96)
    return [list(DataLoader(Subset(dataset, range(r, 96, 2)), batch_size=8)) for r in range(2)]


def _distributed_sampler_batches(epoch: int) -> list[list]:
    """What Lightning's DistributedSampler (shuffled, seed 0, reseeded every epoch) gives each of 2 ranks."""
    dataset = make_data(num_samples=96)
    per_rank = []
    for rank in range(2):
        sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        per_rank.append(list(DataLoader(dataset, batch_size=8, sampler=sampler)))
    return per_rank


@pytest.mark.parametrize(
    ("launcher", "sampler"),
    [
        ("popen", "user's per-rank loader"),
        ("spawn", "user's per-rank loader"),
        ("torchrun", "user's per-rank loader"),
        ("popen", "Lightning's DistributedSampler"),
    ],
)
def test_two_processes_match_the_reference_over_all_learners(tmp_path: Path, launcher: str, sampler: str) -> None:
    k, epochs = 2, 2
    lightning_sampler = sampler.startswith("Lightning")
    flags = ["--distributed-sampler"] if lightning_sampler else []
    result = _run(tmp_path, launcher, str(k), "--epochs", str(epochs), *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["world_size"] == 2 and ranks[0]["global_step"] == epochs * 3
    for a, b in zip(ranks[0]["z"], ranks[1]["z"]):
        assert torch.equal(a, b)  # bitwise identical central model on every rank
    z, learners = reference_sma(
        make_net(),
        [],
        k,
        epochs,
        lambda p: make_optimizer("sgd", p, 0.1),
        alpha=1.0 / (k * 2),
        mu=0.9,
        world_batches=_distributed_sampler_batches if lightning_sampler else _per_rank_batches(),
    )
    for actual, expected in zip(ranks[0]["z"], z):
        torch.testing.assert_close(actual, expected)
    for rank in range(2):
        for index, stacked in enumerate(ranks[rank]["replicas"].values()):
            for j in range(k):
                torch.testing.assert_close(stacked[j], learners[rank * k + j][index])


def test_scaled_averaging_on_two_processes_matches_the_reference_over_all_learners(tmp_path: Path) -> None:
    """The gain is measured over all K = 4 learners of both ranks (its statistics ride in the buckets' all-reduce)."""
    k, epochs = 2, 2
    result = _run(tmp_path, ANY_LAUNCHER, str(k), "--epochs", str(epochs), "--algorithm", "scaled_averaging")
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for a, b in zip(ranks[0]["z"], ranks[1]["z"], strict=True):
        assert torch.equal(a, b)
    rule = ReferenceScaledAveraging("adaptive")
    z, _ = reference_run(
        make_net(), [], k, epochs, lambda p: make_optimizer("sgd", p, 0.1), rule, world_batches=_per_rank_batches()
    )
    for actual, expected in zip(ranks[0]["z"], z, strict=True):
        torch.testing.assert_close(actual, expected)
    assert rule.eta_used > 1.0  # the 4 learners disagree: the measured gain is above plain averaging's


def test_gossip_on_two_processes_matches_the_reference_over_all_learners(tmp_path: Path) -> None:
    """K = 4 learners over 2 ranks: the shifts 1, 2, 3 mix within a rank, across ranks, and both at once."""
    k, epochs = 2, 2
    result = _run(tmp_path, ANY_LAUNCHER, str(k), "--epochs", str(epochs), "--algorithm", "gossip")
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    z, learners = reference_run(
        make_net(),
        [],
        k,
        epochs,
        lambda p: make_optimizer("sgd", p, 0.1),
        ReferenceGossip(),
        world_batches=_per_rank_batches(),
    )
    for rank in range(2):
        for actual, expected in zip(ranks[rank]["z"], z, strict=True):
            torch.testing.assert_close(actual, expected)
        for index, stacked in enumerate(ranks[rank]["replicas"].values()):
            for j in range(k):
                torch.testing.assert_close(stacked[j], learners[rank * k + j][index])


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where a 4-epoch run of k=2 on 2 processes left each rank's z and replicas, for the resume tests."""
    out = tmp_path_factory.mktemp("uninterrupted")
    result = _run(out, ANY_LAUNCHER, "2", "--epochs", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _assert_same_end(a_run: Path, b_run: Path) -> None:
    for rank in range(2):
        a, b = torch.load(a_run / f"rank{rank}.pt"), torch.load(b_run / f"rank{rank}.pt")
        assert a["global_step"] == b["global_step"] == 12
        for x, y in zip(a["z"], b["z"], strict=True):
            assert torch.equal(x, y)
        for name in a["replicas"]:
            assert torch.equal(a["replicas"][name], b["replicas"][name])


def test_resume_on_two_processes_is_exact(tmp_path: Path, uninterrupted_run: Path) -> None:
    result = _run(tmp_path, ANY_LAUNCHER, "2", "--epochs", "2", "--save", str(tmp_path / "half.ckpt"))
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = torch.load(tmp_path / "half.ckpt", weights_only=False)
    central, ranks = checkpoint["optimizer_states"][0]["state"], checkpoint["crossbow"]["ranks"]
    for index, entry in central.items():  # the momentum of the central model: the mean over all 4 replicas
        rows = torch.cat([rank["optimizer"]["state"][index]["momentum_buffer"] for rank in ranks])
        assert rows.shape[0] == 4
        torch.testing.assert_close(entry["momentum_buffer"], rows.mean(0))
    result = _run(tmp_path, ANY_LAUNCHER, "2", "--epochs", "4", "--resume", str(tmp_path / "half.ckpt"))
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_same_end(uninterrupted_run, tmp_path)


def test_backbone_finetuning_on_two_processes_gives_the_unfrozen_backbone_replicas_on_every_rank(
    tmp_path: Path,
) -> None:
    """Both ranks give the backbone its replicas when the callback unfreezes it (epoch 1), in the same flat
    buffers, which the averaging all-reduces: it trains from then on, and z stays identical on both ranks."""
    result = _run(tmp_path, ANY_LAUNCHER, "2", "--finetune", "--epochs", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for a, b in zip(ranks[0]["z"], ranks[1]["z"], strict=True):
        assert torch.equal(a, b)
    assert list(ranks[0]["replicas"]) == ["net.2.weight", "net.2.bias", "net.0.weight", "net.0.bias"]
    assert ranks[0]["replicas"]["net.0.weight"].shape[0] == 2
    assert not torch.equal(ranks[0]["z"][0], make_net().state_dict()["0.weight"])  # (trained in epoch 1)


def test_a_killed_run_resumes_from_its_last_checkpoint_exactly(tmp_path: Path, uninterrupted_run: Path) -> None:
    """Both processes are SIGKILLed mid-epoch; resuming from the last epoch-end checkpoint loses nothing."""
    checkpoints = tmp_path / "checkpoints"
    result = _run(tmp_path, "popen", "2", "--epochs", "4", "--checkpoint-dir", str(checkpoints), "--kill-at-step", "7")
    assert result.returncode == -9, result.stderr[-3000:]  # killed: 3 steps per epoch, so during the third epoch
    assert not list(tmp_path.glob("rank*.pt"))  # it never reached the end of training
    assert sorted(path.name for path in checkpoints.iterdir()) == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt"]

    result = _run(tmp_path, ANY_LAUNCHER, "2", "--epochs", "4", "--resume", str(checkpoints / "epoch=1-step=6.ckpt"))
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_same_end(uninterrupted_run, tmp_path)


def test_a_tuned_k_is_the_same_on_every_rank_at_every_step(tmp_path: Path) -> None:
    """Each rank measures its own throughput; rank 0's decision is applied by both at the same step."""
    result = _run(tmp_path, ANY_LAUNCHER, "1", "--epochs", "3", "--tune")
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["group_sizes"] == ranks[1]["group_sizes"]
    assert len(set(ranks[0]["group_sizes"])) > 1, "the tuner never changed k"
    assert ranks[0]["replicas_per_device"] == ranks[1]["replicas_per_device"]
    for a, b in zip(ranks[0]["z"], ranks[1]["z"], strict=True):
        assert torch.equal(a, b)  # bitwise identical central model after the changes


@pytest.mark.parametrize(
    ("launcher", "signalled_after", "stopped_at"), [("popen", 4, 5), ("popen", 12, 12), ("torchrun", 4, 5)]
)
def test_a_sigterm_on_any_rank_stops_every_rank_at_the_same_step_without_a_broadcast_per_step(
    tmp_path: Path, launcher: str, signalled_after: int, stopped_at: int
) -> None:
    """Rank 1 alone is signalled. After step 4 of 12: its vote rides in step 5's all-reduce and both ranks raise
    Lightning's SIGTERMException before batch 6. After the last step: the votes are all-reduced once when
    training ends, and both ranks raise there. No step made a broadcast (Lightning's per-batch SIGTERM check). Under
    torchrun no process launched another, so none passes the signal on."""
    result = _run(tmp_path, launcher, "2", "--epochs", "4", "--sigterm-at-step", str(signalled_after))
    assert result.returncode == 0, result.stderr[-3000:]
    # (after the last step, the callbacks' on_train_end ran before the strategy's, where the ranks stopped)
    assert len(list(tmp_path.glob("rank?.pt"))) == (2 if signalled_after == 12 else 0)
    for rank in range(2):
        stopped = torch.load(tmp_path / f"rank{rank}_stopped.pt")
        assert stopped == {"global_step": stopped_at, "broadcasts": 0}


def test_with_an_averaging_period_a_sigterm_stops_every_rank_after_the_next_averaging(tmp_path: Path) -> None:
    """averaging_period=2, 3 steps an epoch: averagings at steps 2, 3, 5, 6, ... Rank 1 is signalled after step 3;
    step 4 all-reduces nothing, so its vote rides in step 5's averaging and both ranks stop before batch 6 (every
    step: step 4's, stopping at 4)."""
    result = _run(tmp_path, ANY_LAUNCHER, "2", "--epochs", "4", "--sigterm-at-step", "3", "--averaging-period", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}_stopped.pt") == {"global_step": 5, "broadcasts": 0}


def test_a_step_that_every_replica_of_every_rank_skips_changes_nothing(tmp_path: Path) -> None:
    """Crossbow's rule: z, its momentum and the replicas (which differ from z) stay as they were through step 4,
    which every replica of both ranks skips (the count of learners that stepped rides in the all-reduce)."""
    result = _run(tmp_path, ANY_LAUNCHER, "2", "--epochs", "3", "--skip-at-step", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [torch.load(tmp_path / f"rank{rank}_skipped_step_unchanged.pt") for rank in range(2)] == [True, True]


def test_per_rank_loaders_of_different_lengths_fail_as_the_first_epoch_starts(tmp_path: Path) -> None:
    """Each rank's own shard (``use_distributed_sampler=False``), rank 1's two batches shorter: 3 steps at k=2
    against 2. Both ranks raise as the epoch starts, where rank 0 waited at rank 1's epoch end for the timeout."""
    result = _run(tmp_path, ANY_LAUNCHER, "2", "--uneven-datasets")
    assert result.returncode != 0
    assert (
        "crossbow: the processes' training epochs have different numbers of steps (rank 0: 3, rank 1: 2; k=2"
        " batches a step)"
    ) in result.stderr
    assert not list(tmp_path.glob("rank*.pt"))  # no rank finished training


def test_ranks_with_different_configurations_fail_with_a_clear_error(tmp_path: Path) -> None:
    result = _run(tmp_path, ANY_LAUNCHER, "2", "--mismatch")
    assert result.returncode != 0
    assert (
        "crossbow: the processes disagree on replicas_per_device (rank 0: replicas_per_device=2; rank 1:"
        " replicas_per_device=3). Every process must construct CrossbowStrategy with the same arguments."
    ) in result.stderr
    # k tuned on one rank only, and averaging periods that differ: their collectives never met (both hung)
    (tmp_path / "tuner").mkdir()
    result = _run(tmp_path / "tuner", ANY_LAUNCHER, "1", "--mismatch-tuner-and-period")
    assert result.returncode != 0
    assert (
        "disagree on averaging_period, tuned by ReplicaAutoTuner (rank 0: averaging_period=1, tuned by"
        " ReplicaAutoTuner=True; rank 1: averaging_period=2, tuned by ReplicaAutoTuner=False)"
    ) in result.stderr
