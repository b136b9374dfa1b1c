"""Read a study directory (the layout of ``studies.runner``) into plain data: eval rows,
per-problem samples and TensorBoard training curves.

Nothing here writes into the study: a study that is still running (or was stopped) is read as
it is, and what is absent or unfinished is listed in ``Study.missing``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from medsrl.evaluation.tables import AVERAGE, add_average_rows

STAGES = ("A", "B")
WARM_START = "warm_start"  # the starting point's folder under eval/ (studies.runner.WARM_START)
Curve = tuple[np.ndarray, np.ndarray]  # (steps int64 [T], values float64 [T]), sorted by step


@dataclass(frozen=True)
class Method:
    name: str  # directory name, e.g. "meds"
    label: str  # name in tables and legends, e.g. "MEDS"


@dataclass(frozen=True)
class Missing:
    """One part of the study that is absent or unfinished."""

    method: str
    seed: int
    part: str  # "train A", "train B" or "eval"
    reason: str

    def __str__(self) -> str:
        return f"{self.part} of {self.method} seed {self.seed}: {self.reason}"


@dataclass
class ProblemSamples:
    """The graded samples of one problem: score and extracted answer of each response."""

    scores: list[float]
    answers: list[str | None]


@dataclass
class RunData:
    """Everything read for one (method, seed)."""

    method: str
    seed: int
    rows: list[dict[str, Any]] = field(default_factory=list)  # per-benchmark eval rows
    summary: dict[str, Any] | None = None  # the "average" row, or the only row; None: no eval
    problems: dict[tuple[str, int], ProblemSamples] = field(default_factory=dict)
    curves: dict[str, Curve] = field(default_factory=dict)  # TensorBoard tag -> A and B merged
    stages: tuple[str, ...] = ()  # training stages that have TensorBoard events

    @property
    def has_eval(self) -> bool:
        return self.summary is not None


@dataclass
class Study:
    root: Path
    meta: dict[str, Any]
    name: str
    methods: list[Method]
    seeds: list[int]
    steps_a: int | None
    steps_b: int | None
    baseline: str | None
    treatment: str | None
    runs: dict[tuple[str, int], RunData]
    missing: list[Missing]
    notes: list[str]  # anything else worth saying (damaged lines, inferred settings)
    warm_start: RunData | None = None  # eval/warm_start/seed0 (the starting point), if evaluated

    def label(self, method: str) -> str:
        return next((m.label for m in self.methods if m.name == method), method)

    def method_runs(self, method: str) -> list[RunData]:
        """The runs of ``method`` in seed order (those with nothing at all are absent)."""
        return [self.runs[(method, s)] for s in self.seeds if (method, s) in self.runs]

    def evaluated(self, method: str) -> list[RunData]:
        return [r for r in self.method_runs(method) if r.has_eval]


def load_study(root: str | Path) -> Study:
    """Read everything under a study root (see the module docstring); never writes."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"no study directory at {root}")
    notes: list[str] = []
    meta = _read_meta(root, notes)
    methods = [_method(m) for m in meta.get("methods", [])]
    seeds = [int(s) for s in meta.get("seeds", [])]
    runs: dict[tuple[str, int], RunData] = {}
    missing: list[Missing] = []
    expected = STAGES if meta.get("steps_b") is None or int(meta["steps_b"]) > 0 else STAGES[:1]
    for m in methods:
        for seed in seeds:
            run = RunData(m.name, seed)
            for stage in expected:
                run_dir = root / "train" / m.name / f"seed{seed}" / stage
                found, reason = _stage_state(run_dir)
                if reason:
                    missing.append(Missing(m.name, seed, f"train {stage}", reason))
                if found:
                    run.stages += (stage,)
                    run.curves = merge_curves(run.curves, read_scalars(run_dir))
            eval_dir = root / "eval" / m.name / f"seed{seed}"
            reason = _read_eval(eval_dir, run, notes)
            if reason:
                missing.append(Missing(m.name, seed, "eval", reason))
            if run.stages or run.has_eval:
                runs[(m.name, seed)] = run
    return Study(
        root=root, meta=meta, name=str(meta.get("name", root.name)), methods=methods, seeds=seeds,
        steps_a=_opt_int(meta.get("steps_a")), steps_b=_opt_int(meta.get("steps_b")),
        baseline=meta.get("baseline"), treatment=meta.get("treatment"),
        runs=runs, missing=missing, notes=notes, warm_start=read_warm_start(root, notes),
    )


def read_warm_start(root: Path, notes: list[str] | None = None) -> RunData | None:
    """The warm start's evaluation (``eval/warm_start/seed0``: its rows and per-problem samples,
    from which protocol v4 picks its hard subset); ``None`` while it is absent or unfinished."""
    run = RunData(WARM_START, 0)
    return None if _read_eval(root / "eval" / WARM_START / "seed0", run, [] if notes is None else notes) else run


def _read_meta(root: Path, notes: list[str]) -> dict[str, Any]:
    """study.json, or (when it is absent) the methods and seeds found in the directories."""
    path = root / "study.json"
    if path.exists():
        return json.loads(path.read_text(encoding="utf-8"))
    subs = [root / sub for sub in ("train", "eval") if (root / sub).is_dir()]
    names = sorted({p.name for sub in subs for p in sub.iterdir() if p.is_dir()})
    seeds = sorted({int(m.group(1)) for sub in subs for p in sub.glob("*/seed*")
                    if (m := re.fullmatch(r"seed(\d+)", p.name))})
    notes.append(f"no study.json in {root}: methods and seeds taken from the directories")
    return {"name": root.name, "methods": [{"name": n, "label": n} for n in names], "seeds": seeds}


