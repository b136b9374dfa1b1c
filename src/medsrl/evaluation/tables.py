"""Benchmark summary rows (per run and benchmark: pass@k, mean@n, maj@n, diversity means), written
atomically as Markdown / CSV / JSON tables and a pass@k plot.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from medsrl.evaluation.diversity import DIVERSITY_KEYS, problem_diversity
from medsrl.evaluation.passk import default_ks, majority_vote_correct, mean_pass_at_k
from medsrl.utils.atomic_file import atomic_write, atomic_write_text

AVERAGE = "average"  # benchmark name of the per-run macro-average row
_ID_COLUMNS = ("run", "benchmark", "problems", "n")
PERCENT_PREFIXES = ("pass@", "mean@", "maj@")  # columns shown in percent

Row = dict[str, Any]


def summarize_benchmark(run: str, benchmark: str, answers: Sequence[Sequence[str | None]],
                        scores: Sequence[Sequence[float]], features: Sequence[np.ndarray | None] | None = None) -> Row:
    """One row from ``answers[p][i]`` / ``scores[p][i]`` of sample i of problem p (same n each)."""
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
    """Rows grouped by run, each run with >1 benchmark followed by its macro-``average`` row. Idempotent."""
    rows = [r for r in rows if r["benchmark"] != AVERAGE]
    out: list[Row] = []
    for run in dict.fromkeys(r["run"] for r in rows):
        group = [r for r in rows if r["run"] == run]
        out += group
        if len(group) > 1:
            ns = {r["n"] for r in group}
            avg: Row = {"run": run, "benchmark": AVERAGE, "problems": sum(r["problems"] for r in group),
                        "n": ns.pop() if len(ns) == 1 else None}
            for col in _columns(group):
                if col not in _ID_COLUMNS and all(col in r for r in group):
                    avg[col] = float(np.mean([float(r[col]) for r in group]))
            out.append(avg)
    return out


def write_markdown(rows: Sequence[Row], path: str | os.PathLike) -> Path:
    """A paper-style table: accuracies in percent, ``-`` for ``nan``, no ``run`` column for one run."""
    rows = add_average_rows(rows)
    cols = _columns(rows)
    if len({r["run"] for r in rows}) == 1:
        cols.remove("run")
    rule = "|" + "|".join("---" if c in ("run", "benchmark") else "---:" for c in cols) + "|"
    lines = [md_row(cols), rule, *(md_row(_cell(c, r.get(c)) for c in cols) for r in rows)]
    return atomic_write_text(path, "\n".join(lines) + "\n")


def write_csv(rows: Sequence[Row], path: str | os.PathLike) -> Path:
    """Rows as CSV, columns in table order; missing values are empty, ``nan`` is ``nan``."""
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=_columns(rows), restval="")
    writer.writeheader()
    writer.writerows(rows)
    return atomic_write_text(path, text.getvalue())


def write_json(rows: Sequence[Row], path: str | os.PathLike) -> Path:
    """Rows as a JSON list; ``nan`` becomes ``null`` so that strict JSON parsers accept it."""
    return atomic_write_text(path, json.dumps(json_clean(list(rows)), indent=2, allow_nan=False) + "\n")


def plot_pass_at_k(rows: Sequence[Row], path: str | os.PathLike) -> Path:
    """PNG of pass@k, one line per (run, benchmark), ``average`` rows skipped."""
    plt = pyplot()
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
        pass_at_k_axes(ax, all_ks, "pass@k")
        ax.legend()
        return save_png(fig, path, dpi=150)
    finally:
        plt.close(fig)


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display; set before pyplot picks one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def pass_at_k_axes(ax, ks, title: str) -> None:
    """pass@k (%) against k on a log-2 axis, a tick at each k."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(ks), [str(k) for k in sorted(ks)])
    ax.minorticks_off()
    ax.set(xlabel="k", ylabel="pass@k (%)", title=title)
    ax.grid(alpha=0.3)


def save_png(fig, path: str | os.PathLike, dpi: int) -> Path:
    return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=dpi, bbox_inches="tight"), 0o644)


def md_row(cells: Iterable[Any]) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


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
    return f"{100 * v:.1f}" if col.startswith(PERCENT_PREFIXES) else f"{v:.2f}"


def _nanmean(values: Sequence[float]) -> float:
    """Mean of the finite values; ``nan`` (without numpy's warning) for none."""
    finite = [v for v in values if math.isfinite(v)]
    return float(np.mean(finite)) if finite else float("nan")


def json_clean(value: Any) -> Any:
    """nan / inf -> None and numpy scalars -> Python, so that strict JSON accepts the result."""
    if isinstance(value, dict):
        return {str(k): json_clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_clean(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    return None if isinstance(value, float) and not math.isfinite(value) else value
