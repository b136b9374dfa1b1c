"""The results of protocol v3 (docs/STUDY.md) as one Markdown block of ``docs/STUDY_V3.md``.

The gate first (G1-G4 per arm, ``methods/meds/gate.py``), then D1's audit table, D2's outcomes
(the study report's tables, the planted routes' shares of the trap errors, the pre-registered
verdict) and D3's placement table; the route analyses come from every trained-on response
(``samples.jsonl``) labelled by ``study/routes.py``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from medsrl.evaluation.tables import md_row
from medsrl.study.collect import Study, load_study
from medsrl.study.mechanism import stage_mean
from medsrl.study.stats import format_mean_std, format_p, mean_std, welch_t_test

GATE: tuple[tuple[str, str, float], ...] = (  # (curve tag, column, scale)
    ("train/meds/gate/g1_distinct_penalty_groups", "G1 groups with >= 2 distinct wrong penalties (%)", 100.0),
    ("train/meds/gate/g2_advantage_rewritten", "G2 advantage rewritten by MEDS (%)", 100.0),
    ("train/meds/gate/g3_top_answer_excess", "G3 penalty on the top wrong answer minus its share (pp)", 100.0),
    ("train/meds/gate/g4_size_recurrence_corr", "G4 size vs earlier count, Spearman", 1.0),
)
THRESHOLDS = {"g1": 0.25, "g2": 0.01, "g3": 0.0, "g4": 0.2}  # the protocol's gate, fixed before the runs
# D1's variants that are settings of the MEDS plug-in: (feature, store) -> its settings
FEATURE_SETTINGS = {"reference": [], "bf16": ["feature_dtype=bfloat16"], "diff": ["diff=true"],
                    "digits": ["feature_logits=digits"], "final_norm": ["final_norm=true"]}
STORE_SETTINGS = {"reference": [], "dedup": ["dedup=true"], "min_samples=2": ["min_samples=2"],
                  "min_samples=3": ["min_samples=3"]}


def chosen_memory(audit: dict) -> tuple[str, list[str]]:
    """The protocol's rule for D2's third arm, from D1's ``audit.json``: the feature-based
    variant with the highest G4 if its G4 >= 0.3 and G3 > 0, else the answer-keyed memory.
    Returns its name and its MEDS settings."""
    best = None
    for row in audit["variants"]:
        g3, g4 = row.get("G3"), row.get("G4")
        if row["store"] == "answer" or g3 is None or g4 is None:
            continue
        if g4 >= 0.3 and g3 > 0 and (best is None or g4 > best["G4"]):
            best = row
    if best is None:
        return "answer", ["mode=answer"]
    name = f"{best['feature']} feature, {best['store']} store"
    if best["feature"] not in FEATURE_SETTINGS or best["store"] not in STORE_SETTINGS:
        raise SystemExit(f"[study-v3] D1 chose {name!r}, which is not a MEDS plug-in setting; build it "
                         "as an option before D2 (docs/STUDY.md, protocol v3)")
    return name, FEATURE_SETTINGS[best["feature"]] + STORE_SETTINGS[best["store"]]


def run_means(study: Study, method: str, tag: str) -> list[float]:
    """Per seed, the mean of a curve over the run's steps (NaN where the run did not log it)."""
    return [stage_mean(r.curves.get(tag), 0, None) for r in study.method_runs(method)]


def d2_memory(root: Path) -> tuple[str, list[str]]:
    """D2's third-arm memory: made once by :func:`chosen_memory` from D1's ``audit.json`` and
    kept in ``v3_d1/choice.json``, so a later audit (a changed variant) cannot change the arm of
    a D2 that already ran."""
    path = Path(root) / "v3_d1" / "choice.json"
    if path.is_file():
        choice = json.loads(path.read_text())
        return choice["name"], list(choice["settings"])
    name, settings = chosen_memory(json.loads((Path(root) / "v3_d1" / "audit" / "audit.json").read_text()))
    path.write_text(json.dumps({"name": name, "settings": settings}, indent=2) + "\n")
    return name, settings


def gate_values(study: Study, method: str) -> dict[str, list[float]]:
    """``{"g1": per-seed means, ...}`` for an arm (empty lists for an arm without MEDS)."""
    out = {}
    for tag, _, _ in GATE:
        key = tag.rsplit("/", 1)[-1][:2]
        vals = [v for v in run_means(study, method, tag) if not math.isnan(v)]
        out[key] = vals
    return out


def gate_met(values: dict[str, list[float]]) -> bool | None:
    """The protocol's rule on the means over seeds; ``None`` for an arm that logged no gate."""
    means = {k: float(np.mean(v)) for k, v in values.items() if v}
    if len(means) < len(THRESHOLDS):
        return None
    return (means["g1"] >= THRESHOLDS["g1"] and means["g2"] >= THRESHOLDS["g2"]
            and means["g3"] > THRESHOLDS["g3"] and means["g4"] > THRESHOLDS["g4"])


