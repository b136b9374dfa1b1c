"""Helpers for end-to-end tests: compose the real Hydra config and run it in a temp dir."""

from __future__ import annotations

import csv
import os
from pathlib import Path

from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("MEDSRL_ROOT", str(ROOT))


def compose_train(
    out_dir: Path, overrides: list[str] | None = None, debug: str | None = "fast", cache_dir: Path | None = None
):
    """The train config with ``overrides``, writing everything under ``out_dir``."""
    base = [f"paths.output_dir={out_dir}", f"paths.cache_dir={cache_dir or out_dir.parent / 'cache'}"]
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


# A micro model (22k parameters) warm-started for a few seconds: it writes the answer format with a
# \boxed{} (mostly wrong answers), which is what MEDS needs to have features to work with.
MICRO_WARM_START = [
    "model.warm_start={steps: 300, batch_size: 32, lr: 1.0e-2, warmup_steps: 10, num_examples: 2000,"
    " eval_examples: 8, eval_max_new_tokens: 48, system_prompt: null}",
    "data.template.system_prompt=null",
    "rollout.max_new_tokens=48",
    "algorithm.overlong.buffer_length=4",
]
