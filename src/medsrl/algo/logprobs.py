"""Per-token log-probabilities, entropies and masked means, in fp32 and light on memory.

The [B,T,V] logits are the largest tensor in an RL step, so nothing here materialises a full
fp32 copy of them (or a full [B,T,V] log-softmax): logits are processed in chunks of about
``CHUNK_TOKENS`` tokens along the sequence axis.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

# logits [b, R, V], labels [b, R] -> a per-token quantity [b, R], read in the scoring forward
TokenReducer = Callable[[Tensor, Tensor], Tensor]

CHUNK_TOKENS = 512  # tokens per fp32 chunk; ~300 MB at a 150k vocabulary


def _acc(x: Tensor) -> Tensor:
    """Upcast to at least fp32 (fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _chunk_rows(logits: Tensor) -> int:
    """How many positions along dim -2 make a chunk of about CHUNK_TOKENS tokens."""
    per_row = max(1, logits[..., 0].numel() // max(1, logits.shape[-2]))
    return max(1, CHUNK_TOKENS // per_row)


class _TokenLogprob(torch.autograd.Function):
    """log_softmax(logits)[label] = logit[label] - logsumexp(logits), chunked in fp32.

    Saves only the input logits (already alive) and the small [B,T] logsumexp for backward,
    where the gradient ``onehot(label) - softmax`` is rebuilt chunk by chunk.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor) -> Tensor:
        rows = _chunk_rows(logits)
        lse = torch.cat([_acc(c).logsumexp(-1) for c in logits.split(rows, dim=-2)], dim=-1)
        picked = _acc(logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1))
        ctx.save_for_backward(logits, labels, lse)
        ctx.rows = rows
        return picked - lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None]:
        logits, labels, lse = ctx.saved_tensors
        r = ctx.rows
        grad = torch.empty_like(logits)
        for g, x, y, s, go in zip(
            grad.split(r, dim=-2), logits.split(r, dim=-2), labels.split(r, dim=-1),
            lse.split(r, dim=-1), grad_out.split(r, dim=-1), strict=True,
        ):
            go = _acc(go).unsqueeze(-1)
            d = -go * torch.exp(_acc(x) - s.unsqueeze(-1))  # -grad * softmax
            d.scatter_add_(-1, y.unsqueeze(-1), go)  # + grad at the label
            g.copy_(d)
        return grad, None


def token_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    """Log-probability of each label under softmax(logits): [B,T,V], [B,T] -> [B,T] in fp32
    (fp64 for fp64 input).

    Works for bf16/fp16 logits (computed in fp32 per chunk, gradient returned in the logits'
    dtype). Labels must be valid vocabulary indices; mask padding afterwards.
    """
    if logits.dim() < 2 or labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} must be logits {tuple(logits.shape)}[:-1]")
    return _TokenLogprob.apply(logits, labels.long())


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) per position, ``logsumexp(x) - sum(p * x)``: [B,T,V] -> [B,T].

    fp32, chunked like ``token_logprobs``. Differentiable through plain autograd (which keeps
    each fp32 chunk for backward), so call under ``torch.no_grad()`` when it is only a metric.
    Logits must be finite.
    """
    parts = []
    for c in logits.split(_chunk_rows(logits), dim=-2):
        c = _acc(c)
        parts.append(c.logsumexp(-1) - (torch.softmax(c, dim=-1) * c).sum(-1))
    return torch.cat(parts, dim=-1)


def per_token(advantages: Tensor, like: Tensor) -> Tensor:
    """Sequence advantages ``[B]`` as ``[B, 1]`` (broadcast over the tokens of ``like`` ``[B, T]``);
    token-level ``[B, T]`` ones unchanged."""
    return advantages.unsqueeze(-1) if advantages.dim() == like.dim() - 1 else advantages


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` (0/1 or weights) is non-zero.

    Returns 0 (not NaN, with finite gradients) where the mask sums to 0, and ignores NaN/inf
    values at masked-out positions (e.g. padding).
    """
    m = mask.to(x.dtype) if x.is_floating_point() else mask.float()
    num = torch.where(m != 0, x, 0) * m
    num = num.sum() if dim is None else num.sum(dim)
    den = m.sum() if dim is None else m.sum(dim)
    return num / den.clamp(min=torch.finfo(den.dtype).tiny)
