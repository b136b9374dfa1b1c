"""``make study`` and its kin: a protocol (``studies/protocols/<name>.yaml``) run part by part.

A part is a study: a chain of Hydra multiruns, each a plain ``medsrl-train -m`` or ``medsrl-eval
-m`` command a user could type, run in a fixed directory tree under ``<root>/<part>``::

    study.json                      settings, commit, machine, phase timings
    precheck/                       medsrl-eval of the warm start on the val split (n samples),
                                    error_modes.json: does it repeat the same wrong answers?
    train/<method>/seed<k>/A        stage A: experiment=study_<method> for steps_a steps
    train/<method>/seed<k>/B        stage B: resumed (full) from A's checkpoints/last.ckpt
                                    (none with --steps-b 0: the study is stage A only)
    eval/<method>/seed<k>           medsrl-eval of the last stage's policy on the test split,
                                    n samples, and its error_modes.json (none with --no-eval);
                                    its generations.jsonl keeps every sample's answer and score
                                    per problem (the paired and within-seed tests of v4)
    eval/warm_start/seed0           the same for the warm-started policy (the starting point)

or an audit (v3's D1: a training run that keeps its checkpoints, then ``studies.audit``). Then
``studies.report`` writes the protocol's report. Rerunning the same command resumes: a training
run with ``summary.json`` is skipped (one with only a checkpoint continues from it), an evaluation
with ``results.json`` is not launched again, and one cut short continues from its generations
file. A root made with other settings is refused rather than mixed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from medsrl.utils.atomic_file import atomic_write

ROOT = Path(__file__).resolve().parents[1]
PROTOCOLS = Path(__file__).parent / "protocols"
METHODS: dict[str, str] = {  # experiment=study_<name> -> label in the tables
    "grpo": "GRPO",
    "dapo": "DAPO",
    "grpo_entropy": "GRPO+Entropy",
    "meds": "MEDS",
    "r3": "R3",
    "meds_r3": "MEDS+R3",
    "novelty": "Novelty (MEDS features)",
    "w_reinforce": "W-REINFORCE",  # protocol v4's positive controls and its outcome-count bonus
    "passk": "Pass@k advantage",
    "outcome_ucb": "Outcome UCB",
}
# the methods of a study that names none (protocol v1's seven): the v1 root keeps its settings
V1_METHODS = ("grpo", "dapo", "grpo_entropy", "meds", "r3", "meds_r3", "novelty")
WARM_START = "warm_start"
_SHORT_NAMES = {"beta": "cap"}  # how a variant's keys read in labels (MEDS's beta is its cap)
# MEDS's settings that moved into a group keep their flat names of before in folders and labels, so
# finished studies and their tables (docs/STUDY_V3.md) read the same
_MOVED_NAMES = {"features.dtype": "feature_dtype", "features.logits": "feature_logits"}
_PYTHON_M = [sys.executable, "-m"]


def method_base(spec: str) -> str:
    return spec.split("@", 1)[0]


def _variant(spec: str) -> list[tuple[str, str]]:
    """The ``(key, value)`` pairs of a method spec: none for ``<name>`` (experiment=study_<name>);
    a variant ``<name>@key=value,...`` is that experiment with overrides (a key without a dot is
    ``algorithm.plugins.<name>.<key>``), in a directory and with a label of its own."""
    if "@" not in spec:
        return []
    parts = [part.partition("=") for part in spec.split("@", 1)[1].split(",")]
    for key, sep, value in parts:
        if not (key and sep and value):
            raise ValueError(
                f"study method {spec!r}: expected <method>@key=value[,key=value], "
                f"got {key + sep + value!r}"
            )
    return [(key, value) for key, _, value in parts]


def setting_name(key: str) -> str:
    """A variant key's name in folders and labels: its last part (``algorithm.advantage`` ->
    ``advantage``), and a MEDS feature setting its flat name of before
    (``algorithm.plugins.meds.features.logits`` -> ``feature_logits``)."""
    parts = key.split(".")
    return _MOVED_NAMES.get(".".join(parts[-2:]), parts[-1])


def _full_key(base: str, key: str) -> str:
    """A variant key as Hydra takes it: a dotted key as given; a plain one is the plug-in's
    (``algorithm.plugins.<base>.<key>``), at its new place if MEDS's settings moved it into a
    group (a ``choice.json`` kept from before the groups: ``dedup`` -> ``clustering.dedup``)."""
    if "." in key:
        return key
    if base == "meds":
        from medsrl.methods.meds.plugin import Meds  # imports torch: only for a plain MEDS key

        key = Meds.moved.get(key, key)
    return f"algorithm.plugins.{base}.{key}"


def method_overrides(spec: str) -> list[str]:
    """The Hydra overrides a method spec adds to its experiment."""
    base = method_base(spec)
    return [f"{_full_key(base, k)}={v}" for k, v in _variant(spec)]


def method_dir(spec: str) -> str:
    """A file-system and Hydra-safe name: ``meds@alpha=1.0,beta=2.0`` -> ``meds_alpha1.0_beta2.0``."""
    return "_".join([method_base(spec), *(setting_name(k) + v for k, v in _variant(spec))])


def method_label(spec: str) -> str:
    """``MEDS`` or ``MEDS (alpha 1.0, cap 2.0)``."""
    short = [(setting_name(k), v) for k, v in _variant(spec)]
    pairs = ", ".join(f"{_SHORT_NAMES.get(k, k)} {v}" for k, v in short)
    return METHODS[method_base(spec)] + (f" ({pairs})" if pairs else "")


@dataclass
class StudySettings:
    """What decides the study's numbers: a root made with other settings is refused."""

    name: str = "full"
    methods: list[str] = field(default_factory=lambda: list(V1_METHODS))
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    steps_a: int = 20
    steps_b: int = 20
    eval_n: int = 32
    eval_problems: int = 64  # per level, from the test split
    overrides: list[str] = field(default_factory=list)  # extra Hydra overrides for every run
    pool_l1: int = 256  # training problems of level 1 (stages A and B) and level 2 (stage B)
    pool_l2: int = 1024
    eval_train: bool = False  # also evaluate every final policy on its training pools
    levels: list[int] = field(default_factory=lambda: [1, 2])  # the benchmark's levels (study_l<k>)
    evaluate: bool = True  # false: training only (a study of the mechanism, read from the curves)
    eval_overrides: list[str] = field(default_factory=list)  # extra overrides of every medsrl-eval

    def check(self) -> None:
        unknown = [m for m in self.methods if method_base(m) not in METHODS]
        if unknown:
            raise ValueError(
                f"unknown study method(s) {unknown}; known: {list(METHODS)} (a variant: meds@alpha=1.0)"
            )
        dirs = [method_dir(m) for m in self.methods]  # a malformed variant fails here
        if len(set(dirs)) != len(dirs):
            raise ValueError(f"study methods {self.methods} name the same run twice")
        if not self.seeds:
            raise ValueError("a study needs at least one seed")
        if self.steps_a < 1 or self.steps_b < 0:
            raise ValueError(f"steps_a must be >= 1 and steps_b >= 0, got {self.steps_a}, {self.steps_b}")
        if not self.levels or not set(self.levels) <= {1, 2}:
            raise ValueError(f"levels must be a non-empty subset of [1, 2], got {self.levels}")
        if self.eval_n < 1 or self.eval_problems < 1:
            raise ValueError(f"eval_n and eval_problems must be >= 1, got {self.eval_n}, {self.eval_problems}")