def gate_table(study: Study, extra: Sequence[tuple[str, str, float]] = ()) -> list[str]:
    """One row per arm: G1-G4 (and ``extra`` curves), mean ± std over seeds, and the verdict."""
    cols = [*GATE, *extra]
    out = [md_row(["arm", *(label for _, label, _ in cols), "gate met"]),
           "|---|" + "---:|" * len(cols) + "---|"]
    for m in study.methods:
        cells = []
        for tag, _, scale in cols:
            vals = [v for v in run_means(study, m.name, tag) if not math.isnan(v)]
            cells.append(format_mean_std(*mean_std(vals), scale) if vals else "-")
        met = gate_met(gate_values(study, m.name))
        out.append(md_row([m.label, *cells, "-" if met is None else ("yes" if met else "no")]))
    return out


def read_samples(study: Study, method: str) -> list[list[dict[str, Any]]]:
    """Per seed, every trained-on response of the run (``samples.jsonl`` of its stages)."""
    out = []
    for seed in study.seeds:
        rows: list[dict[str, Any]] = []
        for stage in ("A", "B"):
            path = study.root / "train" / method / f"seed{seed}" / stage / "tensorboard" / "samples.jsonl"
            if path.is_file():
                rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        out.append(rows)
    return out


def label_routes(rows: list[dict[str, Any]]) -> list[str]:
    from medsrl.study.routes import route_of

    return [route_of(r["problem"], r["response"]) for r in rows]


