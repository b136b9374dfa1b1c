"""``make study-v3``: protocol v3 (docs/STUDY.md) in one resumable command.

In the protocol's order: D3 (where the penalty enters: a training-only study on the v2 task), D1
(the memory audit: one short DAPO run with its checkpoints, then ``medsrl.study.audit``), D2 (a
task with three planted wrong routes: DAPO, MEDS, MEDS with D1's chosen memory), then the report
(``report_v3.py``) into ``docs/STUDY_V3.md``. Each part is a plain command a user could type;
rerunning skips what is finished. The settings below are the protocol's; changing one makes the
study runner refuse the old roots rather than mix them.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from medsrl.study.report_v3 import d2_memory, write_report_v3
from medsrl.study.runner import ROOT, is_finished_run

# every trained-on response to samples.jsonl (the route analyses); no validation during training
# (no pre-registered figure reads it, and it is a fifth of a run's time on 2 cores)
SAMPLES = ["callbacks.sample_logger.every_n_steps=1", "callbacks.sample_logger.num_samples=100000",
           "callbacks.pass_at_k.every_n_steps=0", "callbacks.pass_at_k.at_start=false"]
NO_FILTER = "algorithm.plugins.dynamic_sampling=null"
# DAPO under drgrpo and gdpo, in the protocol, are left out for the 2-core budget (G2 compares
# each MEDS arm with its own estimator's advantages without MEDS, so it does not need them)
D3_METHODS = [
    "dapo", "meds", "meds@algorithm.advantage=drgrpo", "meds@algorithm.advantage=gdpo",
    "meds@placement=advantage", f"dapo@{NO_FILTER}", f"meds@{NO_FILTER},mixed_groups_only=false",
]
D2_ROUTES = "[shortcut,add,drop]"
# the routes are set on the warm start's corpus and the pools follow (configs/experiment/_study_task.yaml);
# 18,000 examples: level 1 has too few distinct three-route traps for the default 20,000
D2_TASK = [f"+model.warm_start.task_options.wrong_routes={D2_ROUTES}", "+model.warm_start.num_examples=18000",
           "study.trap_fraction=0.75"]
D2_EVAL = [f"+benchmark.study_l1.wrong_routes={D2_ROUTES}", "+benchmark.study_l1.trap_fraction=0.75"]
D1_STEPS, D1_EVERY = 20, 5
def _run(cmd: list[str]) -> None:
    print("[study-v3] $", shlex.join(cmd), flush=True)
    # one thread per process: the tiny model's ops are too small to share between cores, and on
    # a busy 2-core machine torch's spinning threads made a step ~10x slower (measured)
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **os.environ}
    done = subprocess.run(cmd, cwd=ROOT, env=env)
    if done.returncode != 0:
        raise SystemExit(f"[study-v3] failed (exit {done.returncode}); run `make study-v3` again to resume")


def study_argv(name: str, root: Path, seeds: list[int]) -> list[str]:
    return ["--name", name, "--root", str(root), "--seeds", *map(str, seeds)]


def d3_command(root: Path, seeds: list[int]) -> list[str]:
    return [sys.executable, "-m", "medsrl.study.runner", *study_argv("v3_d3", root, seeds),
            "--methods", *D3_METHODS, "--steps-a", "20", "--steps-b", "0", "--no-eval",
            "--pool-l1", "32", "--pool-l2", "24", "--levels", "1", *SAMPLES]


def d1_train_command(root: Path) -> list[str]:
    out = root / "v3_d1" / "train"
    return [sys.executable, "-m", "medsrl.train", "experiment=study_dapo", "seed=0",
            "study.pool_l1=32", "study.pool_l2=24", f"study.steps_a={D1_STEPS}",
            f"callbacks.model_checkpoint.every_n_train_steps={D1_EVERY}",
            "callbacks.model_checkpoint.save_top_k=-1", "skip_if_done=true", "logger=tensorboard", *SAMPLES[2:],
            f"hydra.run.dir={out}"]


def d1_audit_command(root: Path) -> list[str]:
    return [sys.executable, "-m", "medsrl.study.audit", str(root / "v3_d1" / "train"),
            "--out", str(root / "v3_d1" / "audit"), "--traps", "16", "--others", "16"]  # the whole pool


def d2_command(root: Path, seeds: list[int], memory: list[str]) -> list[str]:
    third = "meds@" + ",".join([*memory, "alpha=0.5", "beta=1.0"])
    return [sys.executable, "-m", "medsrl.study.runner", *study_argv("v3_d2", root, seeds),
            "--methods", "dapo", "meds", third, "--steps-a", "20", "--steps-b", "0", "--levels", "1",
            "--pool-l1", "32", "--pool-l2", "24", "--eval-n", "32", "--eval-problems", "64",
            *[f"--eval-override={o}" for o in D2_EVAL], "rollout.n=16", *D2_TASK, *SAMPLES]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="medsrl-study-v3", description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=ROOT / "logs" / "study")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "STUDY_V3.md")
    p.add_argument("--img-dir", type=Path, default=ROOT / "docs" / "img" / "study_v3")
    a = p.parse_args(argv)
    root = a.root.resolve()
    t0 = time.perf_counter()
    _run(d3_command(root, a.seeds))
    print("[study-v3] D3 done; D1: the audit run", flush=True)
    if not is_finished_run(root / "v3_d1" / "train"):  # as the study runner: a summary means done
        _run(d1_train_command(root))
    if not (root / "v3_d1" / "audit" / "audit.json").is_file():
        _run(d1_audit_command(root))
    name, memory = d2_memory(root)  # made once, then kept: D2's arm does not move with a re-run audit
    print(f"[study-v3] D1 chose the memory {name!r} for D2's third arm: {memory}", flush=True)
    _run(d2_command(root, a.seeds, memory))
    write_report_v3(root, a.doc, a.img_dir)
    print(f"[study-v3] done in {time.perf_counter() - t0:.0f} s: {a.doc}", flush=True)


if __name__ == "__main__":
    main()
