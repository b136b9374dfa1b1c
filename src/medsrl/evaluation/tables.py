"""Benchmark summary rows, written as Markdown / CSV / JSON tables and a pass@k plot.

The tidy format is a list of dicts, one per (run, benchmark), with the keys ``run``,
``benchmark``, ``problems``, ``n``, ``pass@1``, ``pass@2``, ..., ``mean@n``, ``maj@n`` and
``distinct_answers``, ``distinct_wrong``, ``eigen_ratio``, ``wrong_clusters``. Accuracies are
fractions in [0, 1]; diversity figures are per-problem means. Rows of runs with different ``n``
may carry different ``pass@k`` keys. Every file is written atomically (temp file in the same
directory, then ``os.replace``), so a reader never sees half a report.
"""

from __future__ import annotations

import csv
import json
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from medsrl.evaluation.diversity import DIVERSITY_KEYS, problem_diversity
from medsrl.evaluation.passk import default_ks, majority_vote_correct, mean_pass_at_k

AVERAGE = "average"  # benchmark name of the per-run macro-average row
_ID_COLUMNS = ("run", "benchmark", "problems", "n")
_PERCENT_PREFIXES = ("pass@", "mean@", "maj@")

Row = dict[str, Any]


def summarize_benchmark(
    run: str,
    benchmark: str,
    answers: Sequence[Sequence[str | None]],
    scores: Sequence[Sequence[float]],
    features: Sequence[np.ndarray | None] | None = None,
) -> Row:
    """One tidy row from the n graded samples of each problem of one benchmark.

    ``answers[p][i]`` / ``scores[p][i]``: extracted answer and score of sample i of problem p
    (correct = score 1); ``features[p]``: its [n, D] feature rows or ``None`` (see
    ``problem_diversity``). Every problem must have the same n. ``mean@n`` (the sampled accuracy)
    equals ``pass@1``: the unbiased pass@1 is c/n.
    """
    sizes = {len(s) for s in scores}
    if len(answers) != len(scores) or len(sizes) != 1:
        raise ValueError("need answers and scores for >= 1 problem, with the same n per problem")
    n = sizes.pop()
    counts = [sum(s >= 1.0 for s in per_problem) for per_problem in scores]
    row: Row = {"run": run, "benchmark": benchmark, "problems": len(scores), "n": n}
    row.update({f"pass@{k}": v for k, v in mean_pass_at_k(n, counts, default_ks(n)).items()})
    row["mean@n"] = float(np.mean(counts)) / n
    majority = [majority_vote_correct(a, s) for a, s in zip(answers, scores, strict=True)]
    row["maj@n"] = float(np.mean(majority))
    feats = [None] * len(scores) if features is None else features
    div = [problem_diversity(a, s, f) for a, s, f in zip(answers, scores, feats, strict=True)]
    row.update({key: _nanmean([d[key] for d in div]) for key in DIVERSITY_KEYS})
    return row


def add_average_rows(rows: Sequence[Row]) -> list[Row]:
    """Rows grouped by run, each run with >1 benchmark followed by an ``average`` row.

    The average is the macro mean over the run's benchmarks (each benchmark weighs the same,
    as in papers), so it is ``nan`` if any benchmark's value is; a column some benchmarks lack
    (pass@k for a larger k) is left out. ``problems`` is the total. Average rows already in
    ``rows`` are dropped first, so calling this twice changes nothing.
    """
    rows = [r for r in rows if r["benchmark"] != AVERAGE]
    out: list[Row] = []
    for run in dict.fromkeys(r["run"] for r in rows):
        group = [r for r in rows if r["run"] == run]
        out += group
        if len(group) > 1:
            ns = {r["n"] for r in group}
            total = sum(r["problems"] for r in group)
            avg: Row = {"run": run, "benchmark": AVERAGE, "problems": total}
            avg["n"] = ns.pop() if len(ns) == 1 else None
            for col in _columns(group):
                if col not in _ID_COLUMNS and all(col in r for r in group):
                    avg[col] = float(np.mean([float(r[col]) for r in group]))
            out.append(avg)
    return out


