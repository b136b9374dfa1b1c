"""How the rows of a forward pass are cut into micro-batches, and what padding that costs: a
micro-batch runs as wide as its longest prompt plus longest response, so rows sorted by length and
cut by a token budget (verl's dynamic batch size) shed most of the padding.
"""

from __future__ import annotations

import torch


def plan_micro_batches(
    rows: torch.Tensor,
    prompt_lengths: torch.Tensor,
    response_lengths: torch.Tensor,
    *,
    max_rows: int,
    max_tokens: int | None = None,
) -> list[torch.Tensor]:
    """The micro-batches of ``rows``: runs of ``max_rows`` in order, or with ``max_tokens``, longest
    first up to ``max_rows`` rows or ``max_tokens`` padded tokens (a row over it alone). Rows keep
    their order inside one, so a prompt's responses stay adjacent (the shared-prompt forward)."""
    if max_rows < 1:
        raise ValueError(f"micro-batch max_rows must be >= 1, got {max_rows}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"micro-batch max_tokens must be >= 1 or None, got {max_tokens}")
    rows = rows.long().flatten()
    if max_tokens is None:
        return [rows[i : i + max_rows] for i in range(0, len(rows), max_rows)]
    p = prompt_lengths[rows].tolist()
    r = response_lengths[rows].tolist()
    # longest first; ties by position, so the plan is deterministic
    order = sorted(range(len(rows)), key=lambda i: (-(p[i] + r[i]), i))
    batches: list[list[int]] = []
    current: list[int] = []
    widest_p = widest_r = 0
    for i in order:
        wp, wr = max(widest_p, p[i]), max(widest_r, r[i])
        if current and (len(current) == max_rows or (len(current) + 1) * (wp + wr) > max_tokens):
            batches.append(current)
            current, wp, wr = [], p[i], r[i]
        current.append(i)
        widest_p, widest_r = wp, wr
    if current:
        batches.append(current)
    return [rows[torch.tensor(sorted(b), dtype=torch.long)] for b in batches]


def padding_fraction(
    batches: list[torch.Tensor], prompt_lengths: torch.Tensor, response_lengths: torch.Tensor
) -> float:
    """The share of padding in the token slots (rows x longest prompt + longest response)."""
    real = slots = 0
    for rows in batches:
        if len(rows) == 0:
            continue
        p, r = prompt_lengths[rows], response_lengths[rows]
        real += int(p.sum() + r.sum())
        slots += len(rows) * int(p.max() + r.max())
    return 1.0 - real / slots if slots else 0.0