def _write_json(path: Path, obj) -> None:
    atomic_write(path, lambda f: f.write(json.dumps(obj, indent=2).encode("utf-8")))


def run_dir(root: Path, method: str, seed: int, stage: str) -> Path:
    return root / "train" / method_dir(method) / f"seed{seed}" / stage


def eval_dir(root: Path, method: str, seed: int, where: str = "eval") -> Path:
    """``where``: ``eval`` (the held-out test split) or ``eval_train`` (the training pools)."""
    return root / where / method_dir(method) / f"seed{seed}"


def is_finished_run(path: Path) -> bool:
    """A training run is finished once its summary.json (written last, atomically) exists."""
    return (path / "summary.json").is_file()


def is_finished_eval(path: Path) -> bool:
    return (path / "results.json").is_file()


def stages(s: StudySettings) -> tuple[str, ...]:
    return ("A", "B") if s.steps_b else ("A",)


def pending_runs(root: Path, s: StudySettings, stage: str) -> list[tuple[str, int]]:
    return [(m, k) for m in s.methods for k in s.seeds if not is_finished_run(run_dir(root, m, k, stage))]


def _eval_jobs(s: StudySettings) -> list[tuple[str, int]]:
    return [(WARM_START, 0)] + [(m, k) for m in s.methods for k in s.seeds]


