"""The study's results: aggregated numbers, significance tests, figures and Markdown.

``write_report`` (the runner's last phase, and ``python -m medsrl.study.report <study_root>``)
draws the figures, writes ``results.md`` / ``results.json`` into the study root and replaces the
block between the marker lines of ``docs/STUDY.md``, leaving the protocol around it untouched.
A seed's score is its ``average`` row (macro mean over benchmarks) or its only benchmark's row.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from medsrl.evaluation.diversity import DIVERSITY_KEYS, distinct_wrong_answers
from medsrl.evaluation.tables import PERCENT_PREFIXES, json_clean, md_row
from medsrl.study import stats
from medsrl.study.collect import Study, load_study
from medsrl.study.error_modes import render_error_modes
from medsrl.study.mechanism import render_dose_response, render_mechanism
from medsrl.study.plots import MECHANISM_PANELS, SMOOTH, plot_pass_at_k_curves, plot_training_curves
from medsrl.utils.atomic_file import atomic_write_text

BEGIN = "<!-- study-results:begin -->"
END = "<!-- study-results:end -->"
HEADLINE_KS = (1, 8, 32)
ROUNDS = 10000  # bootstrap resamples and sign flips of the problem-level test


def _end_columns(ks: Sequence[int]) -> list[str]:
    """The first and the last headline pass@k (one column when they are the same)."""
    return [f"pass@{k}" for k in sorted({ks[0], ks[-1]})] if ks else []


def headline_ks(study: Study) -> list[int]:
    """The pass@k columns of the tables: 1, 8, 32 where the evaluation's n allows, plus the
    largest k every evaluated seed has (pass@n), so a quick study with n = 16 shows pass@16."""
    common = _common_ks(study)
    return sorted({k for k in HEADLINE_KS if k in common} | {max(common)}) if common else []


def _common_ks(study: Study) -> set[int]:
    sets = [
        {int(c[5:]) for c in r.summary if c.startswith("pass@")}
        for m in study.methods
        for r in study.evaluated(m.name)
    ]
    return set.intersection(*sets) if sets else set()


def seed_values(study: Study, method: str, metric: str) -> list[float]:
    """The metric of each evaluated seed of ``method`` (its summary row), in seed order."""
    return [float(r.summary.get(metric, math.nan)) for r in study.evaluated(method)]


def problem_values(study: Study, method: str, metric: str) -> dict[tuple[str, int], float]:
    """``{(benchmark, index): metric averaged over seeds}`` for ``pass@k`` or ``distinct_wrong``,
    over the problems every seed with generations has (``nan``: fewer than k samples)."""
    runs = [r for r in study.evaluated(method) if r.problems]
    if not runs:
        return {}
    keys = sorted(set.intersection(*(set(r.problems) for r in runs)))
    per_seed = []
    for r in runs:
        samples = [r.problems[key] for key in keys]
        if metric.startswith("pass@"):
            k = int(metric[5:])
            vals = [
                stats.per_problem_pass_at_k([s.scores], k)[0] if len(s.scores) >= k else math.nan
                for s in samples
            ]
        elif metric == "distinct_wrong":
            vals = [float(distinct_wrong_answers(s.answers, s.scores)) for s in samples]
        else:
            raise ValueError(f"no per-problem values for {metric!r}")
        per_seed.append(vals)
    mean = np.mean(np.asarray(per_seed, dtype=np.float64), axis=0)
    return dict(zip(keys, mean.tolist(), strict=True))


def compare_methods(
    study: Study, baseline: str, method: str, metric: str, problems, rounds: int
) -> stats.Comparison:
    """Both tests of ``method`` against ``baseline`` on one metric, over the problems both
    evaluated (``problems(name, metric)``: ``problem_values``, cached by the caller)."""
    a_prob, b_prob = problems(baseline, metric), problems(method, metric)
    common = sorted(set(a_prob) & set(b_prob))
    a_p = [a_prob[k] for k in common] if common else None
    b_p = [b_prob[k] for k in common] if common else None
    return stats.compare(
        seed_values(study, baseline, metric), seed_values(study, method, metric), a_p, b_p,
        a_label=study.label(baseline), b_label=study.label(method), rounds=rounds,
    )


def aggregate(study: Study, *, rounds: int = ROUNDS) -> dict[str, Any]:
    """The study's numbers as JSON-ready data (``results.json``): per method and metric the
    mean, std and per-seed values (overall and per benchmark); the comparisons of the treatment
    (headline pass@k, distinct wrong) and of every other method (the first and last headline
    pass@k) against the baseline."""
    ks = headline_ks(study)
    metrics = [f"pass@{k}" for k in sorted(_common_ks(study))]
    metrics += ["mean@n", "maj@n", *DIVERSITY_KEYS]
    methods = []
    for m in study.methods:
        runs = study.evaluated(m.name)
        benches = list(dict.fromkeys(row["benchmark"] for r in runs for row in r.rows))
        methods.append({
            "name": m.name,
            "label": m.label,
            "seeds": [r.seed for r in runs],
            "trained_seeds": [r.seed for r in study.method_runs(m.name) if r.stages],
            "metrics": {c: _summary(seed_values(study, m.name, c)) for c in metrics},
            "benchmarks": {b: _benchmark_summary(runs, b, metrics) for b in benches},
        })
    base = study.baseline
    evaluated = [m.name for m in study.methods if study.evaluated(m.name)]
    plan = []
    if base in evaluated:
        if study.treatment in evaluated and study.treatment != base:
            plan += [(study.treatment, c) for c in [*(f"pass@{k}" for k in ks), "distinct_wrong"]]
        plan += [(name, c) for name in evaluated if name != base for c in _end_columns(ks)
                 if (name, c) not in plan]
    problems = functools.cache(lambda name, metric: problem_values(study, name, metric))
    comparisons = [
        {"baseline": base, "method": method, "metric": metric,
         **asdict(compare_methods(study, base, method, metric, problems, rounds))}
        for method, metric in plan
    ]
    meta = study.meta
    info = {
        "name": study.name, "root": str(study.root), "commit": meta.get("commit"),
        "machine": meta.get("machine"), "seeds": study.seeds, "steps_a": study.steps_a,
        "steps_b": study.steps_b, "eval_n": meta.get("eval_n"), "baseline": base,
        "treatment": study.treatment,
    }
    return json_clean({
        "study": info,
        "headline_ks": ks,
        "missing": [str(m) for m in study.missing],
        "notes": list(study.notes),
        "methods": methods,
        "comparisons": comparisons,
        "tests": {"alpha": stats.ALPHA, "rounds": rounds, "seed": 0},
    })


def _summary(values: Sequence[float]) -> dict[str, Any]:
    mean, std = stats.mean_std(values)
    return {"mean": mean, "std": std, "values": list(values)}


def _benchmark_summary(runs, benchmark: str, metrics: Sequence[str]) -> dict[str, Any]:
    """The problems of ``benchmark`` (``None`` when the seeds' counts differ) and the summary of
    each metric over the seeds' rows of it."""
    rows = [row for r in runs for row in r.rows if row["benchmark"] == benchmark]
    counts = {row.get("problems") for row in rows}
    return {
        "problems": counts.pop() if len(counts) == 1 else None,
        **{c: _summary([float(row.get(c, math.nan)) for row in rows]) for c in metrics},
    }


def _num(value: Any) -> float:
    return math.nan if value is None else float(value)


def _fmt(metric: str, mean: Any, std: Any = None) -> str:
    """``41.3 ± 1.2``: pass@k, mean@n, maj@n in %."""
    scale = 100.0 if metric.startswith(PERCENT_PREFIXES) else 1.0
    return stats.format_mean_std(_num(mean), _num(std), scale)


def _fmt_diff(metric: str, diff: Any) -> str:
    """A difference: ``+2.1 pp`` for percentages, ``-0.35`` otherwise."""
    diff = _num(diff)
    if not math.isfinite(diff):
        return "-"
    if metric.startswith(PERCENT_PREFIXES):
        return f"{100 * diff:+.1f} pp"
    return f"{diff:+.2f}"


def _fmt_welch(w: dict[str, Any]) -> str:
    t, dof, p = _num(w["t"]), _num(w["dof"]), _num(w["p"])
    if not math.isfinite(p):
        return "n/a"
    dof_text = f"{dof:.1f}" if math.isfinite(dof) else "-"
    return f"t = {t:.2f} (dof {dof_text}), p = {stats.format_p(p)}"


def _fmt_paired(metric: str, paired: dict[str, Any] | None) -> str:
    if paired is None or not math.isfinite(_num(paired["p"])):
        return "n/a"
    scale, digits = (100.0, 1) if metric.startswith("pass@") else (1.0, 2)
    lo, hi = scale * _num(paired["ci_low"]), scale * _num(paired["ci_high"])
    return (
        f"{_fmt_diff(metric, paired['diff'])} [{lo:+.{digits}f}, {hi:+.{digits}f}], "
        f"p = {stats.format_p(_num(paired['p']))}"
    )


def _metric_name(metric: str) -> str:
    return metric.replace("_", " ")  # distinct_wrong -> distinct wrong


def render_markdown(study: Study, agg: dict[str, Any], figures: dict[str, str]) -> str:
    """The results section from ``aggregate``'s numbers; ``figures``: {kind: relative path}."""
    info = agg["study"]
    seeds = info["seeds"]
    n_seeds = len(seeds)
    out = [
        "<!-- generated by `python -m medsrl.study.report`; edits here are overwritten -->",
        "",
        f"Study `{info['name']}`: commit `{info.get('commit') or 'unknown'}`, machine: "
        f"{info.get('machine') or 'unknown'}. Seeds {', '.join(map(str, seeds)) or '-'}; "
        f"training {_steps_text(info)}; evaluation with n = {info.get('eval_n') or '?'} "
        "samples per problem.",
        "",
    ]
    if agg["missing"]:
        out += [f"**Incomplete**: {len(agg['missing'])} part(s) missing or unfinished; the "
                "numbers below use what is there.", ""]
        out += [f"- {m}" for m in agg["missing"]]
    else:
        out.append("Complete: every training run and evaluation of the study is there.")
    out += [f"- note: {n}" for n in agg["notes"]]
    out.append("")
    out += _main_table(agg, n_seeds)
    out += _benchmark_table(agg)
    out += render_error_modes(study.root, [(m.name, m.label) for m in study.methods], study.seeds)
    out += render_mechanism(study)
    out += render_dose_response(study, agg)
    out += _significance(study, agg)
    out += _figures(study, figures)
    return "\n".join(out).rstrip("\n") + "\n"


def _steps_text(info: dict[str, Any]) -> str:
    a, b = info.get("steps_a"), info.get("steps_b")
    if a is None:
        return "steps unknown"
    if not b:
        return f"{a} steps"
    return f"stage A {a} steps, then stage B {b} steps resumed from A (steps {a}..{a + b})"


def _main_table(agg: dict[str, Any], n_seeds: int) -> list[str]:
    ks = agg["headline_ks"]
    cols = [f"pass@{k}" for k in ks] + list(DIVERSITY_KEYS)
    head = [f"{_metric_name(c)}{' (%)' if c.startswith('pass@') else ''}" for c in cols]
    over = f"mean ± std over {n_seeds} seeds" if n_seeds > 1 else f"{n_seeds} seed, no std"
    lines = [
        "### Main table",
        "",
        "Each seed's score on the benchmark (the macro average over benchmarks where there are "
        "several), then mean ± sample std (ddof = 1) over the seeds; diversity figures are means "
        "per problem (distinct answers and distinct wrong answers among the n samples, top-1 "
        "eigen ratio of the MEDS features, number of clusters of the wrong answers' features).",
        "",
        md_row(["method", "seeds", *(f"{h}, {over}" for h in head)]),
        "|---|---:|" + "---:|" * len(cols),
    ]
    for m in agg["methods"]:
        got = len(m["seeds"])
        seeds_cell = str(got) if got == n_seeds else f"{got} of {n_seeds}"
        cells = [_fmt(c, m["metrics"][c]["mean"], m["metrics"][c]["std"]) for c in cols]
        lines.append(md_row([m["label"], seeds_cell, *cells]))
    lines.append("")
    return lines


def _benchmark_table(agg: dict[str, Any]) -> list[str]:
    cols = _end_columns(agg["headline_ks"])
    if not cols:
        return []
    benches = list(dict.fromkeys(b for m in agg["methods"] for b in m["benchmarks"]))
    lines = ["### Per benchmark", ""]
    if len(benches) <= 1:
        name = benches[0] if benches else "-"
        return [*lines, f"One benchmark (`{name}`): the main table is its table.", ""]
    lines += [
        md_row(["benchmark", "problems", "method", *(f"{c} (%), mean ± std" for c in cols)]),
        "|---|---:|---|" + "---:|" * len(cols),
    ]
    for b in benches:
        for m in agg["methods"]:
            if b not in m["benchmarks"]:
                continue
            entry = m["benchmarks"][b]
            cells = [_fmt(c, entry[c]["mean"], entry[c]["std"]) for c in cols]
            problems = entry.get("problems")
            lines.append(md_row([b, "-" if problems is None else problems, m["label"], *cells]))
    lines.append("")
    return lines


def _significance(study: Study, agg: dict[str, Any]) -> list[str]:
    info = agg["study"]
    base, treat = info["baseline"], info["treatment"]
    tests = agg["tests"]
    lines = ["### Significance", ""]
    if not agg["comparisons"]:
        why = f"the baseline ({base}) has no evaluation yet" if base else "study.json names no baseline"
        return [*lines, f"No comparison: {why}.", ""]
    n_seeds, rounds = len(info["seeds"]), tests["rounds"]
    power = (f"with {n_seeds} seeds per method it has little power" if n_seeds > 1
             else "undefined with one seed, so nothing can be called significant")
    lines += [
        f"Differences are method minus {study.label(base)} (the baseline). **Seed-level**: "
        f"Welch's t-test on the per-seed scores (the seed-to-seed variance; {power}). "
        "**Problem-level**: each problem's score "
        "averaged over the seeds, paired over the problems both methods evaluated: a "
        f"percentile bootstrap 95% CI of the mean difference ({rounds} resamples of problems) "
        f"and a two-sided sign-flip permutation p ({rounds} random flips, or all of them for "
        "few problems; fixed seed); problems of several benchmarks are pooled, each weighing "
        "the same. It measures the problem sample given these seeds, not the seeds. A "
        f"difference is called significant only when both p < {tests['alpha']:g}.",
        "",
    ]
    main = [c for c in agg["comparisons"] if c["method"] == treat]
    if main:
        a_label, b_label = study.label(base), study.label(treat)
        lines += [
            f"#### {b_label} vs {a_label}",
            "",
            f"| metric | {a_label}, mean ± std | {b_label}, mean ± std | difference | "
            "seed-level Welch | problem-level: diff [95% CI], p | verdict |",
            "|---|---:|---:|---:|---|---|---|",
        ]
        for c in main:
            metric = c["metric"]
            problems = c["paired"]["problems"] if c["paired"] else 0
            lines.append(
                f"| {_metric_name(metric)} | {_fmt(metric, c['baseline_mean'], c['baseline_std'])} | "
                f"{_fmt(metric, c['method_mean'], c['method_std'])} | {_fmt_diff(metric, c['diff'])} | "
                f"{_fmt_welch(c['welch'])} | {_fmt_paired(metric, c['paired'])}"
                f"{f' ({problems} problems)' if problems else ''} | {c['verdict']} |"
            )
        lines.append("")
    metrics = _end_columns(agg["headline_ks"])
    others = [c for c in agg["comparisons"] if c["metric"] in metrics]
    methods = list(dict.fromkeys(c["method"] for c in others))
    if methods:
        lines += [
            f"#### Every method vs {study.label(base)}",
            "",
            "Difference in points; seed-level / problem-level p; **bold**: significant (both "
            f"p < {tests['alpha']:g}).",
            "",
            md_row(["method", *(f"{m} difference | {m} p (seed / problem)" for m in metrics)]),
            "|---|" + "---:|---|" * len(metrics),
        ]
        by_key = {(c["method"], c["metric"]): c for c in others}
        for method in methods:
            cells = []
            for metric in metrics:  # every method is compared on both
                c = by_key[(method, metric)]
                diff = _fmt_diff(metric, c["diff"])
                cells.append(f"**{diff}**" if c["significant"] else diff)
                prob_p = c["paired"]["p"] if c["paired"] else None
                cells.append(f"{stats.format_p(_num(c['welch']['p']))} / {stats.format_p(_num(prob_p))}")
            lines.append(md_row([study.label(method), *cells]))
        lines.append("")
    return lines


def _figures(study: Study, figures: dict[str, str]) -> list[str]:
    if not figures:
        return []
    switch = (
        f" The dashed vertical line marks the switch from stage A to stage B at step {study.steps_a}."
        if study.steps_a is not None and study.steps_b else ""
    )
    captions = {  # kind: (alt text, caption)
        "pass_at_k": ("pass@k per method",
                      "pass@k against k (log-2 axis) per method: mean over the evaluated seeds (their "
                      "number in the legend), band ± sample std over seeds."),
        "training": ("training curves per method",
                     "Training curves: a line per method is the mean over seeds, the band the min-max "
                     f"range across seeds. Training accuracy (`train/acc`, per step) is smoothed by a "
                     f"centred moving average over {SMOOTH} steps (fewer at the ends); the validation "
                     "panels are unsmoothed and logged every few steps; the MEDS memory's eigen ratio "
                     f"exists only for runs with the MEDS plug-in.{switch}"),
        "mechanism": ("the mechanism over training",
                      "The mechanism over training, mean over seeds with the min-max band: visits of the "
                      "step's prompts, MEDS's memory entries per store read, the responses it penalised, "
                      f"the share of the advantage signal shaping rewrote (every method) and the share of "
                      f"the penalty on a group's most frequent wrong answer (the percentages smoothed over "
                      f"{SMOOTH} steps).{switch}"),
    }
    lines = ["### Figures", ""]
    for kind, (alt, caption) in captions.items():
        if kind in figures:
            lines += [f"![{alt}]({figures[kind]})", "", caption, ""]
    return lines


def write_figures(study: Study, img_dir: str | os.PathLike) -> dict[str, Path]:
    """``{kind: path}`` of the figures drawn into ``img_dir``, named ``<study>_<kind>.png`` so
    that a quick and a full study can share the directory."""
    img = Path(img_dir)
    drawn = {
        "pass_at_k": plot_pass_at_k_curves(study, img / f"{study.name}_pass_at_k.png"),
        "training": plot_training_curves(study, img / f"{study.name}_training_curves.png"),
    }
    if any(tag in r.curves for r in study.runs.values() for tag, *_ in MECHANISM_PANELS):
        drawn["mechanism"] = plot_training_curves(
            study, img / f"{study.name}_mechanism.png", MECHANISM_PANELS, "the mechanism"
        )
    return {kind: path for kind, path in drawn.items() if path is not None}


def _relative(paths: dict[str, Path], start: Path) -> dict[str, str]:
    return {
        k: Path(os.path.relpath(Path(p).resolve(), start.resolve())).as_posix()
        for k, p in paths.items()
    }


def update_study_doc(doc_path: str | os.PathLike, results_md: str) -> Path:
    """Replace what lies between the marker lines (``BEGIN`` / ``END``, each once on a line of
    its own) of ``doc_path`` with ``results_md``, keeping the rest byte for byte (idempotent);
    written atomically with the file's permissions. ``ValueError`` on bad markers."""
    path = Path(doc_path)
    text = path.read_text(encoding="utf-8")
    spans = {}
    for marker in (BEGIN, END):
        found = list(re.finditer(rf"^{re.escape(marker)}[ \t]*\r?$", text, flags=re.MULTILINE))
        if len(found) != 1:
            what = "no" if not found else f"{len(found)}"
            raise ValueError(
                f"{path}: {what} '{marker}' line(s); the results block needs exactly one "
                f"'{BEGIN}' line and one '{END}' line after it"
            )
        spans[marker] = found[0]
    begin, end = spans[BEGIN], spans[END]
    if end.start() < begin.end():
        raise ValueError(f"{path}: '{END}' comes before '{BEGIN}'")
    body = results_md.strip("\n")
    new = text[: begin.end()] + "\n" + (body + "\n" if body else "") + text[end.start() :]
    if new != text:
        atomic_write_text(path, new, path.stat().st_mode & 0o7777)
    return path


def write_report(
    study_root: str | os.PathLike, doc_path: str | os.PathLike | None = "docs/STUDY.md",
    img_dir: str | os.PathLike = "docs/img/study", *, rounds: int = ROUNDS,
) -> str:
    """Figures into ``img_dir``, ``results.md`` + ``results.json`` into the study root (first,
    so a doc without markers still leaves them), and the results block of ``doc_path`` (skipped
    when ``None``); returns the doc's Markdown."""
    root = Path(study_root)
    study = load_study(root)
    agg = aggregate(study, rounds=rounds)
    drawn = write_figures(study, img_dir)
    atomic_write_text(root / "results.json", json.dumps(agg, indent=2, allow_nan=False) + "\n")
    root_md = render_markdown(study, agg, _relative(drawn, root))
    atomic_write_text(root / "results.md", root_md)
    if doc_path is None:
        return root_md
    doc = Path(doc_path)
    md = render_markdown(study, agg, _relative(drawn, doc.parent))
    update_study_doc(doc, md)
    return md


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m medsrl.study.report",
        description="Aggregate a study directory: tables, significance tests, figures; update "
        "the results block of the study doc.",
    )
    parser.add_argument("study_root", help="e.g. logs/study/full")
    parser.add_argument("--doc", default="docs/STUDY.md", help="doc with the results markers")
    parser.add_argument("--no-doc", action="store_true", help="leave the doc alone")
    parser.add_argument("--img-dir", default="docs/img/study", help="where the PNGs go")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="bootstrap / flip rounds")
    args = parser.parse_args(argv)
    md = write_report(args.study_root, None if args.no_doc else args.doc, args.img_dir, rounds=args.rounds)
    print(md)
    where = "" if args.no_doc else f", {args.doc}"
    print(f"[medsrl] results in {Path(args.study_root) / 'results.md'} (.json){where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
