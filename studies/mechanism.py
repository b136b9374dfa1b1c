"""What the shaping methods did to training, from their logged curves: the mechanism tables.

A reward-shaping method can fail to matter by hardly acting (an empty memory, few responses
penalised), by acting without changing the gradient much, or by acting in the wrong place (not
on the repeated mistake). Per method and stage, the means of the ``MECHANISM`` curves over the
stage's steps, then over seeds (docs/STUDY.md, study v2); the visits of the whole run come from
each run's last checkpoint (``prompt_visits``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from medsrl.evaluation.tables import md_row
from studies.collect import Study
from studies.error_modes import COLUMNS, seed_cell, seed_reports
from studies.stats import format_mean_std, mean_std

# (curve tag, column label, scale for printing: 100 = a percentage)
MECHANISM: tuple[tuple[str, str, float], ...] = (
    ("train/data/visits_mean", "visits of the step's prompts", 1.0),
    ("train/meds/entries_per_read", "memory entries per read", 1.0),
    ("train/meds/penalised_frac", "responses penalised (%)", 100.0),
    ("train/meds/order_changed_group_frac", "groups reordered (%)", 100.0),
    ("train/shaping/adv_change_frac", "advantage rewritten by shaping (%)", 100.0),
    ("train/meds/cluster_answer_purity", "error-cluster answer purity (%)", 100.0),
    ("train/meds/penalty_on_top_answer", "penalty on the top wrong answer (%)", 100.0),
    ("train/meds/top_answer_wrong_share", "top wrong answer's share of errors (%)", 100.0),
)
_DOSE_KEYS = ("accuracy", "shortcut_share", "top_wrong_share", "distinct_wrong")  # of the traps


def stage_mean(curve: tuple[np.ndarray, np.ndarray] | None, first: int, last: int | None) -> float:
    """The mean of a curve's non-NaN values at steps ``first <= step < last`` (NaN if none)."""
    if curve is None:
        return math.nan
    steps, values = curve
    keep = (steps >= first) & (steps < (last if last is not None else np.iinfo(np.int64).max))
    vals = values[keep & ~np.isnan(values)]
    return float(vals.mean()) if len(vals) else math.nan


def mechanism(study: Study) -> dict[str, dict[str, dict[str, float]]]:
    """``{method: {tag: {"A": mean, "B": mean}}}``: per stage the mean over steps, then the mean
    over the seeds that logged it; a tag no run of a method logged is left out."""
    a = study.steps_a or 0
    stages = {"A": (0, a), "B": (a, None)} if study.steps_b else {"A": (0, None)}
    out = {}
    for m in study.methods:
        runs = study.method_runs(m.name)
        out[m.name] = {
            tag: {stage: mean_std([stage_mean(r.curves.get(tag), first, last) for r in runs])[0]
                  for stage, (first, last) in stages.items()}
            for tag, _, _ in MECHANISM
            if any(tag in r.curves for r in runs)
        }
    return out


def visits_distribution(study: Study, method: str) -> dict[str, float] | None:
    """Min, median, mean and max visits per prompt and the prompts seen, from each seed's last
    checkpoint, averaged over seeds; ``None`` when no run has a checkpoint with the counts."""
    import torch

    per_seed = []
    for seed in study.seeds:
        for stage in ("B", "A"):
            path = study.root / "train" / method / f"seed{seed}" / stage / "checkpoints" / "last.ckpt"
            if path.exists():
                visits = torch.load(path, map_location="cpu", weights_only=False).get("prompt_visits")
                if visits:
                    v = np.array(list(visits.values()), dtype=float)
                    per_seed.append([v.min(), np.median(v), v.mean(), v.max(), len(v)])
                break
    if not per_seed:
        return None
    mean = np.mean(np.array(per_seed), axis=0)
    return dict(zip(("min", "median", "mean", "max", "prompts"), map(float, mean), strict=True))


