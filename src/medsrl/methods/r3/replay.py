"""Cross-context replay (CCR): a group all right (or all wrong) has no advantage signal, so R3 appends
up to ``k`` stored responses of the opposite outcome and normalises the mixed group.
"""

from __future__ import annotations

from torch import Tensor

from medsrl.algo import group_advantages


def replay_count(k: int | None, n: int) -> int:
    """``k``, or (``None``) a quarter of the group, at least 1."""
    if k is None:
        return max(1, n // 4)
    return max(0, int(k))


def mixed_group_advantages(scores: Tensor, group_ids: Tensor, alpha: float = 1.0, lam: float = 1e-6) -> Tensor:
    """``(R - group mean) / (alpha * group std + lam)`` per row: GRPO's for ``alpha = 1``, ``lam`` = eps."""
    if alpha < 0 or lam <= 0:
        raise ValueError(f"replay alpha must be >= 0 and lambda > 0, got {alpha}, {lam}")
    if alpha == 0:
        return group_advantages(scores, group_ids, norm_by_std=False) / lam
    # (R - mean) / (std + lam/alpha) / alpha == (R - mean) / (alpha * std + lam)
    return group_advantages(scores, group_ids, eps=lam / alpha) / alpha

