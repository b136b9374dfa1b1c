"""Time per phase of a DAPO step on the tiny preset (CPU by default).

    .venv/bin/python benchmarks/step_profile.py [--steps 6] [--warmup 1] [hydra overrides ...]

Runs the real training entry point for a few steps and reads the per-phase timings the module
logs (``train/time/*``). The first ``--warmup`` steps are dropped. The last line printed is one
JSON object (phase -> mean seconds per step, plus the setting), so runs can be compared by script.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
os.environ.setdefault("MEDSRL_ROOT", str(ROOT))

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from medsrl.train import train  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. algorithm=grpo")
    args = ap.parse_args()

    out = Path(tempfile.mkdtemp(prefix="medsrl-profile-"))
    overrides = [
        f"paths.output_dir={out}",
        f"trainer.max_steps={args.steps}",
        "logger=csv",
        "callbacks.pass_at_k.every_n_steps=0",
        "export_policy=false",
        "callbacks.model_checkpoint.every_n_train_steps=1000000",
        *args.overrides,
    ]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    train(cfg)

    from run_helpers import read_metrics

    rows = [m for s, m in sorted(read_metrics(out).items()) if "train/time/step" in m][args.warmup :]
    phases = sorted({k for m in rows for k in m if k.startswith("train/time/")})
    result = {
        "benchmark": "step_profile",
        "algorithm": cfg.algorithm.name,
        "steps_measured": len(rows),
        "prompts_per_step": cfg.data.prompts_per_step,
        "n": cfg.rollout.n,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "mean_response_length": sum(m["train/response_length"] for m in rows) / max(len(rows), 1),
        "seconds_per_step": {
            k.removeprefix("train/time/"): round(sum(m.get(k, 0.0) for m in rows) / max(len(rows), 1), 4)
            for k in phases
        },
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