def route_diversity_of(rows: list[dict[str, Any]]) -> tuple[float, float] | None:
    """(distinct routes per prompt within a step, distinct routes per prompt over the run)."""
    from medsrl.study.routes import route_diversity

    if not rows:
        return None
    routes = label_routes(rows)
    per: dict[int, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for r, route in zip(rows, routes, strict=True):
        per[int(r["step"])][r["key"]].append(route)
    return route_diversity({k: dict(v) for k, v in per.items()})


def visits_to_first_right(rows: list[dict[str, Any]]) -> tuple[float, int] | None:
    """Over traps with no right answer at their first visit (hard traps): the mean number of
    later visits until one is answered right (a trap never solved counts its visits + 1), and
    how many hard traps there were. Needs every group logged (a run without the DAPO filter)."""
    from medsrl.data.precedence import is_trap

    by_key: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    problem = {}
    for r in rows:
        by_key[r["key"]][int(r["step"])].append(float(r["reward"]) > 0.5)
        problem[r["key"]] = r["problem"]
    waits = []
    for key, visits in by_key.items():
        if not is_trap(problem[key]):
            continue
        steps = sorted(visits)
        if any(visits[steps[0]]):
            continue
        later = [any(visits[s]) for s in steps[1:]]
        waits.append(later.index(True) + 1 if True in later else len(later) + 1)
    return (float(np.mean(waits)), len(waits)) if waits else None


def samples_table(study: Study, hard_traps: bool) -> list[str]:
    """Route diversity of the trained-on responses, and (runs without the filter) the visits
    until a hard trap is first answered right; mean ± std over seeds."""
    head = ["arm", "routes per prompt within a step", "routes per prompt over the run"]
    if hard_traps:
        head += ["visits until a hard trap is answered right", "hard traps"]
    out = [md_row(head), "|---|" + "---:|" * (len(head) - 1)]
    for m in study.methods:
        seeds = read_samples(study, m.name)
        div = [d for d in (route_diversity_of(rows) for rows in seeds) if d is not None]
        if not div:
            continue
        cells = [format_mean_std(*mean_std([d[0] for d in div])),
                 format_mean_std(*mean_std([d[1] for d in div]))]
        if hard_traps:
            first = [f for f in (visits_to_first_right(rows) for rows in seeds) if f is not None]
            no_filter = "dynamic_sampling" in m.name
            cells += ([format_mean_std(*mean_std([f[0] for f in first])),
                       f"{np.mean([f[1] for f in first]):.1f}"] if first and no_filter else ["-", "-"])
        out.append(md_row([m.label, *cells]))
    return out


def trap_route_shares(study: Study, method: str, routes: Sequence[str], where: str = "eval") -> list[dict[str, float]]:
    """Per seed, the share of each route among the wrong answers to the evaluation's traps
    (problems on which every one of the planted ``routes`` is a distinct wrong answer)."""
    from medsrl.data.precedence import is_trap
    from medsrl.study.routes import route_of

    out = []
    for seed in study.seeds:
        path = study.root / where / method / f"seed{seed}" / "generations.jsonl"
        if not path.is_file():
            continue
        counts: Counter = Counter()
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            if not is_trap(rec["problem"], tuple(routes)):
                continue
            for r in rec["responses"]:
                if float(r["score"]) <= 0.5:
                    counts[route_of(rec["problem"], r["text"])] += 1
        total = sum(counts.values())
        out.append({k: v / total for k, v in counts.items()} if total else {})
    return out


def route_share_table(study: Study, routes: Sequence[str]) -> list[str]:
    out = [md_row(["arm", *(f"{r} (% of trap errors)" for r in routes), "other routes (%)"]),
           "|---|" + "---:|" * (len(routes) + 1)]
    from medsrl.study.runner import WARM_START

    for name, label in [(WARM_START, "warm start"), *((m.name, m.label) for m in study.methods)]:
        per_seed = trap_route_shares(study, name, routes)
        if not per_seed:
            continue
        cells = [format_mean_std(*mean_std([s.get(r, 0.0) for s in per_seed]), 100.0) for r in routes]
        rest = [1 - sum(s.get(r, 0.0) for r in routes) for s in per_seed]
        out.append(md_row([label, *cells, format_mean_std(*mean_std(rest), 100.0)]))
    return out


def d2_verdict(study: Study, agg: dict[str, Any]) -> list[str]:
    """The protocol's D2 rules, arm by arm against DAPO, from the evaluation's figures."""
    from medsrl.study.error_modes import seed_reports
    from medsrl.study.report import ROUNDS, compare_methods, problem_values

    base = "dapo"
    problems = functools.cache(lambda name, metric: problem_values(study, name, metric))
    lines = []
    trap_top = {m.name: [r["trap"]["top_wrong_share"] for r in seed_reports(study.root, "eval", m.name, study.seeds)]
                for m in study.methods}
    for m in study.methods:
        if m.name == base:
            continue
        met = gate_met(gate_values(study, m.name))
        a, b = trap_top.get(base, []), trap_top.get(m.name, [])
        spread = max(np.std(a, ddof=1) if len(a) > 1 else 0.0, np.std(b, ddof=1) if len(b) > 1 else 0.0)
        diff = float(np.mean(b) - np.mean(a)) if a and b else math.nan
        welch = welch_t_test(a, b)
        lower = diff < 0 and abs(diff) > 2 * spread and math.isfinite(welch.p) and welch.p < 0.05
        comp = {metric: compare_methods(study, base, m.name, metric, problems, ROUNDS)
                for metric in ("pass@1", "pass@16", "pass@32", "distinct_wrong")}
        sig = {k: c.significant and c.diff > 0 for k, c in comp.items()}
        p1 = comp["pass@1"].diff  # a fraction: pass@1 "not lower by more than 1 point" is > -0.01
        supports = lower and sig["distinct_wrong"] and (sig["pass@16"] or sig["pass@32"]) and not p1 < -0.01
        noise = not any(c.significant for c in comp.values()) and not lower
        verdict = ("supports the paper" if supports else
                   "refutes at this scale (gate met, outcomes within seed noise)" if met and noise else
                   "inconclusive")
        lines.append(
            f"- **{m.label}**: gate {'met' if met else 'not met'}; top wrong answer's share of trap "
            f"errors {100 * diff:+.1f} pp against DAPO (2 x seed std {200 * spread:.1f} pp, Welch p = "
            f"{format_p(welch.p)}); pass@1 {100 * comp['pass@1'].diff:+.1f} pp; "
            + "; ".join(f"{k}: {c.verdict}" for k, c in comp.items() if k != "pass@1")
            + f"; verdict: **{verdict}**."
        )
    return lines


def outcome_table(study: Study, agg: dict[str, Any]) -> list[str]:
    """Per arm on the test split: pass@1/16/32, distinct wrong answers and the top wrong
    answer's share of the trap errors, mean ± std over seeds."""
    from medsrl.study.error_modes import seed_reports

    cols = ("pass@1", "pass@16", "pass@32", "distinct_wrong")
    out = [md_row(["arm", *cols, "top wrong answer, % of trap errors"]), "|---|" + "---:|" * (len(cols) + 1)]
    for m in agg["methods"]:
        cells = [format_mean_std(m["metrics"][c]["mean"], m["metrics"][c]["std"],
                                 1.0 if c == "distinct_wrong" else 100.0)
                 if c in m["metrics"] else "-" for c in cols]
        top = [r["trap"]["top_wrong_share"] for r in seed_reports(study.root, "eval", m["name"], study.seeds)]
        out.append(md_row([m["label"], *cells, format_mean_std(*mean_std(top), 100.0)]))
    return out


def render(root: Path, doc_dir: Path, img_dir: Path) -> str:
    from medsrl.study.report import _relative, aggregate, render_markdown, write_figures

    out = []
    d3, d1, d2 = root / "v3_d3", root / "v3_d1", root / "v3_d2"
    if d3.is_dir():
        s3 = load_study(d3)
        out += ["### D3: where the penalty enters (v2 task, stage A, 20 steps)", "",
                f"Study `v3_d3`, commit `{s3.meta.get('commit')}`, seeds {', '.join(map(str, s3.seeds))}. "
                "Per arm the mean over the run's steps, then mean ± std over seeds; the gate's "
                "thresholds: G1 >= 25 %, G2 >= 1 %, G3 > 0, G4 > 0.2.", ""]
        out += gate_table(s3, extra=(("train/acc", "training accuracy (%)", 100.0),
                                     ("train/shaping/adv_change_frac", "advantage rewritten, all shaping (%)", 100.0)))
        out += ["", "Routes of the trained-on responses (`samples.jsonl`, labelled by `study/routes.py`), "
                "and without the DAPO filter the visits until a hard trap is first answered right:", ""]
        out += samples_table(s3, hard_traps=True)
        out += [""] + [f"- missing: {m}" for m in s3.missing if m.part != "eval"]  # a training-only study
    audit = d1 / "audit" / "audit.md"
    if audit.is_file():
        body = [line for line in audit.read_text().strip().splitlines() if not line.startswith("# ")]
        out += ["", "### D1: the memory audit (no RL)", "", *body, ""]
        name, settings = d2_memory(root)
        now, _ = chosen_memory(json.loads((d1 / "audit" / "audit.json").read_text()))
        out += [f"By the protocol's rule D2's third arm uses the memory **{name}** (`{' '.join(settings)}`)"
                + ("." if now == name else f", chosen when D2 ran (`v3_d1/choice.json`); on this table the rule "
                   f"would choose **{now}**."), ""]
    if d2.is_dir():
        s2 = load_study(d2)
        agg = aggregate(s2)
        drawn = write_figures(s2, img_dir / "d2")
        out += ["### D2: a task with three planted wrong routes", "", "The gate:", ""]
        out += gate_table(s2, extra=(("train/acc", "training accuracy (%)", 100.0),))
        out += ["", "Outcomes on the test split (n = 32):", ""] + outcome_table(s2, agg)
        out += ["", "The planted routes' shares of the wrong answers to test traps (n = 32):", ""]
        out += route_share_table(s2, ("shortcut", "add", "drop"))
        out += ["", "Routes of the trained-on responses:", ""] + samples_table(s2, hard_traps=False)
        out += ["", "Pre-registered verdicts:", ""] + d2_verdict(s2, agg)
        out += ["", render_markdown(s2, agg, _relative(drawn, doc_dir))]
    d2x = root / "v3_d2x"
    if d2x.is_dir():
        sx = load_study(d2x)
        aggx = aggregate(sx)
        out += ["", "### D2, an exploratory arm added after the protocol: the answer-keyed memory", "",
                "Not pre-registered (added when D3 showed G4 near 0 for the feature memory in training): MEDS "
                "with `mode=answer` at alpha 0.5, cap 1.0, on D2's task, against the same DAPO runs "
                "(evaluated again here, the same seeds). The gate:", ""]
        out += gate_table(sx, extra=(("train/acc", "training accuracy (%)", 100.0),))
        out += ["", "Outcomes on the test split (n = 32):", ""] + outcome_table(sx, aggx)
        out += ["", "The planted routes' shares of the wrong answers to test traps:", ""]
        out += route_share_table(sx, ("shortcut", "add", "drop"))
        out += ["", "By D2's rules (exploratory):", ""] + d2_verdict(sx, aggx)
    return "\n".join(out) + "\n"


def write_report_v3(root: str | Path, doc: str | Path, img_dir: str | Path) -> str:
    from medsrl.study.report import update_study_doc

    doc = Path(doc)
    md = "<!-- generated by `python -m medsrl.study.report_v3`; edits here are overwritten -->\n\n" + render(
        Path(root), doc.parent, Path(img_dir))
    if not doc.exists():
        doc.write_text("# Study v3\n\n<!-- study-results:begin -->\n<!-- study-results:end -->\n")
    update_study_doc(doc, md)
    return md


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m medsrl.study.report_v3", description=__doc__.split("\n\n")[0])
    p.add_argument("root", nargs="?", default="logs/study", help="holds v3_d1, v3_d2, v3_d3")
    p.add_argument("--doc", default="docs/STUDY_V3.md")
    p.add_argument("--img-dir", default="docs/img/study_v3")
    a = p.parse_args(argv)
    print(write_report_v3(a.root, a.doc, a.img_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