def pending_evals(root: Path, s: StudySettings, where: str = "eval") -> list[tuple[str, int]]:
    return [(m, k) for m, k in _eval_jobs(s) if not is_finished_eval(eval_dir(root, m, k, where))]


def _study_overrides(s: StudySettings) -> list[str]:
    return [f"study.steps_a={s.steps_a}", f"study.steps_b={s.steps_b}",
            f"study.pool_l1={s.pool_l1}", f"study.pool_l2={s.pool_l2}", *s.overrides]


def train_command(root: Path, s: StudySettings, stage: str, jobs: list[tuple[str, int]]) -> list[list[str]]:
    """One ``medsrl-train -m`` per method (its pending seeds), for one stage."""
    commands = []
    for method in dict.fromkeys(m for m, _ in jobs):
        seeds = ",".join(str(k) for m, k in jobs if m == method)
        where = root / "train" / method_dir(method)
        cmd = [
            *_PYTHON_M, "medsrl.train", "-m",
            f"experiment=study_{method_base(method)}",
            f"seed={seeds}",
            *_study_overrides(s),
            *method_overrides(method),
            "skip_if_done=true",
            "logger=tensorboard",
            f"hydra.sweep.dir={where}",
            f"hydra.sweep.subdir=seed${{seed}}/{stage}",
        ]
        if stage == "B":
            cmd += [
                f"trainer.max_steps={s.steps_a + s.steps_b}",
                f"ckpt_path={where}/seed${{seed}}/A/checkpoints/last.ckpt",
                "resume_mode=full",
            ]
        commands.append(cmd)
    return commands


def eval_command(root: Path, s: StudySettings, jobs: list[tuple[str, int]], where: str = "eval") -> list[str]:
    """One ``medsrl-eval -m`` over the pending evaluations of trained policies, each writing to
    ``<where>/<method>/seed<k>`` (``study_run=<method>/seed<k>``)."""
    return [
        *_PYTHON_M, "medsrl.eval", "-m",
        "+study_run=" + ",".join(f"{method_dir(m)}/seed{k}" for m, k in jobs),
        f"model_path={root / 'train'}/${{study_run}}/{stages(s)[-1]}/policy",
        *eval_overrides(s, split="train" if where == "eval_train" else "test"),
        f"hydra.sweep.dir={root / where}",
        "hydra.sweep.subdir=${study_run}",
    ]


def warm_start_eval_command(out: Path, s: StudySettings, warm_start: Path, split: str) -> list[str]:
    """``medsrl-eval`` of the warm-started policy into ``out`` (the check, and the start row)."""
    return [
        *_PYTHON_M, "medsrl.eval",
        f"model_path={{warm_start: {warm_start}}}",
        *eval_overrides(s, split=split),
        f"hydra.run.dir={out}",
    ]


