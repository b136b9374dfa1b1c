"""MEDS reward shaping: the penalty for a repeated mistake and how it enters the score.

Reference (docs/REFERENCE.md step 6): wrong responses get ``score - alpha * min(ln(|C| + 1), 2.0)``;
the cap keeps a huge cluster from swamping the 0/1 correctness reward. Size 0 (no penalty) comes
only on a prompt's first visit: after it the k-NN vote always returns a cluster or the noise
count, so no mistake is "new". Responses without a boxed answer have no feature and get no
penalty (so they are favoured over boxed wrong ones). Under group mean/std normalisation even
the *mean* penalty of a group's wrong responses cancels, not only a constant shift; only their
spread moves the advantages (``gate.py`` has the closed form).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

TARGETS = ("wrong", "right", "both", "none")


def meds_penalty(sizes: np.ndarray, alpha: float, beta: float | None = None) -> np.ndarray:
    """Penalty per response (float64) from its cluster size: ``min(alpha * ln(size + 1), beta)``;
    ``beta=None`` is the reference cap, ``alpha * min(ln(size + 1), 2.0)``."""
    s = np.asarray(sizes, dtype=np.float64)
    if (s < 0).any():
        raise ValueError("cluster sizes must be >= 0")
    log = np.log1p(s)
    return alpha * log.clip(max=2.0) if beta is None else (alpha * log).clip(max=beta)


def shuffle_penalties(
    penalties: Tensor, group_ids: Tensor, correct: Tensor, featured: Tensor, group_keys: Sequence[str],
    seed: int, step: int,
) -> Tensor:
    """The penalties permuted within each group among its featured responses of one outcome (the
    wrong ones, for ``target=wrong``): each group keeps its multiset of penalties and loses which
    response carries which (``meds.shuffle_penalties``, the control that keeps the penalty's
    distribution and drops its targeting). The permutation of group ``g`` is drawn from ``(seed,
    step, group_keys[g], outcome)``: the same on every rank and in a resumed run. A new tensor."""
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
    """Shaped scores [B] (a new tensor): ``wrong`` (reference) gives wrong responses
    ``score - pen``; ``right`` gives right ones ``score / (1 + pen)``; ``both`` does each on its
    own side; ``none`` copies ``scores`` (the memory still fills: logging-only runs). Responses
    without a feature must be given penalty 0 by the caller."""
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
    """Fraction of groups whose ordering of responses differs between ``raw`` and ``shaped``.

    Equal when every pair of the group keeps its relation (``<``, ``=``, ``>``): a tie broken
    by shaping counts as a change, a constant shift does not. No groups gives 0.0. Accepts
    tensors or arrays [B].
    """
    r, s, g = _as_numpy(raw), _as_numpy(shaped), _as_numpy(group_ids)
    if not (r.shape == s.shape == g.shape) or r.ndim != 1:
        raise ValueError("raw, shaped and group_ids must all be 1-D with the same length")
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
