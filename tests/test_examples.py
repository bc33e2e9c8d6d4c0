"""The Hydra configs compose, bad values fail before training, and the example scripts run end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, InstantiationException
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.models import Classifier, mlp  # noqa: E402
from examples.train import build  # noqa: E402
from lightning_crossbow import CrossbowStrategy  # noqa: E402


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


def _build(*overrides: str):
    from hydra.core.hydra_config import HydraConfig

    cfg = _compose("~logger", *overrides)
    HydraConfig.instance().set_config(cfg)
    return build(cfg)


def test_every_crossbow_argument_is_a_key_under_strategy() -> None:
    cfg = _compose()
    crossbow_arguments = {
        "replicas_per_device", "algorithm", "outer_lr", "warmup_epochs", "alpha", "central_momentum", "engine",
        "reset_on_lr_drop",
    }
    assert crossbow_arguments <= set(cfg.strategy)


def test_overrides_reach_the_strategy_trainer_and_data() -> None:
    trainer, model, data = _build(
        "strategy.replicas_per_device=3", "strategy.algorithm=sma", "strategy.alpha=0.1", "data.batch_size=8", "trainer.max_epochs=2",
        "model=mlp", "data=digits",
    )
    assert isinstance(trainer.strategy, CrossbowStrategy)
    assert trainer.strategy.replicas_per_device == 3 and trainer.strategy.alpha == 0.1
    assert data.batch_size == 8 and trainer.max_epochs == 2 and model.net[0].in_features == 64


def test_baseline_strategies() -> None:
    trainer, _, _ = _build("strategy=single")
    assert not isinstance(trainer.strategy, CrossbowStrategy)


def test_a_bad_strategy_value_names_the_key() -> None:
    with pytest.raises(InstantiationException, match=r"replicas_per_device must be a positive int .* got 0"):
        _build("strategy.replicas_per_device=0")


def test_an_unknown_model_lists_the_available_ones() -> None:
    with pytest.raises(ConfigCompositionException, match=r"(?s)model/resnet.*Available options.*cnn.*mlp"):
        _compose("model=resnet")


def test_a_misspelt_key_is_refused() -> None:
    with pytest.raises(ConfigCompositionException, match=r"replicas_per_devic"):
        _compose("strategy.replicas_per_devic=4")


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_train_app_runs_end_to_end_and_prints_the_result_line(tmp_path: Path) -> None:
    result = _run(
        str(ROOT / "examples" / "train.py"), "trainer.max_epochs=1", "data=digits", "model=mlp",
        "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RESULT test_acc=" in result.stdout and "replicas_per_device=4" in result.stdout
    assert (tmp_path / "result.json").exists()
    (checkpoint,) = tmp_path.rglob("*.ckpt")  # loads in plain Lightning, weights only (no omegaconf)
    model = Classifier.load_from_checkpoint(checkpoint, net=mlp(in_features=64, num_classes=10), map_location="cpu")
    assert model.hparams.lr_milestones == [] and model.hparams.num_classes == 10


def test_multirun_collects_one_table(tmp_path: Path) -> None:
    result = _run(
        str(ROOT / "examples" / "train.py"), "-m", "strategy.replicas_per_device=1,2", "trainer.max_epochs=1",
        "data=digits", "model=mlp", "trainer.enable_progress_bar=false", f"hydra.sweep.dir={tmp_path}", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / "results.md").read_text()
    assert "strategy.replicas_per_device=1" in table and "strategy.replicas_per_device=2" in table


def test_drop_in_script_and_lightning_cli(tmp_path: Path) -> None:
    result = _run(str(ROOT / "examples" / "drop_in.py"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RESULT val_acc=" in result.stdout
    result = _run(
        str(ROOT / "examples" / "drop_in.py"), "fit", "--trainer.strategy", "crossbow", "--trainer.max_epochs", "1",
        "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "crossbow ReplicaAutoTuner (objective=throughput)" in result.stderr  # the CLI built crossbow, k tuned


def test_the_sweep_table_orders_jobs_as_hydra_numbered_them_and_formats_each_column(tmp_path) -> None:
    from examples.results import ResultsTable

    for job in (0, 1, 2, 10):
        (tmp_path / str(job)).mkdir()
        result = {"overrides": [f"job={job}"], "test_acc": 0.9, "wall_s": 0.79 + job, "samples_per_sec": 1234.56}
        (tmp_path / str(job) / "result.json").write_text(json.dumps(result))
    ResultsTable().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    rows = (tmp_path / "results.md").read_text().splitlines()[2:]
    assert [row.split(" | ")[0] for row in rows] == ["| job=0", "| job=1", "| job=2", "| job=10"]
    assert rows[0].endswith("| 0.9000 | 0.79 | 1234.6 |") and rows[3].endswith("| 0.9000 | 10.79 | 1234.6 |")


def test_the_sweep_table_holds_this_sweeps_jobs_only(tmp_path) -> None:
    """A sweep folder used again holds an earlier sweep's result of a job this sweep has not (job 5): not a row."""
    from examples.results import ResultsTable

    table = ResultsTable()
    (tmp_path / "5").mkdir()
    (tmp_path / "5" / "result.json").write_text(json.dumps({"overrides": ["job=5"]}))
    earlier = time.time() - 60
    os.utime(tmp_path / "5" / "result.json", (earlier, earlier))  # (written before this sweep started)
    table.on_multirun_start(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    for job in (0, 1):
        (tmp_path / str(job)).mkdir()
        (tmp_path / str(job) / "result.json").write_text(json.dumps({"overrides": [f"job={job}"]}))
    table.on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    rows = (tmp_path / "results.md").read_text().splitlines()[2:]
    assert [row.split(" | ")[0] for row in rows] == ["| job=0", "| job=1"]


def test_the_data_is_standardised_with_the_training_splits_statistics_alone() -> None:
    """Each feature of the training split has mean 0 and standard deviation 1; the validation split, held out,
    does not enter them (it did: the mean and standard deviation were taken over both)."""
    from examples.data import Digits

    data = Digits(val_fraction=0.5, seed=0)
    data.setup("fit")
    train, val = data.train_dataloader().dataset.tensors[0], data.val_dataloader().dataset.tensors[0]
    varying = train.std(0) > 0  # (features constant over the training split stay 0)
    assert train.mean(0).abs().max() < 1e-5
    assert (train.std(0, unbiased=False)[varying] - 1).abs().max() < 1e-4
    assert val.mean(0).abs().max() > 1e-2  # (another sample: its own mean is not exactly 0)
