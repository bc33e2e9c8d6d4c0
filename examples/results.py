"""A Hydra callback that collects the result of every run of a multirun sweep into one table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

COLUMNS = ("overrides", "replicas_per_device", "batch_size", "epochs", "test_acc", "wall_s", "samples_per_sec")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [" ".join(row.get("overrides", [])) if c == "overrides" else row.get(c) for c in COLUMNS]
        lines.append("| " + " | ".join("" if c is None else f"{c:.4f}" if isinstance(c, float) and c < 1 else str(c) for c in cells) + " |")
    return "\n".join(lines)


class ResultsTable(Callback):
    """On the end of a multirun, prints and writes ``results.md`` with one row per run."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = [json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/result.json"))]
        if not rows:
            return
        table = markdown_table(rows)
        (sweep_dir / "results.md").write_text(table + "\n")
        print(f"\n{table}\n(written to {sweep_dir / 'results.md'})")
