"""DAPO dynamic sampling: drop groups whose responses all scored the same (zero advantage)."""

from __future__ import annotations

import torch
from torch import Tensor


def zero_spread_groups(scores: Tensor, group_ids: Tensor, *, atol: float = 0.0) -> Tensor:
    """Bool [B]: True where the response's group has ``max - min <= atol`` (a singleton too):
    zero advantage everywhere, no policy gradient, so DAPO drops them."""
    if scores.dim() != 1 or scores.shape != group_ids.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and group_ids must both be [B]")
    x = scores if scores.is_floating_point() else scores.float()
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    hi = x.new_full((uniq.numel(),), -torch.inf).scatter_reduce(0, inv, x, "amax")
    lo = x.new_full((uniq.numel(),), torch.inf).scatter_reduce(0, inv, x, "amin")
    return ((hi - lo) <= atol)[inv]


def keep_mask_by_group_spread(scores: Tensor, group_ids: Tensor, *, atol: float = 0.0) -> Tensor:
    """Bool [B]: True for responses in groups with spread > ``atol`` (the ones DAPO keeps)."""
    return ~zero_spread_groups(scores, group_ids, atol=atol)
