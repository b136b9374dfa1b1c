"""Offline evaluation metrics: pass@k, majority vote, answer/feature diversity, and reports.

Small pure functions on lists and numpy arrays (no torch, no model): ``passk`` (unbiased pass@k,
maj@n), ``diversity`` (distinct answers, eigen ratio, error clusters) and ``report`` (tidy rows
written as Markdown / CSV / JSON tables and a pass@k plot). Import the submodules directly.
"""
