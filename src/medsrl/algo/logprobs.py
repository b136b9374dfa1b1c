"""Per-token log-probabilities, entropies and masked means, in fp32 and light on memory: the
``[b, R, V]`` logits are a step's largest tensors (7 GiB in bf16 for Qwen at 8 x 3072 tokens), so
:func:`head_logprobs` fuses the LM head and the log-softmax over chunks (recomputed in backward)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

# logits [b, R, V], labels [b, R] -> [b, R], read in the scoring forward; per position only: the
# fused path calls it on one chunk of tokens at a time, as [1, n, V] and [1, n].
TokenReducer = Callable[[Tensor, Tensor], Tensor]

# the fused path's working set: about CHUNK_TOKENS * V * 8 bytes, 1.2 GiB at 1024 x 151,936
CHUNK_TOKENS = 1024


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _acc(x: Tensor) -> Tensor:
    return x.to(_acc_dtype(x))


def _chunk_rows(logits: Tensor) -> int:
    """How many positions along dim -2 make a chunk of about CHUNK_TOKENS tokens."""
    per_row = max(1, logits[..., 0].numel() // max(1, logits.shape[-2]))
    return max(1, CHUNK_TOKENS // per_row)


class _TokenLogprob(torch.autograd.Function):
    """log_softmax(logits)[label] = logit[label] - logsumexp(logits), chunked in fp32. Saves only
    the logits (alive anyway) and the [B,T] logsumexp; backward rebuilds ``onehot - softmax``."""

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
    """Log-probability of each label under softmax(logits), [B,T] in fp32 (fp64 stays); the
    gradient comes back in the logits' dtype. Mask padding afterwards."""
    if logits.dim() < 2 or labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} must be logits {tuple(logits.shape)}[:-1]")
    return _TokenLogprob.apply(logits, labels.long())


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) per position, ``logsumexp(x) - sum(p * x)``: [B,T,V] -> [B,T],
    fp32, chunked; finite logits only; autograd keeps each fp32 chunk (a metric: ``no_grad``)."""
    parts = []
    for c in logits.split(_chunk_rows(logits), dim=-2):
        c = _acc(c)
        parts.append(c.logsumexp(-1) - (torch.softmax(c, dim=-1) * c).sum(-1))
    return torch.cat(parts, dim=-1)


class HeadLogprobs(NamedTuple):
    """Per token, shaped like the labels."""

    logp: Tensor
    entropy: Tensor | None
    stats: dict[str, Tensor]


def head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    *,
    entropy: bool = False,
    entropy_grad: bool = True,
    reducers: dict[str, TokenReducer] | None = None,
    chunk_tokens: int | None = None,
) -> HeadLogprobs:
    """``log_softmax(hidden @ weight.T + bias)[label]`` per token without the full logits: made
    ``chunk_tokens`` at a time as the head makes them (under the active autocast), then upcast,
    the numbers of ``token_logprobs(head(hidden), labels)``. ``reducers``: no-grad only."""
    reducers = reducers or {}
    chunk = chunk_tokens or CHUNK_TOKENS
    flat_h, flat_y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).long()
    if flat_h.shape[0] != flat_y.shape[0]:
        raise ValueError(f"labels {tuple(labels.shape)} must be hidden {tuple(hidden.shape)}[:-1]")
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if not needs_grad:
        logp, _, ent, stats = _head_forward(flat_h, weight, bias, flat_y, entropy, reducers, chunk)
    elif reducers:
        raise ValueError("reducers are read in the no-grad scoring forward; run it under torch.no_grad()")
    else:
        out = _FusedHeadLogprob.apply(flat_h, weight, bias, flat_y, entropy, entropy_grad, chunk)
        (logp, ent), stats = (out if entropy else (out, None)), {}
    shape = labels.shape
    return HeadLogprobs(
        logp.view(shape),
        None if ent is None else ent.view(shape),
        {name: v.view(shape) for name, v in stats.items()},
    )


def _autocast_head(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """The head's weight and bias as autocast casts them, once for all chunks: Lightning's
    autocast has its weight-cast cache off, so every chunk would cast the fp32 ``[V, H]`` again."""
    device_type = hidden.device.type
    if not torch.is_autocast_enabled(device_type):
        return weight, bias
    dtype = torch.get_autocast_dtype(device_type)
    cast = lambda t: t if t is None or t.dtype == dtype or not t.is_floating_point() else t.to(dtype)  # noqa: E731
    return cast(weight), cast(bias)


def _chunks(n: int, size: int) -> list[slice]:
    """Row slices of ``size`` covering ``0..n``; one empty slice when ``n`` is 0 (empty in, empty out)."""
    return [slice(s, min(s + size, n)) for s in range(0, n, size)] or [slice(0, 0)]


def _head_forward(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, entropy: bool,
    reducers: dict[str, TokenReducer], chunk: int,
) -> tuple[Tensor, Tensor, Tensor | None, dict[str, Tensor]]:
    """Log-probs, logsumexps, entropies (or None) and reducer values of ``[N, H]`` hidden states,
    one chunk of logits at a time."""
    weight, bias = _autocast_head(hidden, weight, bias)
    logps, lses, ents = [], [], []
    stats: dict[str, list[Tensor]] = {name: [] for name in reducers}
    for sl in _chunks(hidden.shape[0], chunk):
        y = labels[sl]
        logits = F.linear(hidden[sl], weight, bias)  # as the model's LM head computes them
        for name, fn in reducers.items():
            stats[name].append(fn(logits.unsqueeze(0), y.unsqueeze(0)).squeeze(0))
        x = _acc(logits)
        del logits
        lse = x.logsumexp(-1)
        logps.append(x.gather(-1, y.unsqueeze(-1)).squeeze(-1) - lse)
        lses.append(lse)
        if entropy:  # -sum p log p, with log p = x - lse made in place
            logp_all = x.sub_(lse.unsqueeze(-1))
            ents.append(-logp_all.exp().mul_(logp_all).sum(-1))
        del x
    return (
        torch.cat(logps), torch.cat(lses), torch.cat(ents) if entropy else None,
        {name: torch.cat(parts) for name, parts in stats.items()},
    )


class _FusedHeadLogprob(torch.autograd.Function):
    """:func:`head_logprobs` with recompute: saves the inputs and ``[N]`` logsumexps / entropies;
    backward remakes each chunk's logits under the forward's autocast and feeds their gradient to
    the head's matmuls in the logits' dtype, as autograd would, summing in fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, entropy, entropy_grad, chunk):
        device_type = hidden.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        logp, lse, ent, _ = _head_forward(hidden, weight, bias, labels, entropy, {}, chunk)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, ent)
        ctx.chunk = chunk
        ctx.set_materialize_grads(False)
        if not entropy:
            return logp
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, g_logp, g_ent=None):
        hidden, weight, bias, labels, lse, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        grad_h = torch.empty_like(hidden) if need_h else None
        # the fp32 sums' dtype, without an fp32 copy of the [V, H] weight to read it from
        grad_w = torch.zeros_like(weight, dtype=_acc_dtype(weight)) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=_acc_dtype(bias)) if need_b else None
        device_type, enabled, dtype = ctx.autocast
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            w, b = _autocast_head(hidden, weight, bias)
            for sl in _chunks(hidden.shape[0], ctx.chunk):
                h = hidden[sl]
                g = _logits_grad(
                    F.linear(h, w, b), labels[sl], lse[sl], _acc(g_logp[sl]),
                    None if g_ent is None else (ent[sl], _acc(g_ent[sl])),
                )
                if need_h:
                    grad_h[sl] = g @ w
                if need_w and g.dtype == h.dtype == grad_w.dtype:
                    grad_w.addmm_(g.t(), h)  # in place: no [V, H] temporary
                elif need_w:  # autocast's low-precision product, added to the fp32 sum
                    grad_w.add_(g.t() @ h)
                if need_b:
                    grad_b += g.sum(0, dtype=grad_b.dtype)
        return (
            grad_h, None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None,
        )


