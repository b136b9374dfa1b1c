"""Step time of MEDS divided by that of DAPO, on the tiny preset, measured in one run.

    .venv/bin/python benchmarks/meds_overhead.py [--steps 6] [--rounds 2] [--prefill 2048] [overrides]

Three settings run in turns (DAPO, MEDS, MEDS with every visited key's memory pre-filled to
``--prefill`` entries), ``--rounds`` times each, from the same warm-started policy, seed and
data. DAPO's dynamic sampling is off so every step does the same amount of generation (its
extra rounds would otherwise dominate the comparison with noise). The first step of each run is
dropped (warm-up). Ratios compare the mean time per step. The last stdout line is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("MEDSRL_ROOT", str(ROOT))

import numpy as np  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from medsrl.meds.clustering import fit_cluster_labels  # noqa: E402
from medsrl.plugins.meds import Meds  # noqa: E402
from medsrl.train import build_run, train  # noqa: E402


def _config(out: Path, algorithm: str, steps: int, extra: list[str]):
    overrides = [
        f"paths.output_dir={out}",
        f"algorithm={algorithm}",
        f"trainer.max_steps={steps}",
        "algorithm.plugins.dynamic_sampling=null",
        "logger=csv",
        "callbacks.pass_at_k.every_n_steps=0",
        "export_policy=false",
        "callbacks.model_checkpoint.every_n_train_steps=1000000",
        "callbacks.sample_logger.every_n_steps=0",
        *extra,
    ]
    if algorithm == "meds":
        overrides += [
            "algorithm.plugins.meds.snapshot_every_n_steps=0",
            "algorithm.plugins.meds.panels_every_n_steps=0",
            "algorithm.plugins.meds.mixed_groups_only=false",  # as before: every group reaches MEDS
        ]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=overrides)


def _prefill(run, steps: int, per_key: int, dim: int) -> int:
    """Fill the wrong-answer store of every prompt the run will see with ``per_key`` features
    in a few clusters, labelled by a real HDBSCAN fit, as if the run had been going for long."""
    memory = next(p for p in run.module.plugins if isinstance(p, Meds)).store.memory
    rng = np.random.default_rng(0)
    keys = {p.key for s in range(steps) for p in run.datamodule.prompts_for_step(s)}
    for key in sorted(keys):
        centers = rng.standard_normal((4, dim)).astype(np.float32)
        x = centers[rng.integers(4, size=per_key)] + 0.1 * rng.standard_normal((per_key, dim)).astype(np.float32)
        memory.add(key, False, x, step=-1)
        memory.set_labels(key, False, fit_cluster_labels(x))
    return len(keys)


def _step_times(out: Path) -> list[float]:
    from run_helpers import read_metrics

    rows = [m for _, m in sorted(read_metrics(out).items()) if "train/time/step" in m]
    return [m["train/time/step"] for m in rows[1:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="medsrl-meds-overhead-"))
    times: dict[str, list[float]] = {"dapo": [], "meds": [], "meds_prefilled": []}
    extra: dict[str, float] = {}
    for r in range(args.rounds):
        for name in times:
            out = tmp / f"{name}_{r}"
            cfg = _config(out, "dapo" if name == "dapo" else "meds", args.steps, args.overrides)
            run = build_run(cfg)
            if name == "meds_prefilled":
                dim = run.module.policy.config.num_hidden_layers
                layers = cfg.algorithm.plugins.meds.layers
                dim = min(dim, int(layers)) if str(layers).isdigit() else dim
                extra["prefilled_keys"] = _prefill(run, args.steps, args.prefill, dim)
            train(cfg, run)
            times[name] += _step_times(out)
            print(f"[meds_overhead] {name} round {r}: {statistics.mean(_step_times(out)):.3f} s/step",
                  file=sys.stderr)
    mean = {k: statistics.mean(v) for k, v in times.items()}
    result = {
        "benchmark": "meds_overhead",
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "steps_per_run": args.steps,
        "rounds": args.rounds,
        "prefill_per_key": args.prefill,
        **extra,
        "seconds_per_step": {k: round(v, 4) for k, v in mean.items()},
        "ratio_meds_over_dapo": round(mean["meds"] / mean["dapo"], 4),
        "ratio_meds_prefilled_over_dapo": round(mean["meds_prefilled"] / mean["dapo"], 4),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
