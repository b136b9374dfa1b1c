"""MEDS reward shaping: the penalty for a repeated mistake and how it enters the score.

Reference (PAPER.md step 6): ``pen = alpha * min(ln(|C| + 1), 2.0)``, i.e.
``min(alpha * ln(|C| + 1), beta)`` with ``beta = 2 * alpha``; wrong responses get
``score - pen``. A new mistake (|C| = 0) costs nothing; the cap keeps a huge error cluster from
swamping the 0/1 correctness reward. The penalty only matters where it differs inside a group:
a constant shift cancels in the group normalisation of the advantage.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

TARGETS = ("wrong", "right", "both", "none")


def meds_penalty(sizes: np.ndarray | Tensor, alpha: float, beta: float | None = None):
    """Penalty per response from its cluster size: ``min(alpha * ln(size + 1), beta)``.

    ``beta=None`` is the reference cap, computed as ``alpha * min(ln(size + 1), 2.0)``.
    Size 0 (empty memory, or noise with ``noise_is_cluster=False``) gives 0. Returns a float
    tensor for a tensor input (same device), else a float64 numpy array.
    """
    if isinstance(sizes, Tensor):
        s = sizes.to(torch.get_default_dtype()) if not sizes.is_floating_point() else sizes
        if (s < 0).any():
            raise ValueError("cluster sizes must be >= 0")
        log = torch.log1p(s)
        if beta is None:
            return alpha * log.clamp(max=2.0)
        return (alpha * log).clamp(max=beta)
    s = np.asarray(sizes, dtype=np.float64)
    if (s < 0).any():
        raise ValueError("cluster sizes must be >= 0")
    if beta is None:
        return alpha * np.minimum(np.log1p(s), 2.0)
    return np.minimum(alpha * np.log1p(s), beta)


def apply_penalty(
    scores: Tensor, correct: Tensor, penalties: Tensor, target: str = "wrong"
) -> Tensor:
    """Shaped scores [B] (a new tensor): the penalty applied to the targeted responses.

    - ``wrong`` (reference): wrong responses get ``score - pen``, right ones are untouched;
    - ``right``: right responses get ``score / (1 + pen)``, wrong ones untouched;
    - ``both``: each rule on its own side;
    - ``none``: a copy of ``scores`` (memory is still filled; useful for logging-only runs).
    Responses without a feature (no ``\\boxed{``) must be given penalty 0 by the caller.
    """
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

    Two orderings are equal when every pair (i, j) of the group has the same relation
    (``<``, ``=`` or ``>``) under both scores; so a tie broken by shaping (two wrong responses
    with different penalties) counts as a change, and a constant shift of the group does not.
    This is the groups where shaping can move the advantages' ranking at all. Groups of one
    response never change; no groups gives 0.0. Accepts tensors or arrays [B].
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
