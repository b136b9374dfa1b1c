"""EVOL-RL's novelty reward (arXiv 2509.15194), on any per-response vectors: the memoryless twin of
MEDS (it compares a response with the other responses of its group, not with the past).

Within a group, for response ``i`` with vector ``v_i``:
``novelty_i = 1 - (0.5 * mean cos(v_i, same-outcome others) + 0.5 * max cos(v_i, any other))``,
min-max normalised within the right and within the wrong responses to ``u`` in [0, 1]; the
reward is ``0.5 + 0.5 u`` for a right response, ``-1 + 0.5 u`` for a wrong one, and -1 for a
response without a boxed answer.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_novelty(vectors: Tensor, correct: Tensor) -> Tensor:
    """``novelty`` per row of one group's ``vectors`` ``[n, D]`` (float64 [n]).

    A response with no other response of its outcome gets mean similarity 0 to that subset;
    a group of one has novelty 1.
    """
    n = len(vectors)
    if n == 1:
        return torch.ones(1, dtype=torch.float64)
    v = torch.nn.functional.normalize(vectors.double(), dim=-1)
    sim = v @ v.T
    other = ~torch.eye(n, dtype=torch.bool)
    same = (correct[:, None] == correct[None, :]) & other
    mean_same = torch.where(same, sim, 0).sum(1) / same.sum(1).clamp(min=1)
    max_any = torch.where(other, sim, -torch.inf).max(1).values
    return 1 - (0.5 * mean_same + 0.5 * max_any)


def minmax_within(values: Tensor, subset: Tensor) -> Tensor:
    """Min-max normalise ``values`` within ``subset`` (bool) to [0, 1]; 0.5 where the subset has
    no spread (one member, or all equal); other rows untouched (0)."""
    out = torch.zeros_like(values)
    if subset.any():
        x = values[subset]
        lo, hi = x.min(), x.max()
        out[subset] = (x - lo) / (hi - lo) if hi > lo else torch.full_like(x, 0.5)
    return out


def novelty_rewards(vectors: Tensor, correct: Tensor, has_box: Tensor, has_vector: Tensor) -> Tensor:
    """EVOL-RL's reward for one group (float64 [n]). Rows without a vector take no part in the
    similarities and get the bottom of their outcome's range; rows without a box get -1."""
    u = torch.zeros(len(correct), dtype=torch.float64)
    rows = has_vector.nonzero().flatten()
    if len(rows):
        nov = group_novelty(vectors[rows], correct[rows])
        ok = correct[rows]
        u[rows] = minmax_within(nov, ok) + minmax_within(nov, ~ok)
    reward = torch.where(correct, 0.5 + 0.5 * u, -1 + 0.5 * u)
    return torch.where(has_box, reward, torch.full_like(reward, -1.0))
