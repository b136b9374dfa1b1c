"""The mechanism gate of study v3 (docs/STUDY.md, protocol v3): did MEDS's penalty act, and on what?

With 0/1 rewards and group mean/std advantages, write a wrong response's penalty as the mean
penalty of its group's wrong responses plus a deviation, ``d_i = dbar + e_i``. Then exactly
(:func:`closed_form_shaped_advantages`)::

    A_shaped = (A_raw - w*e / ((1 + dbar) sigma_r)) / sqrt(1 + rho^2),
    rho = std(w*e) / ((1 + dbar) sigma_r)

(``w``: wrong; ``sigma_r``: the std of the 0/1 rewards). The mean penalty cancels; a group whose
wrong responses share one penalty is left as it was. So MEDS acts only through the *spread* of
penalties among a group's wrong responses, and it acts on the repeated mistake only if a larger
cluster means a more often repeated answer. Four figures, logged every step by the plug-in:

- G1 :func:`distinct_penalty_share`: share of the update's groups whose wrong responses carry at
  least two distinct penalties (the groups the penalty can change at all);
- G2 the share of the advantage signal shaping rewrote (``algo.advantage_change_fraction``);
- G3 :func:`top_answer_excess`: the penalty's share on each group's most frequent wrong answer
  minus that answer's share of the wrong responses (> 0: the penalty targets the repeated mistake);
- G4 :func:`size_recurrence_correlation`: within a group, the rank correlation between a wrong
  response's cluster size and how often its answer was given before for that prompt.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from scipy.stats import spearmanr
from torch import Tensor

from medsrl.methods.meds.diagnostics import penalty_on_top_answer


def distinct_penalty_share(group_ids: Sequence[int], wrong: Sequence[bool], penalty: Sequence[float]) -> float | None:
    """G1: the share of groups whose wrong responses carry >= 2 distinct penalties (exact
    comparison: penalties come from integer cluster sizes). ``None`` without groups."""
    by_group: dict[int, set[float]] = defaultdict(set)
    for g, w, p in zip(group_ids, wrong, penalty, strict=True):
        by_group[int(g)]  # every group counts in the denominator
        if w:
            by_group[int(g)].add(float(p))
    if not by_group:
        return None
    return sum(len(v) >= 2 for v in by_group.values()) / len(by_group)


def top_answer_excess(
    group_ids: Sequence[int], wrong: Sequence[bool], answers: Sequence[str | None], penalty: Sequence[float]
) -> float | None:
    """G3: penalty share on each group's most frequent wrong answer minus that answer's share of
    the wrong responses (``diagnostics.penalty_on_top_answer``); ``None`` without penalty."""
    on_top, share = penalty_on_top_answer(group_ids, wrong, answers, penalty)
    return None if on_top is None or share is None else on_top - share


def earlier_answer_counts(
    keys: Sequence[str], answers: Sequence[str | None], history: Mapping[str, Mapping[str, int]]
) -> list[int]:
    """How often each response's answer was given (wrong) before for its prompt, from
    ``history`` {prompt key: {answer: count}}; no answer counts 0."""
    return [0 if a is None else int(history.get(k, {}).get(a, 0)) for k, a in zip(keys, answers, strict=True)]


def size_recurrence_correlation(
    group_ids: Sequence[int], sizes: Sequence[float], counts: Sequence[float]
) -> float | None:
    """G4: Spearman's rank correlation between cluster size and earlier count of the same answer,
    within each group where both vary, averaged over those groups weighted by their rows (within
    a group: a prompt visited more often has both larger stores and larger counts, which a pooled
    correlation would mistake for agreement). ``None`` when no group qualifies."""
    by_group: dict[int, list[int]] = defaultdict(list)
    for j, g in enumerate(group_ids):
        by_group[int(g)].append(j)
    s, c = np.asarray(sizes, dtype=np.float64), np.asarray(counts, dtype=np.float64)
    if len(s) != len(c) or len(s) != len(group_ids):
        raise ValueError(f"group_ids, sizes and counts differ in length: {len(group_ids)}, {len(s)}, {len(c)}")
    total, weight = 0.0, 0
    for rows in by_group.values():
        if len(rows) < 2 or np.ptp(s[rows]) == 0 or np.ptp(c[rows]) == 0:
            continue
        total += len(rows) * float(spearmanr(s[rows], c[rows]).statistic)
        weight += len(rows)
    return total / weight if weight else None


def closed_form_shaped_advantages(correct: Tensor, penalty: Tensor, group_ids: Tensor) -> Tensor:
    """GRPO advantages of ``correct - wrong * penalty`` from the closed form in the module
    docstring (no ``eps``; a group without both right and wrong responses must not be passed):
    what the tests check ``group_advantages`` against."""
    r = correct.double()
    w = 1.0 - r
    out = torch.empty_like(r)
    for g in torch.unique(group_ids):
        i = group_ids == g
        ri, wi, di = r[i], w[i], penalty.double()[i]
        dbar = (wi * di).sum() / wi.sum()
        we = wi * (di - dbar)
        sigma_r = ri.std()  # unbiased, as group_advantages
        scale = (1.0 + dbar) * sigma_r
        rho = we.std() / scale
        out[i] = ((ri - ri.mean()) / sigma_r - we / scale) / torch.sqrt(1.0 + rho**2)
    return out