def write_markdown(rows: Sequence[Row], path: str | os.PathLike) -> Path:
    """A paper-style table: one line per (run, benchmark) plus each run's ``average`` line.

    pass@k, mean@n and maj@n in percent with 1 decimal, diversity with 2; ``-`` marks ``nan``.
    The ``run`` column is dropped when all rows share one run.
    """
    rows = add_average_rows(rows)
    cols = _columns(rows)
    if len({r["run"] for r in rows}) == 1:
        cols.remove("run")
    lines = [
        "| " + " | ".join(cols) + " |",
        "|" + "|".join("---" if c in ("run", "benchmark") else "---:" for c in cols) + "|",
    ]
    lines += ["| " + " | ".join(_cell(c, r.get(c)) for c in cols) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    return _atomic_write(path, lambda f: f.write(text))


def write_csv(rows: Sequence[Row], path: str | os.PathLike) -> Path:
    """Rows as CSV, columns in table order; missing values are empty, ``nan`` is ``nan``."""

    def write(f: IO) -> None:
        writer = csv.DictWriter(f, fieldnames=_columns(rows), restval="")
        writer.writeheader()
        writer.writerows(rows)

    return _atomic_write(path, write)


def write_json(rows: Sequence[Row], path: str | os.PathLike) -> Path:
    """Rows as a JSON list; ``nan`` becomes ``null`` so that strict JSON parsers accept it."""
    clean = [{k: _json_value(v) for k, v in r.items()} for r in rows]
    text = json.dumps(clean, indent=2, allow_nan=False) + "\n"
    return _atomic_write(path, lambda f: f.write(text))


def plot_pass_at_k(rows: Sequence[Row], path: str | os.PathLike) -> Path:
    """PNG of pass@k (%) against k on a log-2 axis, one line per (run, benchmark).

    Lines are labelled ``run / benchmark`` (just the benchmark when there is one run); ``average``
    rows are skipped, since their k may be a subset of the benchmarks' k.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display; must come before pyplot picks a backend
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["benchmark"] != AVERAGE]
    if not rows:
        raise ValueError("no (run, benchmark) rows to plot")
    one_run = len({r["run"] for r in rows}) == 1
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    try:
        all_ks: set[int] = set()
        for r in rows:
            ks = sorted(int(c.removeprefix("pass@")) for c in r if c.startswith("pass@"))
            all_ks.update(ks)
            label = r["benchmark"] if one_run else f"{r['run']} / {r['benchmark']}"
            ax.plot(ks, [100 * float(r[f"pass@{k}"]) for k in ks], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(all_ks), [str(k) for k in sorted(all_ks)])
        ax.minorticks_off()
        ax.set(xlabel="k", ylabel="pass@k (%)", title="pass@k")
        ax.grid(alpha=0.3)
        ax.legend()
        return _atomic_write(
            path, lambda f: fig.savefig(f, format="png", dpi=150, bbox_inches="tight"), binary=True
        )
    finally:
        plt.close(fig)


def _columns(rows: Sequence[Row]) -> list[str]:
    """Table column order: ids, pass@k by k, then the other keys in first-seen order."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    ids = [k for k in _ID_COLUMNS if k in keys]
    passk = sorted((k for k in keys if k.startswith("pass@")), key=lambda k: int(k[5:]))
    return ids + passk + [k for k in keys if k not in ids and k not in passk]


def _cell(col: str, value: Any) -> str:
    if value is None:
        return ""
    if col in _ID_COLUMNS:
        return str(value)
    v = float(value)
    if math.isnan(v):
        return "-"
    return f"{100 * v:.1f}" if col.startswith(_PERCENT_PREFIXES) else f"{v:.2f}"


def _nanmean(values: Sequence[float]) -> float:
    """Mean of the finite values; ``nan`` (without numpy's warning) when there are none."""
    finite = [v for v in values if math.isfinite(v)]
    return float(np.mean(finite)) if finite else float("nan")


def _json_value(v: Any) -> Any:
    if isinstance(v, np.generic):
        v = v.item()
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _atomic_write(path: str | os.PathLike, write: Callable[[IO], Any], binary=False) -> Path:
    """Run ``write(f)`` on a temp file next to ``path``, fsync it, then ``os.replace`` it there."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a report should be readable like any file
        text_args = {} if binary else {"encoding": "utf-8", "newline": ""}
        with os.fdopen(fd, "wb" if binary else "w", **text_args) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