def _method(entry: Any) -> Method:
    if isinstance(entry, str):
        return Method(entry, entry)
    return Method(str(entry["name"]), str(entry.get("label", entry["name"])))


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _stage_state(run_dir: Path) -> tuple[bool, str]:
    """(has TensorBoard events, why it counts as missing or unfinished: "" when complete)."""
    if not run_dir.is_dir():
        return False, "no run directory"
    if not event_files(run_dir):
        return False, "no TensorBoard events"
    if not (run_dir / "summary.json").exists():
        return True, "no summary.json (unfinished?)"
    return True, ""


def event_files(run_dir: Path) -> list[Path]:
    """The TensorBoard event files of a run dir, oldest first (the name holds the start time)."""
    return sorted(Path(run_dir).glob("tensorboard/**/events.out.tfevents.*"))


def read_scalars(run_dir: str | Path) -> dict[str, Curve]:
    """Every scalar series of a run dir, ``{tag: (steps, values)}`` sorted by step, every event
    kept (no reservoir sampling); of several event files (a run restarted in its own directory),
    a later one wins on a step both logged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    merged: dict[str, Curve] = {}
    for path in event_files(Path(run_dir)):
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0}, purge_orphaned_data=False)
        acc.Reload()
        curves = {}
        for tag in acc.Tags().get("scalars", []):
            events = acc.Scalars(tag)
            curves[tag] = ([e.step for e in events], [e.value for e in events])
        merged = merge_curves(merged, curves)
    return merged


def merge_curves(first: dict[str, Curve], second: dict[str, Curve]) -> dict[str, Curve]:
    """Tag-wise union of two sets of series, sorted by step; ``second`` (and within a series a
    later event) wins on a shared step: B and A both log a validation at the switch step."""
    out = dict(first)
    for tag, (steps, values) in second.items():
        by_step: dict[int, float] = {}
        if tag in first:
            by_step.update(zip(first[tag][0].tolist(), first[tag][1].tolist(), strict=True))
        by_step.update(zip(np.asarray(steps).tolist(), np.asarray(values).tolist(), strict=True))
        order = sorted(by_step)
        out[tag] = (
            np.array(order, dtype=np.int64),
            np.array([by_step[s] for s in order], dtype=np.float64),
        )
    return out


def _read_eval(eval_dir: Path, run: RunData, notes: list[str]) -> str:
    """Fill ``run`` from a medsrl-eval output dir; returns why it is missing ("" when found)."""
    results = eval_dir / "results.json"
    if not results.exists():
        return "no eval directory" if not eval_dir.is_dir() else "no results.json (unfinished?)"
    try:
        rows = json.loads(results.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        return f"results.json is not valid JSON ({e.msg})"
    rows = [r for r in rows if isinstance(r, dict) and "benchmark" in r]
    run_names = list(dict.fromkeys(r.get("run", "") for r in rows))
    if not run_names:
        return "results.json has no rows"
    if len(run_names) > 1:
        notes.append(
            f"{results}: several runs {run_names}; only the first, {run_names[0]!r}, is used"
        )
    rows = [_clean_row(r) for r in rows if r.get("run", "") == run_names[0]]
    with_avg = add_average_rows(rows)  # results.json of medsrl-eval has no average rows
    run.rows = [r for r in with_avg if r["benchmark"] != AVERAGE]
    averages = [r for r in with_avg if r["benchmark"] == AVERAGE]
    run.summary = averages[0] if averages else run.rows[0]
    run.problems = read_generations(eval_dir / "generations.jsonl", run_names[0], notes)
    if not run.problems:
        notes.append(f"{eval_dir}: no generations.jsonl records, so no problem-level tests")
    return ""


def _clean_row(row: dict[str, Any]) -> dict[str, Any]:
    """JSON ``null`` (nan written by ``write_json``) back to nan, so averages stay nan."""
    return {k: (float("nan") if v is None else v) for k, v in row.items()}


def read_generations(
    path: str | Path, run: str | None = None, notes: list[str] | None = None
) -> dict[tuple[str, int], ProblemSamples]:
    """``{(benchmark, index): ProblemSamples}`` of ``run`` (default: every run) in a
    generations.jsonl. Unlike ``GenerationStore`` it never truncates (a report must not change its
    inputs) and skips a damaged line with a note; a torn last line is dropped, a later record wins.
    """
    path = Path(path)
    notes = [] if notes is None else notes
    out: dict[tuple[str, int], ProblemSamples] = {}
    if not path.exists():
        return out
    lines = path.read_bytes().split(b"\n")
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            last = all(not rest.strip() for rest in lines[lineno:])
            if not last:
                notes.append(f"{path}:{lineno}: not valid JSON, skipped")
            continue
        if run is not None and rec.get("run", "") != run:
            continue
        responses = rec.get("responses", [])
        out[(str(rec.get("benchmark", "")), int(rec["index"]))] = ProblemSamples(
            [float(r["score"]) for r in responses], [r.get("extracted") for r in responses]
        )
    return out