def eval_overrides(s: StudySettings, split: str) -> list[str]:
    """The study benchmark: ``eval_problems`` per level of ``split``; of ``train``, the whole
    training pools (the problems the policy, and MEDS's memory, trained on)."""
    # HF generate, as the runs trained: the CPU-scale policies need no engine (and a GPU with vLLM
    # installed would otherwise pick it)
    out = ["benchmark=study", "rollout=hf", f"n={s.eval_n}", "max_new_tokens=80", "batch_size=128"]
    for level, pool in ((1, s.pool_l1), (2, s.pool_l2)):
        if level not in s.levels:
            out.append(f"~benchmark.study_l{level}")
            continue
        num = pool if split == "train" else s.eval_problems
        out += [f"benchmark.study_l{level}.num={num}", f"benchmark.study_l{level}.split={split}"]
    return out + s.eval_overrides


def _run(cmd: list[str]) -> None:
    print("[study] $", shlex.join(cmd), flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env)
    if done.returncode != 0:
        raise SystemExit(
            f"[study] failed (exit {done.returncode}): {shlex.join(cmd)}\n"
            "Fix the cause and run the same command again: finished runs are kept and skipped."
        )


def warm_start_dir(s: StudySettings) -> Path:
    """Build (or find) the study's cached warm start, as a training run would."""
    from medsrl.plan.cli import compose_train_config
    from medsrl.run_config import RunConfig
    from medsrl.warmstart import warm_started

    cfg = compose_train_config([f"experiment=study_{method_base(s.methods[0])}", *_study_overrides(s)])
    return Path(warm_started(RunConfig.parse(cfg).model, cfg.paths.cache_dir).name_or_path)


def write_error_modes(eval_out: Path) -> dict:
    """error_modes.json next to an evaluation's generations (the study task's error figures)."""
    from studies.error_modes import error_mode_report

    records = [json.loads(line) for line in (eval_out / "generations.jsonl").read_text().splitlines() if line.strip()]
    report = error_mode_report(records)
    _write_json(eval_out / "error_modes.json", report)
    return report


def precheck(root: Path, s: StudySettings, warm_start: Path) -> dict:
    """The warm start on the val split: its error modes, before any RL (the task's check)."""
    out = root / "precheck"
    if not is_finished_eval(out):
        _run(warm_start_eval_command(out, s, warm_start, split="val"))
    return write_error_modes(out)  # recomputed from the generations on every call (cheap)


def _machine() -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{platform.machine()}, {cores} cores, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}")


def _commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def open_study(root: Path, s: StudySettings) -> dict:
    """study.json: created on the first call, checked against the settings on later ones."""
    path = root / "study.json"
    wanted = asdict(s)
    if path.is_file():
        meta = json.loads(path.read_text())
        # a setting added since that root was made counts as its default there
        old = {**asdict(StudySettings()), **meta.get("settings", {})}
        if old != wanted:
            diff = sorted(k for k in wanted if old.get(k) != wanted[k])
            raise SystemExit(
                f"[study] {root} holds a study made with other settings ({', '.join(diff)}); "
                "use another --name, or delete that directory to start over"
            )
    else:
        meta = {
            "settings": wanted,
            "created": time.strftime("%Y-%m-%d %H:%M:%S"),
            "timings_s": {},
            "commit": _commit(),  # the code the runs were made with; later calls add report_commit
        }
    meta.update(
        name=s.name, methods=[{"name": method_dir(m), "label": method_label(m)} for m in s.methods],
        seeds=s.seeds, steps_a=s.steps_a, steps_b=s.steps_b, eval_n=s.eval_n,
        baseline="dapo", treatment="meds", report_commit=_commit(), machine=_machine(),
    )
    root.mkdir(parents=True, exist_ok=True)
    _write_json(path, meta)
    return meta


@contextlib.contextmanager
def _timed(root: Path, phase: str) -> Iterator[None]:
    """Add the block's seconds to ``timings_s[phase]`` of study.json."""
    t0 = time.perf_counter()
    yield
    path = root / "study.json"
    meta = json.loads(path.read_text())
    timings = meta.setdefault("timings_s", {})
    timings[phase] = round(timings.get(phase, 0.0) + time.perf_counter() - t0, 1)
    _write_json(path, meta)


