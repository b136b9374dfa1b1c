"""Group-relative advantages (GRPO / Dr.GRPO) and the GRPO+Entropy advantage bonus."""

from __future__ import annotations

import torch
from torch import Tensor


def _group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary group ids to 0..G-1 so groups can be reduced with index_add."""
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    return inv, uniq.numel()


def _group_sum(values: Tensor, inv: Tensor, num_groups: int) -> Tensor:
    """Per-group sum of ``values`` [B] for group indices ``inv`` in 0..num_groups-1."""
    return values.new_zeros(num_groups).index_add_(0, inv, values)


def group_advantages(
    scores: Tensor, group_ids: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Per-response advantage ``(score - group mean) / (group std + eps)`` (GRPO).

    ``norm_by_std=False`` gives Dr.GRPO's ``score - group mean``, which drops the std division
    that up-weights near-uniform groups. The std is the *unbiased* (Bessel, n-1) std, like
    ``torch.std``. Groups may be ragged and their ids arbitrary and shuffled. A group of size 1
    gets advantage 0 (its own mean), and so does any group whose scores are all equal.
    """
    if scores.dim() != 1 or scores.shape != group_ids.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and group_ids must both be [B]")
    x = scores if scores.is_floating_point() else scores.float()
    inv, g = _group_index(group_ids)
    counts = _group_sum(torch.ones_like(x), inv, g)
    dev = x - (_group_sum(x, inv, g) / counts)[inv]
    if not norm_by_std:
        return dev
    var = _group_sum(dev * dev, inv, g) / (counts - 1).clamp(min=1)
    return dev / (var.sqrt()[inv] + eps)


def entropy_bonus_advantage(
    advantages: Tensor, entropy: Tensor, coef: float = 0.4, cap_ratio: float = 0.5
) -> Tensor:
    """GRPO+Entropy shaped advantage ``A + min(coef * H, |A| * cap_ratio)`` per token.

    The bonus rewards exploring high-entropy tokens; the cap (``cap_ratio < 1``) keeps it below
    ``|A|`` so it never flips the sign of a negative advantage, and zero-advantage tokens get no
    bonus. Entropy is detached: it shapes the advantage, it is not a loss term. ``advantages`` may
    be [B] (broadcast over tokens) or [B,T]; ``entropy`` is [B,T]; returns [B,T].
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == entropy.dim() - 1 else advantages
    bonus = torch.minimum(coef * entropy.detach(), adv.abs() * cap_ratio)
    return adv + bonus
