"""How often a policy repeats the same wrong answer on the study task, from graded samples.

On a *trap* of the study task (``medsrl.data.precedence``) the left-to-right shortcut gives the
same wrong answer in every sample that takes it. ``error_mode_report`` reads ``medsrl-eval``'s
``generations.jsonl`` records and says how much of a policy's error is that one mode, for traps
and other problems apart:

* ``accuracy``: mean score of all samples;
* ``shortcut_share``: of the wrong samples of traps, the share whose answer is the shortcut's;
* ``top_wrong_share``: per problem with a wrong sample, the most frequent wrong answer's share
  of the wrong samples (1.0 = every error is the same answer), averaged;
* ``distinct_wrong``: distinct wrong answers per problem;
* ``wrong_per_problem``: wrong samples per problem;
* ``largest_cluster_share`` and ``largest_cluster_size``: what MEDS's memory sees - per problem
  with 2 or more wrong samples with features, the largest of their clusters as MEDS fits them
  (share and size, averaged; ``nan`` without features). The size is what MEDS's penalty grows
  with; the share alone flatters a problem with one or two errors.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from medsrl.data.precedence import is_trap, shortcut_answer
from medsrl.evaluation.tables import md_row
from medsrl.features.clustering import fit_cluster_labels
from studies.stats import format_mean_std, mean_std

GROUPS = ("trap", "other")
_MEANS = ("accuracy", "shortcut_share", "top_wrong_share", "distinct_wrong", "wrong_per_problem",
          "largest_cluster_share", "largest_cluster_size")  # averaged, in the report's order


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if values else math.nan


def _largest_cluster(features: list[Any]) -> tuple[float, int] | None:
    """(share, size) of the largest cluster of the wrong samples' feature rows."""
    rows = [f for f in features if f is not None]
    if len(rows) < 2:
        return None
    x = np.asarray(rows, dtype=np.float64)
    x = x[np.isfinite(x).all(axis=1)]
    if len(x) < 2:
        return None
    counts = Counter(fit_cluster_labels(x, min_cluster_size=2, min_samples=1).tolist())
    return max(counts.values()) / len(x), max(counts.values())


def error_mode_report(
    records: Iterable[dict[str, Any]], *, features: bool = True
) -> dict[str, dict[str, float]]:
    """``{"trap": {...}, "other": {...}}`` of the figures in the module docstring, plus
    ``problems`` and ``samples`` per group. ``features=False`` skips the clustering."""
    acc: dict[str, dict[str, list[float]]] = {g: defaultdict(list) for g in GROUPS}
    for rec in records:
        trap = is_trap(rec["problem"])
        group = acc["trap" if trap else "other"]
        answers = [r.get("extracted") for r in rec["responses"]]
        scores = [float(r["score"]) for r in rec["responses"]]
        wrong = [a for a, s in zip(answers, scores, strict=True) if s < 1.0]
        group["samples"].append(float(len(scores)))
        group["accuracy"].extend(scores)
        group["distinct_wrong"].append(float(len(set(wrong))))
        group["wrong_per_problem"].append(float(len(wrong)))
        if wrong:
            group["top_wrong_share"].append(Counter(wrong).most_common(1)[0][1] / len(wrong))
        if trap:  # the other group's shortcut share stays nan
            short = shortcut_answer(rec["problem"])
            group["shortcut_share"].extend(float(a == short) for a in wrong)
        if features:
            wrong_feats = [r.get("feature") for r in rec["responses"] if float(r["score"]) < 1.0]
            largest = _largest_cluster(wrong_feats)
            if largest is not None:
                group["largest_cluster_share"].append(largest[0])
                group["largest_cluster_size"].append(float(largest[1]))
    return {
        g: {
            "problems": float(len(v["samples"])),
            "samples": float(sum(v["samples"])),
            **{key: _mean(v[key]) for key in _MEANS},
        }
        for g, v in acc.items()
    }