def _logits_grad(
    logits: Tensor, labels: Tensor, lse: Tensor, g_logp: Tensor, entropy: tuple[Tensor, Tensor] | None
) -> Tensor:
    """The gradient at one chunk's logits: ``g_logp * (onehot - p)``, plus ``g_H * (-p * (log p + H))``
    when ``entropy = (H, g_H)``; in fp32, in place on the upcast."""
    x = _acc(logits)
    out_dtype = logits.dtype
    del logits
    logp_all = x.sub_(lse.unsqueeze(-1))
    if entropy is None:
        d = logp_all.exp_().mul_(-g_logp.unsqueeze(-1))  # -g_logp * p
    else:
        ent, g_ent = entropy
        p = logp_all.exp()
        # -p * (g_logp + g_H * (log p + H))
        d = logp_all.add_(ent.unsqueeze(-1)).mul_(g_ent.unsqueeze(-1)).add_(g_logp.unsqueeze(-1)).mul_(p).neg_()
        del p
    d.scatter_add_(-1, labels.unsqueeze(-1), g_logp.unsqueeze(-1))  # + g_logp at the label
    return d.to(out_dtype)


def per_token(advantages: Tensor, like: Tensor) -> Tensor:
    """Sequence advantages ``[B]`` as ``[B, 1]``, to broadcast over ``like`` ``[B, T]``; ``[B, T]`` unchanged."""
    return advantages.unsqueeze(-1) if advantages.dim() == like.dim() - 1 else advantages


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` weighted by ``mask``: 0 (finite gradients) where it sums to 0; NaN/inf at
    masked-out positions are ignored."""
    m = mask.to(x.dtype) if x.is_floating_point() else mask.float()
    num = (torch.where(m != 0, x, 0) * m).sum(dim)
    den = m.sum(dim)
    return num / den.clamp(min=torch.finfo(den.dtype).tiny)