def _evaluate(root: Path, s: StudySettings, warm_start: Path, where: str = "eval") -> None:
    """The warm start and every final policy evaluated into ``<where>/`` (``eval``: the test
    split, ``eval_train``: the training pools), then their error modes."""
    split = "train" if where == "eval_train" else "test"
    jobs = pending_evals(root, s, where)
    if (WARM_START, 0) in jobs:
        _run(warm_start_eval_command(eval_dir(root, WARM_START, 0, where), s, warm_start, split))
    trained = [job for job in jobs if job[0] != WARM_START]
    if trained:
        _run(eval_command(root, s, trained, where=where))
    for m, k in _eval_jobs(s):
        write_error_modes(eval_dir(root, m, k, where))


def run_study(root: Path, s: StudySettings) -> None:
    """Every phase in order; each skips what an earlier call finished."""
    s.check()
    open_study(root, s)

    with _timed(root, "warm_start_and_precheck"):
        warm_start = warm_start_dir(s)
        trap = precheck(root, s, warm_start)["trap"]
    print(
        f"[study] warm start on val traps: accuracy {trap['accuracy']:.3f}, "
        f"shortcut share of wrong answers {trap['shortcut_share']:.3f}, "
        f"largest error cluster {trap['largest_cluster_share']:.3f}",
        flush=True,
    )

    for stage in stages(s):
        with _timed(root, f"train_{stage}"):
            for cmd in train_command(root, s, stage, pending_runs(root, s, stage)):
                _run(cmd)
    wheres = ("eval", "eval_train") if s.eval_train else ("eval",)
    for where in wheres if s.evaluate else ():
        with _timed(root, where):
            _evaluate(root, s, warm_start, where)


def audit_part(root: Path, part: dict) -> None:
    """An audit part (v3's D1): its training run, which keeps its checkpoints, then the audit."""
    if not is_finished_run(root / "train"):  # as a study: a summary means done
        _run([*_PYTHON_M, "medsrl.train", *part["train"], "skip_if_done=true", "logger=tensorboard",
              f"hydra.run.dir={root / 'train'}"])
    if not (root / "audit" / "audit.json").is_file():
        _run([*_PYTHON_M, "studies.audit", str(root / "train"), "--out", str(root / "audit"), *part["audit"]])


def load_protocol(name: str | None) -> dict:
    """``studies/protocols/<name>.yaml`` or a YAML file, its doc and figure paths from the
    repository root; ``None``: one study of the default settings."""
    if name is None:
        return {"parts": [{"name": StudySettings.name}]}
    path = Path(name) if name.endswith((".yaml", ".yml")) else PROTOCOLS / f"{name}.yaml"
    protocol = yaml.safe_load(path.read_text())
    return {**protocol, **{k: ROOT / protocol[k] for k in ("doc", "img_dir") if k in protocol}}


