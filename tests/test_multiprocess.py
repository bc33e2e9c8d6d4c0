"""SMA across 2 CPU processes (gloo): exact values, identical z on every rank, resume, config mismatch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Subset

from tests.helpers import make_data, make_net, make_optimizer, reference_sma

SCRIPT = Path(__file__).with_name("multiprocess_script.py")


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    launcher_variables = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
    env = {key: value for key, value in os.environ.items() if key not in launcher_variables}
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), *args], capture_output=True, text=True, timeout=300, env=env
    )


def _per_rank_batches() -> list[list]:
    dataset = make_data(num_samples=96)
    return [list(DataLoader(Subset(dataset, range(r, 96, 2)), batch_size=8)) for r in range(2)]


@pytest.mark.parametrize("launcher", ["popen", "spawn"])
def test_two_processes_match_the_reference_over_all_learners(tmp_path: Path, launcher: str) -> None:
    k, epochs = 2, 2
    result = _run(tmp_path, launcher, str(k), "--epochs", str(epochs))
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
        world_batches=_per_rank_batches(),
    )
    for actual, expected in zip(ranks[0]["z"], z):
        torch.testing.assert_close(actual, expected)
    for rank in range(2):
        for index, stacked in enumerate(ranks[rank]["replicas"].values()):
            for j in range(k):
                torch.testing.assert_close(stacked[j], learners[rank * k + j][index])


def test_resume_on_two_processes_is_exact(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    straight.mkdir()
    assert _run(straight, "popen", "2", "--epochs", "4").returncode == 0
    half = tmp_path / "half"
    half.mkdir()
    result = _run(half, "popen", "2", "--epochs", "2", "--save", str(tmp_path / "half.ckpt"))
    assert result.returncode == 0, result.stderr[-3000:]
    result = _run(half, "popen", "2", "--epochs", "4", "--resume", str(tmp_path / "half.ckpt"))
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(2):
        a, b = torch.load(straight / f"rank{rank}.pt"), torch.load(half / f"rank{rank}.pt")
        for x, y in zip(a["z"], b["z"]):
            assert torch.equal(x, y)
        for name in a["replicas"]:
            assert torch.equal(a["replicas"][name], b["replicas"][name])


def test_ranks_with_different_configurations_fail_with_a_clear_error(tmp_path: Path) -> None:
    result = _run(tmp_path, "popen", "2", "--mismatch")
    assert result.returncode != 0
    assert "the ranks disagree on (replicas_per_device, alpha, central_momentum, engine)" in result.stderr
