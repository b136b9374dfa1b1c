"""Structural entropy ranking reward (SERR): an all-wrong group scores 0 everywhere, so SERR prefers
the failed responses that explored where it mattered and were confident elsewhere. ``E_peak`` = mean
of the top ``max(1, floor(p * L))`` token entropies, ``E_global`` = mean of all ``L``; ``i`` beats
``j`` when ``E_peak_i > E_peak_j`` and ``E_global_i < E_global_j``. Ranked by the number beaten (ties:
lower ``E_global``, then the original order), rank ``r`` of ``N`` gets ``R_max * (1 - r / (N - 1))``.
With ``grader.reasoning_end``, only the answer after the reasoning is read (:func:`answer_span_mask`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def answer_span_mask(mask: Tensor, starts: Sequence[int | None]) -> Tensor:
    """``mask`` ``[N, R]`` without each row's tokens before its answer start (``reward/answer_span.py``);
    a row whose start is ``None`` or leaves no token keeps its whole mask."""
    out = mask.clone()
    lengths = mask.bool().sum(dim=1).tolist()
    for i, start in enumerate(starts):
        if start is not None and 0 < start < lengths[i]:
            out[i, :start] = 0
    return out


def entropy_profile(entropy: Tensor, mask: Tensor, p: float = 0.2) -> tuple[Tensor, Tensor]:
    """``(E_peak, E_global)`` per row of ``entropy`` ``[N, R]`` over its ``mask`` tokens."""
    if not 0 < p <= 1:
        raise ValueError(f"ranking p must be in (0, 1], got {p}")
    m = mask.bool()
    lengths = m.sum(dim=1)
    ent = entropy.detach().double()
    glob = torch.where(m, ent, 0).sum(dim=1) / lengths.clamp(min=1)
    ordered = torch.where(m, ent, -math.inf).sort(dim=1, descending=True).values
    peak = torch.zeros_like(glob)
    for i, n in enumerate(lengths.tolist()):
        if n:
            top = max(1, math.floor(p * n))
            peak[i] = ordered[i, :top].mean()
    return peak, glob


def dominance_counts(peak: Tensor, glob: Tensor) -> Tensor:
    """How many rows each row beats (higher peak and lower global entropy)."""
    beats = (peak[:, None] > peak[None, :]) & (glob[:, None] < glob[None, :])
    return beats.sum(dim=1)


def ranking_order(peak: Tensor, glob: Tensor) -> list[int]:
    """Row indices, best first."""
    s = dominance_counts(peak, glob).tolist()
    g = glob.tolist()
    return sorted(range(len(s)), key=lambda i: (-s[i], g[i], i))


def ranking_rewards(peak: Tensor, glob: Tensor, r_max: float = 0.5) -> Tensor:
    """Per row (float64 [N]); one row alone gets ``R_max``."""
    n = len(peak)
    out = torch.zeros(n, dtype=torch.float64)
    for rank, i in enumerate(ranking_order(peak, glob)):
        out[i] = r_max * (1 - rank / (n - 1)) if n > 1 else r_max
    return out
