"""Reduce a [B,T] per-token loss to a scalar, in the ways GRPO, DAPO and Dr.GRPO differ on."""

from __future__ import annotations

import torch
from torch import Tensor

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_length: float | None = None,
) -> Tensor:
    """Aggregate ``loss_mat`` [B,T] over ``mask``: ``token-mean`` (DAPO) over all tokens, long
    responses not down-weighted; ``seq-mean-token-sum`` / ``-token-mean`` (GRPO) per-sequence sums /
    means over ``num_seqs``; ``seq-mean-token-sum-norm`` (Dr.GRPO) the sum over ``num_seqs *
    norm_length`` (default ``T``), free of the length bias. Pass the mini-batch totals so that
    micro-batches sum to its value. Masked-out positions may hold NaN/inf."""
    m = mask.to(loss_mat.dtype)
    masked = torch.where(m != 0, loss_mat, 0) * m
    n_seqs = loss_mat.shape[0] if num_seqs is None else num_seqs
    if mode == "token-mean":
        n_tok = m.sum().clamp(min=torch.finfo(m.dtype).tiny) if num_tokens is None else num_tokens
        return masked.sum() / n_tok
    if mode == "seq-mean-token-sum":
        return masked.sum(-1).sum() / n_seqs
    if mode == "seq-mean-token-mean":
        seq_means = masked.sum(-1) / m.sum(-1).clamp(min=torch.finfo(m.dtype).tiny)
        return seq_means.sum() / n_seqs
    if mode == "seq-mean-token-sum-norm":
        length = mask.shape[-1] if norm_length is None else norm_length
        return masked.sum() / (n_seqs * length)
    raise ValueError(f"unknown loss aggregation mode {mode!r}; valid: {LOSS_AGG_MODES}")
