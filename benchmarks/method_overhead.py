"""Step time of training methods against DAPO on the tiny preset, interleaved in one run.

    .venv/bin/python benchmarks/method_overhead.py [--methods dapo,grpo,r3,meds,meds_r3]
        [--steps 6] [--rounds 3] [--pool 32] [overrides]

A method is an ``algorithm=`` preset (grpo, clip_cov, kl_cov, steer, novelty, lp_reg, ...) or a
variant of ``VARIANTS``: meds_filter and meds_dropped (MEDS behind DAPO's filter, without and with
``remember_dropped``, the only runs with the filter on); meds_256 and meds_2048 (MEDS whose
memory holds 256 / 2048 wrong-answer features per key before step 0, as in a long run), and
meds_256_growth / meds_2048_growth (the same with ``refit_growth=0.1``: a store re-fits once it
grew by 10 %, not at every visit). Besides
the whole-step ratio, ``own_time_median`` gives what a method's own code costs: its plug-in
phases and its extra time in the scoring forward (MEDS's capture hooks), over DAPO's. Plain DAPO
skips the scoring forward (on-policy, nothing reads it); the variant ``dapo_scored`` runs it, and
when it is among the methods, ``ratio_to_dapo_scored`` gives each method over it: MEDS's cost
beyond the one forward it needs.

Each round runs every method once, in turn (the order rotates by one each round, so no method
always runs first in a round), for ``--steps`` steps from the same warm-started
policy, seed and data; the first step of each run is dropped (warm-up), and a run counts by its
median step. The data pool is cut to
``--pool`` prompts so prompts come back within a run and history-based methods (MEDS, R3)
act, not only fill their memory. DAPO's dynamic sampling is off everywhere, so generation
differs only by what a method adds itself (R3's reflection prompts and replayed rows). The
ratio to DAPO is taken per round (the runs of one round are minutes apart) and reported as the
median with its min-max spread; the last stdout line is one JSON object.
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
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
os.environ.setdefault("MEDSRL_ROOT", str(ROOT))

import numpy as np  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from medsrl.features.clustering import fit_cluster_labels  # noqa: E402
from medsrl.features.reader import AnswerFeatureReader  # noqa: E402
from medsrl.methods.meds.plugin import Meds  # noqa: E402
from medsrl.train import build_run, train  # noqa: E402

QUIET = {  # no snapshots or panels inside the timed steps
    "meds": ["algorithm.plugins.meds.snapshot_every_n_steps=0", "algorithm.plugins.meds.panels_every_n_steps=0"],
    "r3": ["algorithm.plugins.r3.snapshot_every_n_steps=0", "algorithm.plugins.r3.panels_every_n_steps=0"],
}
PLUGINS_OF = {"meds": ["meds"], "r3": ["r3"], "meds_r3": ["meds", "r3"]}
# DAPO's filter without extra rounds: the same generation work as the runs without it
FILTER_ONLY = ("algorithm.plugins.dynamic_sampling="
               "{_target_: medsrl.methods.dynamic_sampling.DynamicSampling, max_rounds: 0}")
VARIANTS = {  # name -> (algorithm preset, overrides); compare meds_dropped with meds_filter
    # DAPO with the no-grad scoring forward that MEDS reads its features from. Plain DAPO skips it
    # (one epoch, one mini-batch: RLModule.scoring_forward_needed); naming the mini-batch of all
    # 16 prompts gives the same update with that forward, as before it could be skipped.
    "dapo_scored": ("dapo", ["algorithm.mini_batch_prompts=16"]),
    "meds_filter": ("meds", [FILTER_ONLY]),
    "meds_dropped": ("meds", [FILTER_ONLY, "algorithm.plugins.meds.remember_dropped=true"]),
    "meds_256": ("meds", []),
    "meds_2048": ("meds", []),
    # re-fit a store once it grew by 10 % (algorithm.plugins.meds.memory.refit_growth), not every visit
    "meds_256_growth": ("meds", ["algorithm.plugins.meds.memory.refit_growth=0.1"]),
    "meds_2048_growth": ("meds", ["algorithm.plugins.meds.memory.refit_growth=0.1"]),
}
# rows per key at step 0
PREFILL = {"meds_256": 256, "meds_2048": 2048, "meds_256_growth": 256, "meds_2048_growth": 2048}
FIRED = ["train/r3/replay/rescued_groups", "train/r3/replay/rows", "train/r3/ranking/groups",
         "train/r3/reflection/prompts", "train/meds/penalised_frac", "train/meds/dropped_rows_remembered",
         "train/meds/dropped_pass_s", "train/lp_reg/reg_frac", "train/clip_cov/cov_clipped_frac",
         "train/kl_cov/kl_penalised_frac", "train/novelty/vector_rate", "train/meds/refit_blocked_waits"]


def _config(out: Path, method: str, steps: int, pool: int, extra: list[str]):
    preset, own = VARIANTS.get(method, (method, []))
    overrides = [
        f"paths.output_dir={out}",
        f"algorithm={preset}",
        f"trainer.max_steps={steps}",
        "logger=csv",
        "callbacks.pass_at_k.every_n_steps=0",
        "export_policy=false",
        "callbacks.model_checkpoint.every_n_train_steps=1000000",
        "callbacks.sample_logger.every_n_steps=0",
        f"data.stages.0.datasets.0.source.num={pool}",
        "algorithm.plugins.dynamic_sampling=null",
    ]
    for plugin in PLUGINS_OF.get(preset, []):
        overrides += QUIET[plugin]
    overrides += own
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=overrides + list(extra))


def _prefill(run, steps: int, per_key: int) -> int:
    """Fill the wrong-answer store of every prompt the run will see with ``per_key`` features in
    a few clusters, labelled by a real HDBSCAN fit, as if the run had been going for long; the
    first re-fit of each key then clusters ``per_key`` + its new rows."""
    meds = next(p for p in run.module.plugins if isinstance(p, Meds))
    memory = meds.store.memory
    dim = AnswerFeatureReader(run.module.policy, run.module.tokenizer, meds.features).num_features
    rng = np.random.default_rng(0)
    keys = {p.key for s in range(steps) for p in run.datamodule.prompts_for_step(s)}
    for key in sorted(keys):
        centers = rng.standard_normal((4, dim)).astype(np.float32)
        x = centers[rng.integers(4, size=per_key)] + 0.1 * rng.standard_normal((per_key, dim)).astype(np.float32)
        memory.add(key, False, x, step=-1)
        memory.set_labels(key, False, fit_cluster_labels(x))
    return len(keys)


def _steps(out: Path) -> list[dict[str, float]]:
    from run_helpers import read_metrics

    return [m for _, m in sorted(read_metrics(out).items()) if "train/time/step" in m][1:]


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="dapo,grpo,r3,meds,meds_r3")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pool", type=int, default=32)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    methods = args.methods.split(",")
    if "dapo" not in methods:
        raise SystemExit("--methods must include dapo (the baseline)")

    tmp = Path(tempfile.mkdtemp(prefix="medsrl-method-overhead-"))
    per_round: dict[str, list[float]] = {m: [] for m in methods}
    phases: dict[str, dict[str, list[float]]] = {m: {} for m in methods}
    fired: dict[str, dict[str, float]] = {m: {} for m in methods}
    for r in range(args.rounds):
        for method in methods[r % len(methods):] + methods[: r % len(methods)]:  # rotated: no method always first
            out = tmp / f"{method}_{r}"
            cfg = _config(out, method, args.steps, args.pool, args.overrides)
            run = build_run(cfg)
            if method in PREFILL:
                _prefill(run, args.steps, PREFILL[method])
            train(cfg, run)
            steps = _steps(out)
            # the run's median step: in one run the first measured step took 4-9 s in 14 of 21
            # runs (DAPO's too), which put their 5-step means 30-100 % above their medians
            # (docs/BENCHMARKS.md, issue 13)
            per_round[method].append(statistics.median(s["train/time/step"] for s in steps))
            for s in steps:
                for k, v in s.items():
                    if k.startswith("train/time/"):
                        phases[method].setdefault(k.removeprefix("train/time/"), []).append(v)
                    if k in FIRED:
                        fired[method][k.removeprefix("train/")] = fired[method].get(k.removeprefix("train/"), 0.0) + v
            print(f"[method_overhead] round {r} {method}: {per_round[method][-1]:.3f} s/step", file=sys.stderr)
    ratios = {m: [a / b for a, b in zip(per_round[m], per_round["dapo"], strict=True)] for m in methods if m != "dapo"}
    scored = "dapo_scored" if "dapo_scored" in methods else "dapo"
    ratios_scored = {m: [a / b for a, b in zip(per_round[m], per_round[scored], strict=True)]
                     for m in methods if scored != "dapo" and m not in ("dapo", scored)}
    med = {m: {k: statistics.median(v) for k, v in p.items()} for m, p in phases.items()}
    # what a method's own code costs: its plug-in phases, and what it adds to the scoring forward
    # (MEDS's capture hooks) over DAPO's
    own = {m: {"plugin_phases_s": round(p.get("groups", 0.0) + p.get("shaping", 0.0), 4),
               "scoring_forward_extra_s": round(p.get("logprob", 0.0) - med[scored].get("logprob", 0.0), 4)}
           for m, p in med.items() if m != "dapo"}
    result = {
        "benchmark": "method_overhead",
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "steps_per_run": args.steps,
        "rounds": args.rounds,
        "pool": args.pool,
        "seconds_per_step": {m: _spread(v) for m, v in per_round.items()},
        "ratio_to_dapo": {m: _spread(v) for m, v in ratios.items()},
        "ratio_to_dapo_scored": {m: _spread(v) for m, v in ratios_scored.items()},
        "phase_seconds_median": {m: {k: round(statistics.median(v), 4) for k, v in sorted(p.items())}
                                 for m, p in phases.items()},
        "own_time_median": own,
        "fired_total": {m: {k: round(v, 3) for k, v in f.items()} for m, f in fired.items() if f},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
