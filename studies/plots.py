"""The study's figures (PNG, matplotlib Agg): pass@k curves and training curves per method.

Bands: pass@k is drawn as mean +- sample std over seeds (no band with one seed); training
curves as the mean over seeds with the min-max range across seeds, since with 3 seeds the range
shows every seed while a std would be a rough estimate.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from medsrl.evaluation.tables import pass_at_k_axes, pyplot, save_png
from studies.collect import Curve, Study

SMOOTH = 5  # steps in the moving average of the per-step training accuracy

# (tag, panel title, y in percent, smoothed)
PANELS = (
    ("train/acc", f"training accuracy (%), moving average over {SMOOTH} steps", True, True),
    ("val/accuracy", "validation accuracy (%)", True, False),
    ("val/distinct_wrong", "validation: distinct wrong answers per problem", False, False),
    ("val/eigen_ratio", "validation: top-1 eigen ratio of the MEDS features", False, False),
    ("train/meds/top1_eigen_ratio", "MEDS memory: top-1 eigen ratio (MEDS runs only)", False, False),
)
# what shaping did, over training (study/mechanism.py has the tables)
MECHANISM_PANELS = (
    ("train/data/visits_mean", "visits of the step's prompts so far", False, False),
    ("train/meds/entries_per_read", "MEDS: memory entries per store read", False, False),
    ("train/meds/penalised_frac", "MEDS: responses penalised (%)", True, True),
    ("train/shaping/adv_change_frac", "advantage signal rewritten by shaping (%)", True, True),
    ("train/meds/penalty_on_top_answer", "MEDS: penalty on the top wrong answer (%)", True, True),
)


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Centred moving average over ``window`` points, fewer at the ends (no padding); centred,
    so the curve is not shifted in step as by a trailing mean. Non-finite points are left out."""
    x = np.asarray(values, dtype=np.float64)
    if window <= 1 or len(x) == 0:
        return x.copy()
    finite = np.isfinite(x)
    # point j of the full convolution sums j - window + 1 .. j; i's window ends at i + window // 2
    sums = np.convolve(np.where(finite, x, 0.0), np.ones(window))[window // 2 :][: len(x)]
    counts = np.convolve(finite, np.ones(window))[window // 2 :][: len(x)]
    return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def align_seeds(curves: Sequence[Curve]) -> tuple[np.ndarray, np.ndarray]:
    """(steps [T], values [S, T]) on the union of the seeds' steps, ``nan`` where a seed has no
    value (e.g. its stage B is missing)."""
    if not curves:
        return np.zeros(0, dtype=np.int64), np.zeros((0, 0))
    steps = np.unique(np.concatenate([np.asarray(s, dtype=np.int64) for s, _ in curves]))
    out = np.full((len(curves), len(steps)), np.nan)
    for i, (s, v) in enumerate(curves):
        out[i, np.searchsorted(steps, np.asarray(s, dtype=np.int64))] = v
    return steps, out


def seed_band(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, min, max) over seeds (axis 0) of the finite values at each step (nan at none)."""
    with warnings.catch_warnings():  # a step no seed has: nan, and numpy warns of that
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(values, axis=0), np.nanmin(values, axis=0), np.nanmax(values, axis=0)


def pass_at_k_by_method(study: Study) -> dict[str, tuple[list[int], np.ndarray]]:
    """``{method: (ks, values [seeds, len(ks)])}`` in [0, 1], from each seed's summary row; the
    ks are those every evaluated seed of the method has."""
    out = {}
    for m in study.methods:
        rows = [r.summary for r in study.evaluated(m.name)]
        if not rows:
            continue
        ks = sorted(
            set.intersection(*({int(c[5:]) for c in r if c.startswith("pass@")} for r in rows))
        )
        out[m.name] = (ks, np.array([[float(r[f"pass@{k}"]) for k in ks] for r in rows]))
    return out


def plot_pass_at_k_curves(study: Study, path: str | os.PathLike) -> Path | None:
    """PNG of pass@k per method, mean over seeds with a ± std band; ``None`` (nothing written)
    when no method has an evaluation yet."""
    data = pass_at_k_by_method(study)
    if not data:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.8, 4.6))
    try:
        all_ks: set[int] = set()
        for name, (ks, vals) in data.items():
            mean = 100 * vals.mean(axis=0)
            color = _color(study, name)
            ax.plot(
                ks, mean, marker="o", ms=3, color=color, label=f"{study.label(name)} ({len(vals)})"
            )
            if len(vals) > 1:
                std = 100 * vals.std(axis=0, ddof=1)
                ax.fill_between(ks, mean - std, mean + std, color=color, alpha=0.15, lw=0)
            all_ks.update(ks)
        pass_at_k_axes(ax, all_ks, f"{study.name}: pass@k, mean ± std over seeds")
        ax.legend(fontsize=8, title="method (seeds)", title_fontsize=8)
        return save_png(fig, path, dpi=130)
    finally:
        plt.close(fig)


def plot_training_curves(study: Study, path: str | os.PathLike, panels=PANELS,
                         title: str = "training curves") -> Path | None:
    """One PNG with a panel per ``panels`` entry: a line per method (mean over seeds) with its
    min-max band, a dashed line at the stage switch (``steps_a``); a panel no method logged says
    so. ``None`` (nothing written) when no run has curves yet."""
    if not any(r.curves for r in study.runs.values()):
        return None
    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.2))
    try:
        flat = axes.ravel()
        handles = {}
        for ax, (tag, panel_title, percent, smooth) in zip(flat, panels, strict=False):
            drawn = False
            for m in study.methods:
                curves = [r.curves[tag] for r in study.method_runs(m.name) if tag in r.curves]
                if not curves:
                    continue
                if smooth:
                    curves = [(s, moving_average(v, SMOOTH)) for s, v in curves]
                steps, vals = align_seeds(curves)
                mean, lo, hi = seed_band(vals * (100 if percent else 1))
                color = _color(study, m.name)
                (line,) = ax.plot(
                    steps, mean, color=color, lw=1.4, marker="o" if len(steps) < 15 else None, ms=3
                )
                ax.fill_between(steps, lo, hi, color=color, alpha=0.15, lw=0)
                handles.setdefault(m.name, (line, f"{study.label(m.name)} ({len(curves)})"))
                drawn = True
            if study.steps_a is not None and study.steps_b:
                ax.axvline(study.steps_a, color="0.4", ls="--", lw=1)
            ax.set_title(panel_title, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=8)
            ax.grid(alpha=0.3)
            if not drawn:
                if study.steps_a is not None:
                    ax.set_xlim(0, study.steps_a + (study.steps_b or 0))
                ax.text(0.5, 0.5, f"no run logged {tag}", ha="center", va="center",
                        transform=ax.transAxes, fontsize=8)
        if len(flat) > len(panels):
            legend_ax = flat[len(panels)]
            legend_ax.axis("off")
            switch = "\ndashed: stage A -> B" if study.steps_a is not None and study.steps_b else ""
            legend_ax.legend([h for h, _ in handles.values()], [lab for _, lab in handles.values()],
                             loc="center", fontsize=9, title_fontsize=9,
                             title=f"method (seeds); band: min-max over seeds{switch}")
        fig.suptitle(f"{study.name}: {title}, mean over seeds", fontsize=11)
        fig.tight_layout()
        return save_png(fig, path, dpi=130)
    finally:
        plt.close(fig)


def _color(study: Study, method: str):
    """The same colour for a method in every figure: its position in study.json's list."""
    return f"C{[m.name for m in study.methods].index(method) % 10}"
