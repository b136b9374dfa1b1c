"""Helpers for end-to-end tests: compose the real Hydra config and run it in a temp dir."""

from __future__ import annotations

import csv
import os
from pathlib import Path

from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("MEDSRL_ROOT", str(ROOT))


def compose_train(out_dir: Path, overrides: list[str] | None = None, debug: str | None = "fast"):
    """The train config with ``overrides``, writing everything under ``out_dir``."""
    base = [f"paths.output_dir={out_dir}", f"paths.cache_dir={out_dir.parent / 'cache'}"]
    if debug:
        base.append(f"debug={debug}")
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=base + list(overrides or []))


def read_metrics(out_dir: Path) -> dict[int, dict[str, float]]:
    """Per-step metrics from the CSV logger (``debug=fast`` logs to csv): {step: {name: value}}."""
    path = out_dir / "csv" / "metrics.csv"
    rows: dict[int, dict[str, float]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            for k, v in row.items():
                if k != "step" and v not in ("", None):
                    rows.setdefault(step, {})[k] = float(v)
    return rows
