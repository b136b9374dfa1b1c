"""MEDS reward shaping: the penalty for a repeated mistake and how it enters the score (docs/REFERENCE.md
step 6). Size 0 (no penalty) comes only on a prompt's first visit; a response without a boxed answer
has no feature and no penalty. Under group mean/std normalisation the mean penalty of a group's wrong
responses cancels: only their spread moves the advantages (``gate.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

TARGETS = ("wrong", "right", "both", "none")


def meds_penalty(sizes: np.ndarray, alpha: float, beta: float | None = None) -> np.ndarray:
    """``min(alpha * ln(size + 1), beta)`` per response (float64); ``beta=None``: the reference's
    ``alpha * min(ln(size + 1), 2.0)``, so a huge cluster cannot swamp the 0/1 reward."""
    s = np.asarray(sizes, dtype=np.float64)
    if (s < 0).any():
        raise ValueError("cluster sizes must be >= 0")
    log = np.log1p(s)
    return alpha * log.clip(max=2.0) if beta is None else (alpha * log).clip(max=beta)


def shuffle_penalties(
    penalties: Tensor, group_ids: Tensor, correct: Tensor, featured: Tensor, group_keys: Sequence[str],
    seed: int, step: int,
) -> Tensor:
    """The penalties permuted within each group among its featured responses of one outcome: the
    control that keeps each group's penalties and drops their targeting. Drawn from ``(seed, step,
    group_keys[g], outcome)``: the same on every rank and in a resumed run."""
    out = penalties.clone()
    is_featured = torch.zeros(len(penalties), dtype=torch.bool)
    is_featured[featured] = True
    right = correct.to(torch.bool).cpu()
    for g in torch.unique(group_ids).tolist():
        for ok in (False, True):
            rows = ((group_ids.cpu() == g) & (right == ok) & is_featured).nonzero().flatten()
            if len(rows) < 2:
                continue
            digest = hashlib.sha256(f"{seed}:{step}:{group_keys[g]}:{int(ok)}".encode()).digest()
            perm = np.random.default_rng(int.from_bytes(digest[:8], "little")).permutation(len(rows))
            out[rows] = penalties[rows[torch.as_tensor(perm)]]
    return out


def apply_penalty(
    scores: Tensor, correct: Tensor, penalties: Tensor, target: str = "wrong"
) -> Tensor:
    """Shaped scores [B]: ``wrong`` (reference) ``score - pen`` on wrong responses; ``right``
    ``score / (1 + pen)`` on right ones; ``both``; ``none`` a copy (logging-only runs)."""
    if target not in TARGETS:
        raise ValueError(f"unknown penalty target {target!r}; expected one of {TARGETS}")
    if scores.shape != correct.shape or scores.shape != penalties.shape:
        raise ValueError(
            f"scores {tuple(scores.shape)}, correct {tuple(correct.shape)} and penalties "
            f"{tuple(penalties.shape)} must have the same shape"
        )
    x = scores if scores.is_floating_point() else scores.to(torch.get_default_dtype())
    pen = penalties.to(dtype=x.dtype, device=x.device)
    right = correct.to(device=x.device, dtype=torch.bool)
    out = x.clone()
    if target in ("wrong", "both"):
        out = torch.where(right, out, out - pen)
    if target in ("right", "both"):
        out = torch.where(right, out / (1.0 + pen), out)
    return out


def _as_numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, Tensor) else np.asarray(x)


def advantage_order_changed(raw, shaped, group_ids) -> float:
    """Fraction of groups in which a pair of responses changed relation (``<``, ``=``, ``>``; a tie
    broken counts) between ``raw`` and ``shaped`` (tensors or arrays [B])."""
    r, s, g = _as_numpy(raw), _as_numpy(shaped), _as_numpy(group_ids)
    groups = np.unique(g)
    if groups.size == 0:
        return 0.0
    changed = 0
    for gid in groups:
        idx = np.flatnonzero(g == gid)
        rel_raw = np.sign(r[idx, None] - r[None, idx])
        rel_shaped = np.sign(s[idx, None] - s[None, idx])
        changed += bool((rel_raw != rel_shaped).any())
    return changed / groups.size