COLUMNS = (  # (group, key, label, scale) of the error-mode tables
    ("trap", "accuracy", "trap accuracy (%)", 100.0),
    ("other", "accuracy", "other accuracy (%)", 100.0),
    ("trap", "shortcut_share", "shortcut share of trap errors (%)", 100.0),
    ("trap", "top_wrong_share", "top wrong answer share, traps (%)", 100.0),
    ("trap", "distinct_wrong", "distinct wrong, traps", 1.0),
    ("trap", "largest_cluster_share", "largest error cluster share, traps (%)", 100.0),
    ("trap", "largest_cluster_size", "largest error cluster size, traps", 1.0),
)


def seed_reports(root: Path, where: str, method: str, seeds: Iterable[int]) -> list[dict]:
    """The ``<where>/<method>/seed<k>/error_modes.json`` of each seed that has one."""
    paths = (Path(root) / where / method / f"seed{k}" / "error_modes.json" for k in seeds)
    return [json.loads(p.read_text()) for p in paths if p.is_file()]


def seed_cell(values: list[float | None], scale: float) -> str:
    """Mean ± std over seeds of the finite values (``stats.format_mean_std``)."""
    return format_mean_std(*mean_std([v for v in values if v is not None]), scale)


def render_error_modes(root, methods: list[tuple[str, str]], seeds: list[int]) -> list[str]:
    """Markdown lines: the warm start's error modes before the study (val split) and every
    method's after it (test split), mean ± std over seeds; ``methods`` is ``[(name, label)]``."""
    root = Path(root)
    out = ["### Error modes: the planted shortcut", ""]
    pre_path = root / "precheck" / "error_modes.json"
    if pre_path.is_file():
        pre = json.loads(pre_path.read_text())
        t, o = pre["trap"], pre["other"]
        out += [
            "Checked before the study, on the warm start (val split, "
            f"{int(t['problems'])} traps and {int(o['problems'])} other problems, "
            f"{int((t['samples'] + o['samples']) / max(1.0, t['problems'] + o['problems']))} samples each): "
            f"accuracy {100 * t['accuracy']:.1f} % on traps and {100 * o['accuracy']:.1f} % on the others; "
            f"**{100 * t['shortcut_share']:.1f} % of the wrong answers on traps are the shortcut's answer**; "
            f"the most frequent wrong answer of a problem is {100 * t['top_wrong_share']:.1f} % of its wrong "
            f"answers on traps against {100 * o['top_wrong_share']:.1f} % on the others; "
            f"{t['distinct_wrong']:.2f} against {o['distinct_wrong']:.2f} distinct wrong answers per problem "
            f"(of {t.get('wrong_per_problem', math.nan):.1f} against "
            f"{o.get('wrong_per_problem', math.nan):.1f} wrong samples); "
            f"and in MEDS's clustering of the wrong answers' features the largest cluster holds "
            f"{100 * t['largest_cluster_share']:.1f} % of them on traps against "
            f"{100 * o['largest_cluster_share']:.1f} % on the others, "
            f"{t.get('largest_cluster_size', math.nan):.1f} against "
            f"{o.get('largest_cluster_size', math.nan):.1f} samples "
            "(shares of one or two wrong samples are high by construction; MEDS's penalty grows with the size).",
            "",
        ]
    else:
        out += ["No error-mode check of the warm start found (precheck/error_modes.json).", ""]
    out += [
        f"After the study, on the test split (mean ± std over {len(seeds)} seed(s); the warm start is one policy):",
        "",
        md_row(["method", *(c[2] for c in COLUMNS)]),
        "|" + "---|" * (len(COLUMNS) + 1),
    ]
    rows = [("warm_start", "warm start", [0])] + [(m, label, seeds) for m, label in methods]
    for name, label, row_seeds in rows:
        reports = seed_reports(root, "eval", name, row_seeds)
        if not reports:
            continue
        cells = [seed_cell([r[g][key] for r in reports], scale) for g, key, _, scale in COLUMNS]
        out.append(md_row([label, *cells]))
    out.append("")
    return out
