"""Step time of this checkout against another one (a revision before a change), on identical work.

    git worktree add /tmp/base <rev>
    .venv/bin/python benchmarks/compare_trees.py --other /tmp/base [--rounds 3] [--steps 8]
        [--warmup 2] [hydra overrides valid in both trees ...]

Runs ``benchmarks/step_profile.py`` of each tree in its own process (that tree's ``src`` and
``configs``, this venv), alternating the trees round by round so that the machine's drift hits
both alike. The same seed makes both trees sample the same responses when the change keeps the
numbers (check ``mean_response_length``). The last line printed is one JSON object: per tree the
mean step time of each round (and each phase's mean over the rounds), and the ratio this/other
per round with its mean and spread.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def profile(tree: Path, steps: int, warmup: int, overrides: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "MEDSRL_ROOT": str(tree)}
    cmd = [sys.executable, str(tree / "benchmarks" / "step_profile.py"), "--steps", str(steps),
           "--warmup", str(warmup), f"paths.cache_dir={ROOT / 'data' / 'cache'}", *overrides]
    out = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: step_profile failed\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", required=True, type=Path, help="the other checkout")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    trees = {"this": ROOT, "other": args.other.resolve()}
    step: dict[str, list[float]] = {name: [] for name in trees}
    phases: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    lengths: dict[str, list[float]] = {name: [] for name in trees}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in order:
            res = profile(trees[name], args.steps, args.warmup, args.overrides)
            step[name].append(res["seconds_per_step"]["step"])
            phases[name].append(res["seconds_per_step"])
            lengths[name].append(round(res["mean_response_length"], 4))
            print(f"[compare_trees] round {r} {name}: {step[name][-1]:.3f} s/step", file=sys.stderr)
    ratios = [a / b for a, b in zip(step["this"], step["other"], strict=True)]
    print(json.dumps({
        "benchmark": "compare_trees",
        "other": str(trees["other"]),
        "overrides": args.overrides,
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "steps_measured_per_run": args.steps - args.warmup,
        "seconds_per_step": step,
        "phase_means": {
            name: {k: round(statistics.mean(p.get(k, 0.0) for p in runs), 4) for k in sorted(runs[0])}
            for name, runs in phases.items()
        },
        "mean_response_length": lengths,
        "ratio_this_over_other": [round(x, 4) for x in ratios],
        "ratio_mean": round(statistics.mean(ratios), 4),
        "ratio_stdev": round(statistics.stdev(ratios), 4) if len(ratios) > 1 else None,
    }))


if __name__ == "__main__":
    main()