def part_settings(part: dict, given: dict, memory: list[str] | None = None) -> StudySettings:
    """A study part's settings: the protocol's, then the command line's (``given``; its Hydra
    overrides added to the part's). ``{memory}`` in a method: D1's chosen memory settings."""
    fields = {k: v for k, v in part.items() if k in StudySettings.__dataclass_fields__}
    if memory is not None:  # an empty choice (the reference memory) leaves no empty item
        fields["methods"] = [m.format(memory=",".join(memory)).replace("@,", "@") for m in fields["methods"]]
    lists = {k: [*fields.get(k, []), *given.get(k, [])] for k in ("overrides", "eval_overrides")}
    return StudySettings(**{**fields, **given, **lists})


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(the options, the Hydra overrides)``: a ``key=value`` word anywhere (not an option's
    ``--x=y``, not a method variant ``name@k=v``) is an override, so ``--seeds 3 4 5 key=value``
    does not hand ``key=value`` to ``--seeds``."""
    options, overrides = [], []
    for word in argv:
        head = word.split("=", 1)[0]
        if "=" in word and not word.startswith("-") and "@" not in head:
            overrides.append(word)
        else:
            options.append(word)
    return options, overrides


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m studies.runner", description=__doc__.split("\n\n")[0],
                                epilog="key=value words anywhere: Hydra overrides of every training run")
    names = sorted(f.stem for f in PROTOCOLS.glob("*.yaml"))
    p.add_argument("protocol", nargs="?", help=f"{', '.join(names)} or a YAML file; none: one study of the options")
    p.add_argument("--root", type=Path, default=ROOT / "logs" / "study", help="a part runs in <root>/<name>")
    p.add_argument("--name", help="another name for the part of a one-part protocol")
    p.add_argument("--methods", nargs="+", help=f"of {', '.join(METHODS)}; a variant: meds@alpha=1.0,beta=2.0")
    p.add_argument("--seeds", nargs="+", type=int)
    p.add_argument("--steps-a", type=int)
    p.add_argument("--steps-b", type=int)
    p.add_argument("--eval-n", type=int)
    p.add_argument("--eval-problems", type=int, help="test problems per level")
    p.add_argument("--pool-l1", type=int, help="training problems of level 1")
    p.add_argument("--pool-l2", type=int, help="training problems of level 2 (stage B)")
    p.add_argument("--eval-train", action="store_true", default=None, help="also evaluate on the training pools")
    p.add_argument("--levels", nargs="+", type=int, help="benchmark levels to evaluate")
    p.add_argument("--no-eval", dest="evaluate", action="store_false", default=None,
                   help="train only (the mechanism, from the curves)")
    p.add_argument("--eval-override", action="append", default=[], dest="eval_overrides",
                   help="a Hydra override of every medsrl-eval (the task's options), repeatable")
    p.add_argument("--doc", type=Path, help="the Markdown to update (the protocol's, else <root>/<name>/STUDY.md)")
    p.add_argument("--img-dir", type=Path)
    args, overrides = split_overrides(sys.argv[1:] if argv is None else list(argv))
    a = p.parse_args(args)
    protocol = load_protocol(a.protocol)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if "threads" in protocol else ():
        os.environ.setdefault(var, str(protocol["threads"]))  # before torch is imported, for every child too
    parts = protocol["parts"]
    if a.name:
        if len(parts) != 1:
            raise SystemExit(f"[study] --name renames the part of a one-part protocol; {a.protocol} has {len(parts)}")
        parts = [{**parts[0], "name": a.name}]
    given = {k: v for k, v in vars(a).items() if k in StudySettings.__dataclass_fields__ and v is not None}
    given["overrides"] = overrides
    # the warm start trains in this process for ~10 minutes: show its progress lines
    logging.basicConfig(level=logging.INFO, format="[study] %(message)s", force=True)
    root = a.root.resolve()
    base = root / parts[0]["name"] if len(parts) == 1 else root
    doc = a.doc or protocol.get("doc") or base / "STUDY.md"
    img_dir = a.img_dir or protocol.get("img_dir") or (doc.parent / "img" / "study" if a.doc else base / "img")
    if not doc.exists():
        doc.parent.mkdir(parents=True, exist_ok=True)
        title = parts[0]["name"] if len(parts) == 1 else Path(a.protocol).stem
        doc.write_text(f"# Study {title}\n\n<!-- study-results:begin -->\n<!-- study-results:end -->\n")
    from studies.audit import kept_memory  # imports torch: after the threads are set

    t0 = time.perf_counter()
    memory = None
    for part in (part for part in parts if part.get("run", True)):
        if "audit" in part:
            audit_part(root / part["name"], part)
            name, memory = kept_memory(root / part["name"])
            print(f"[study] {part['name']} chose the memory {name!r}: {memory}", flush=True)
        else:
            run_study(root / part["name"], part_settings(part, given, memory))
    from studies.report import write_report  # matplotlib and the analyses: only now

    write_report(root, doc, img_dir, parts)
    print(f"[study] done in {time.perf_counter() - t0:.0f} s: {doc}", flush=True)


if __name__ == "__main__":
    main()
