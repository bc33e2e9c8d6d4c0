"""A Hydra callback that collects the result of every run of a multirun sweep into one table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

COLUMNS = ("overrides", "replicas_per_device", "batch_size", "epochs", "test_acc", "wall_s", "samples_per_sec")

#: How a column's numbers are written (the others as they are).
FORMATS = {"test_acc": "{:.4f}", "wall_s": "{:.2f}", "samples_per_sec": "{:.1f}"}


def _cell(column: str, value: Any) -> str:
    if value is None:
        return ""
    if column == "overrides":
        return " ".join(value)
    return FORMATS[column].format(value) if column in FORMATS and isinstance(value, (int, float)) else str(value)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(column, row.get(column)) for column in COLUMNS) + " |")
    return "\n".join(lines)


def _job_number(result: Path) -> tuple[int, str]:
    """A sweep's job folders (``0``, ``1``, ..., ``10``) in the order Hydra numbered them."""
    name = result.parent.name
    return (int(name), name) if name.isdigit() else (-1, name)


class ResultsTable(Callback):
    """On the end of a multirun, prints and writes ``results.md`` with one row per run of this sweep: a sweep folder
    used again (``hydra.sweep.dir=...``) may hold the results of an earlier sweep's other jobs, written before this
    sweep started (by the file system's clock), which are not its rows."""

    def __init__(self) -> None:
        self._started: float | None = None  #: when this sweep started (time.time()), once it has

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # (the time of a file written there now, not this machine's clock: the results' times come from the same
        # file system, which may be another machine's)
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        marker = sweep_dir / ".sweep_started"
        marker.touch()
        self._started = marker.stat().st_mtime
        marker.unlink()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        results = [
            path
            for path in sweep_dir.glob("*/result.json")
            if self._started is None or path.stat().st_mtime >= self._started
        ]
        rows = [json.loads(p.read_text()) for p in sorted(results, key=_job_number)]
        if not rows:
            return
        table = markdown_table(rows)
        path = sweep_dir / "results.md"
        replaced = " (replacing an earlier sweep's table)" if path.exists() else ""
        path.write_text(table + "\n")
        print(f"\n{table}\n(written to {path}{replaced})")
