"""The mechanism gate of study v3 (docs/STUDY.md, protocol v3): did MEDS's penalty act, and on what?

With 0/1 rewards and group mean/std advantages, a wrong response's penalty ``d_i = dbar + e_i``
(its group's mean wrong penalty plus a deviation) gives exactly (:func:`closed_form_shaped_advantages`)
``A_shaped = (A_raw - w*e / ((1 + dbar) sigma_r)) / sqrt(1 + rho^2)``, ``rho = std(w*e) / ((1 + dbar)
sigma_r)``: the mean penalty cancels, so MEDS acts only through the spread of a group's wrong
penalties, and on the repeated mistake only if a larger cluster means a more often repeated answer.
G1-G6 below measure that; G2 is ``algo.advantage_change_fraction``, split by :func:`common_penalty`.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch
from scipy.stats import spearmanr
from torch import Tensor

from medsrl.algo.group_spread import keep_mask_by_group_spread
from medsrl.algo.logprobs import masked_mean
from medsrl.methods.meds.diagnostics import penalty_on_top_answer


def distinct_penalty_share(group_ids: Sequence[int], wrong: Sequence[bool], penalty: Sequence[float]) -> float | None:
    """G1: the share of groups whose wrong responses carry >= 2 distinct penalties (exact: from integer sizes)."""
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
    """G3: per group with penalty, the penalty's share on its most frequent wrong answer minus that
    answer's share of its wrong responses, averaged (pooled, two groups that each share one
    penalty would read +25 pp)."""
    rows: dict[int, list[int]] = defaultdict(list)
    for j, g in enumerate(group_ids):
        rows[int(g)].append(j)
    excess = []
    for members in rows.values():
        on_top, share = penalty_on_top_answer([0] * len(members), [wrong[j] for j in members],
                                              [answers[j] for j in members], [penalty[j] for j in members])
        if on_top is not None and share is not None:
            excess.append(on_top - share)
    return float(np.mean(excess)) if excess else None


def earlier_answer_counts(
    keys: Sequence[str], answers: Sequence[str | None], history: Mapping[str, Mapping[str, int]]
) -> list[int]:
    """How often each response's answer was given before for its prompt (``history``: {key: {answer: count}})."""
    return [0 if a is None else int(history.get(k, {}).get(a, 0)) for k, a in zip(keys, answers, strict=True)]


def count_answers(history: dict[str, dict[str, int]], keyed: Iterable[tuple[str, str | None]]) -> None:
    """Count each ``(prompt key, extracted answer)`` into ``history``; no answer is not counted."""
    for key, answer in keyed:
        if answer is not None:
            counts = history.setdefault(key, {})
            counts[answer] = counts.get(answer, 0) + 1


def answer_counts_digest(history: Mapping[str, Mapping[str, int]]) -> str:
    """A hash of ``history`` that does not depend on the order its keys were added in."""
    return hashlib.sha1(repr(sorted((k, sorted(v.items())) for k, v in history.items())).encode()).hexdigest()


def size_recurrence_correlation(
    group_ids: Sequence[int], sizes: Sequence[float], counts: Sequence[float]
) -> float | None:
    """G4: Spearman's correlation of cluster size and earlier count of the same answer within each
    group where both vary, row-weighted (pooled, a prompt visited more often has both larger)."""
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
    """GRPO advantages of ``correct - wrong * penalty`` by the closed form above (no ``eps``; mixed
    groups only): what the tests check ``group_advantages`` against."""
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


def common_penalty(penalty: Tensor, wrong: Tensor, group_ids: Tensor) -> Tensor:
    """Each wrong penalty replaced by its group's mean ``dbar``: the part of MEDS's term that only
    rescales a group's advantages (G2's common part; the rest is the targeted part)."""
    w = wrong.to(penalty.dtype)
    _, inv = torch.unique(group_ids, return_inverse=True)
    groups = int(inv.max()) + 1 if inv.numel() else 0
    total = torch.zeros(groups, dtype=penalty.dtype).index_add_(0, inv, w * penalty)
    count = torch.zeros(groups, dtype=penalty.dtype).index_add_(0, inv, w)
    dbar = total / count.clamp(min=1)
    return torch.where(wrong, dbar[inv], penalty)


def per_response(advantages: Tensor, response_mask: Tensor) -> Tensor:
    """One advantage per response ``[B]`` (token-level ones averaged over the response)."""
    return advantages if advantages.dim() == 1 else masked_mean(advantages, response_mask, dim=-1)


def rewarded_error_share(advantages: Tensor, correct: Tensor, group_ids: Tensor) -> float | None:
    """G5: the share of mixed groups' wrong responses with advantage >= 0 (not pushed down)."""
    rows = keep_mask_by_group_spread(correct.float(), group_ids) & ~correct.bool()
    if not rows.any():
        return None
    return float((advantages[rows] >= 0).double().mean())


def correct_advantage_loss(shaped: Tensor, base: Tensor, correct: Tensor, group_ids: Tensor) -> float | None:
    """G6: ``1 - sum(shaped) / sum(base)`` over mixed groups' correct responses: the share shaping took away."""
    rows = keep_mask_by_group_spread(correct.float(), group_ids) & correct.bool()
    total = float(base[rows].double().sum())
    if total == 0.0:
        return None
    return 1.0 - float(shaped[rows].double().sum()) / total