def render_mechanism(study: Study) -> list[str]:
    """Markdown: the visits table and the mechanism table (nothing when no run logged them)."""
    table = mechanism(study)
    tags = [t for t in MECHANISM if any(t[0] in per for per in table.values())]
    if not tags:
        return []
    stages = "A / B" if study.steps_b else "the run"
    out = ["### The mechanism: how often shaping acted, and where", ""]
    visits = {m.name: visits_distribution(study, m.name) for m in study.methods}
    if any(visits.values()):
        out += [
            "Visits per prompt over the whole run (each seed's last checkpoint, averaged over seeds):",
            "",
            "| method | prompts sampled | min | median | mean | max |",
            "|---|---|---|---|---|---|",
        ]
        for m in study.methods:
            v = visits[m.name]
            if v is not None:
                out.append(f"| {m.label} | {v['prompts']:.0f} | {v['min']:.1f} | {v['median']:.1f} | "
                           f"{v['mean']:.1f} | {v['max']:.1f} |")
        out.append("")
    out += [
        f"Per stage ({stages}), the mean over the stage's steps, then over seeds ('-': not logged "
        "by that method):",
        "",
        md_row(["method", *(label for _, label, _ in tags)]),
        "|" + "---|" * (len(tags) + 1),
    ]
    for m in study.methods:
        per = table.get(m.name, {})
        cells = [" / ".join(format_mean_std(v, scale=scale) for v in per[tag].values())
                 if tag in per else "-" for tag, _, scale in tags]
        out.append(md_row([m.label, *cells]))
    out.append("")
    return out


def dose_response_rows(study: Study, agg: dict[str, Any], where: str = "eval") -> list[dict[str, Any]]:
    """Per method of the dose-response (the baseline and every MEDS variant), the error modes of
    its final policies (``<where>/<method>/seed<k>/error_modes.json``) and, for ``eval``, the
    headline pass@k from ``agg``; each a list over seeds."""
    names = [m.name for m in study.methods if m.name == study.baseline or _is_meds(m.name)]
    by_name = {m["name"]: m for m in agg.get("methods", [])}
    rows = []
    for name in names:
        reports = seed_reports(study.root, where, name, study.seeds)
        row = {"name": name, "label": study.label(name), "seeds": len(reports),
               **{key: [r["trap"][key] for r in reports] for key in _DOSE_KEYS}}
        if where == "eval" and name in by_name:
            for metric, summary in by_name[name]["metrics"].items():
                if metric.startswith("pass@"):
                    row[metric] = summary.get("values", [])
        rows.append(row)
    return rows


def _is_meds(name: str) -> bool:
    return name == "meds" or name.startswith("meds_") and not name.startswith("meds_r3")


def render_dose_response(study: Study, agg: dict[str, Any]) -> list[str]:
    """Markdown: the baseline beside every MEDS strength, on the test split and (when evaluated)
    on the training pools; the paired tests of pass@k are in the significance section."""
    if sum(_is_meds(m.name) for m in study.methods) < 2:
        return []
    out = ["### Dose-response: MEDS's strength against the error modes", ""]
    for where, title in (("eval", "the test split"), ("eval_train", "the training pools")):
        rows = [r for r in dose_response_rows(study, agg, where) if r["seeds"]]
        if not rows:
            continue
        ks = sorted({k for r in rows for k in r if k.startswith("pass@")}, key=lambda c: int(c[5:]))
        cols = [(key, label, scale) for group, key, label, scale in COLUMNS
                if group == "trap" and key in _DOSE_KEYS]
        cols += [(k, f"{k} (%)", 100.0) for k in (ks[:1] + ks[-1:] if len(ks) > 1 else ks)]
        out += [f"On {title} (mean ± std over seeds):", "",
                md_row(["method", *(c[1] for c in cols)]), "|" + "---|" * (len(cols) + 1)]
        for r in rows:
            out.append(md_row([r["label"], *(seed_cell(r.get(key, []), scale) for key, _, scale in cols)]))
        out.append("")
    return out
