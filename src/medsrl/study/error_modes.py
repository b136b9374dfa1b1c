"""How often a policy repeats the same wrong answer on the study task, from graded samples.

The study task (``medsrl.data.precedence``) plants one recurring error: on a *trap* the
left-to-right shortcut gives a wrong answer that is the same in every sample that takes it.
``error_mode_report`` reads evaluation records (``medsrl-eval``'s ``generations.jsonl`` lines:
``problem``, ``gold`` and ``responses`` with ``extracted``, ``score`` and ``feature``) and says
how much of a policy's error is that one mode, for traps and other problems apart:

* ``accuracy``: mean score of all samples;
* ``shortcut_share``: of the wrong samples of traps, the share whose answer is the shortcut's;
* ``top_wrong_share``: per problem with a wrong sample, the most frequent wrong answer's share
  of the wrong samples (1.0 = every error is the same answer), averaged;
* ``distinct_wrong``: distinct wrong answers per problem;
* ``wrong_per_problem``: wrong samples per problem;
* ``largest_cluster_share`` and ``largest_cluster_size``: what MEDS's memory sees - per problem
  with at least 2 wrong samples with features, the HDBSCAN clusters of their features (as MEDS
  fits them, noise together as one cluster), and the largest cluster's share of them and its
  size in samples, averaged. ``nan`` without features. The size is what MEDS's penalty grows
  with (``alpha * log(|C| + 1)``); the shares alone flatter a problem with one or two errors,
  which are trivially "concentrated".
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from medsrl.data.precedence import is_trap, shortcut_answer
from medsrl.methods.meds.clustering import fit_cluster_labels

GROUPS = ("trap", "other")


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
    acc: dict[str, dict[str, list[float]]] = {g: {} for g in GROUPS}
    for rec in records:
        trap = is_trap(rec["problem"])
        group = acc["trap" if trap else "other"]
        answers = [r.get("extracted") for r in rec["responses"]]
        scores = [float(r["score"]) for r in rec["responses"]]
        wrong = [a for a, s in zip(answers, scores, strict=True) if s < 1.0]
        group.setdefault("problems", []).append(1.0)
        group.setdefault("samples", []).append(float(len(scores)))
        group.setdefault("accuracy", []).extend(scores)
        group.setdefault("distinct_wrong", []).append(float(len({a for a in wrong})))
        group.setdefault("wrong_per_problem", []).append(float(len(wrong)))
        if wrong:
            group.setdefault("top_wrong_share", []).append(
                Counter(wrong).most_common(1)[0][1] / len(wrong)
            )
        if trap:
            short = shortcut_answer(rec["problem"])
            group.setdefault("shortcut_share", []).extend(float(a == short) for a in wrong)
        if features:
            wrong_feats = [r.get("feature") for r in rec["responses"] if float(r["score"]) < 1.0]
            largest = _largest_cluster(wrong_feats)
            if largest is not None:
                group.setdefault("largest_cluster_share", []).append(largest[0])
                group.setdefault("largest_cluster_size", []).append(float(largest[1]))
    out: dict[str, dict[str, float]] = {}
    for g in GROUPS:
        values = acc[g]
        out[g] = {
            "problems": float(len(values.get("problems", []))),
            "samples": float(sum(values.get("samples", []))),
            "accuracy": _mean(values.get("accuracy", [])),
            "shortcut_share": _mean(values.get("shortcut_share", [])) if g == "trap" else math.nan,
            "top_wrong_share": _mean(values.get("top_wrong_share", [])),
            "distinct_wrong": _mean(values.get("distinct_wrong", [])),
            "wrong_per_problem": _mean(values.get("wrong_per_problem", [])),
            "largest_cluster_share": _mean(values.get("largest_cluster_share", [])),
            "largest_cluster_size": _mean(values.get("largest_cluster_size", [])),
        }
    return out


# ----------------------------------------------------------------------------- report section

_COLUMNS = (
    ("trap", "accuracy", "trap accuracy (%)", 100.0),
    ("other", "accuracy", "other accuracy (%)", 100.0),
    ("trap", "shortcut_share", "shortcut share of trap errors (%)", 100.0),
    ("trap", "top_wrong_share", "top wrong answer share, traps (%)", 100.0),
    ("trap", "distinct_wrong", "distinct wrong, traps", 1.0),
    ("trap", "largest_cluster_share", "largest error cluster share, traps (%)", 100.0),
    ("trap", "largest_cluster_size", "largest error cluster size, traps", 1.0),
)


def _read(path) -> dict | None:
    import json
    from pathlib import Path

    p = Path(path)
    return json.loads(p.read_text()) if p.is_file() else None


def _cell(values: list[float], scale: float) -> str:
    vals = [v * scale for v in values if v == v]
    if not vals:
        return "-"
    if len(vals) == 1:
        return f"{vals[0]:.1f}" if scale != 1.0 else f"{vals[0]:.2f}"
    mean, std = float(np.mean(vals)), float(np.std(vals, ddof=1))
    return f"{mean:.1f} ± {std:.1f}" if scale != 1.0 else f"{mean:.2f} ± {std:.2f}"


def render_error_modes(root, methods: list[tuple[str, str]], seeds: list[int]) -> list[str]:
    """Markdown lines: the warm start's error modes before the study (val split) and every
    method's after it (test split), mean ± std over seeds; ``methods`` is ``[(name, label)]``."""
    from pathlib import Path

    root = Path(root)
    out = ["### Error modes: the planted shortcut", ""]
    pre = _read(root / "precheck" / "error_modes.json")
    if pre is not None:
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
            f"(of {t.get('wrong_per_problem', math.nan):.1f} against {o.get('wrong_per_problem', math.nan):.1f} wrong samples); "
            f"and in MEDS's clustering of the wrong answers' features the largest cluster holds "
            f"{100 * t['largest_cluster_share']:.1f} % of them on traps against "
            f"{100 * o['largest_cluster_share']:.1f} % on the others, "
            f"{t.get('largest_cluster_size', math.nan):.1f} against {o.get('largest_cluster_size', math.nan):.1f} samples "
            "(shares of one or two wrong samples are high by construction; MEDS's penalty grows with the size).",
            "",
        ]
    else:
        out += ["No error-mode check of the warm start found (precheck/error_modes.json).", ""]
    header = "| method | " + " | ".join(c[2] for c in _COLUMNS) + " |"
    out += [
        f"After the study, on the test split (mean ± std over {len(seeds)} seed(s); the warm start is one policy):",
        "",
        header,
        "|" + "---|" * (len(_COLUMNS) + 1),
    ]
    rows = [("warm_start", "warm start", [0])] + [(m, label, seeds) for m, label in methods]
    for name, label, row_seeds in rows:
        reports = [_read(root / "eval" / name / f"seed{k}" / "error_modes.json") for k in row_seeds]
        reports = [r for r in reports if r is not None]
        if not reports:
            continue
        cells = [_cell([r[g][key] for r in reports], scale) for g, key, _, scale in _COLUMNS]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    out.append("")
    return out
