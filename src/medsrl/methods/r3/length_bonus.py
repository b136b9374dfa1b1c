"""R3's length bonus (arXiv 2601.19620, ``L = 32768``): a correct answer earns ``max(0, 1 - l / L)``
on top of its reward, so a shorter right answer is preferred; wrong answers are untouched."""

from __future__ import annotations

import torch
from torch import Tensor


def length_bonus(lengths: Tensor, correct: Tensor, max_length: int) -> Tensor:
    """``max(0, 1 - lengths / max_length)`` where ``correct``, else 0 (float64 [N])."""
    if max_length <= 0:
        raise ValueError(f"length bonus max_length must be > 0, got {max_length}")
    bonus = (1.0 - lengths.double() / max_length).clamp(min=0.0)
    return torch.where(correct.bool(), bonus, torch.zeros_like(bonus))
