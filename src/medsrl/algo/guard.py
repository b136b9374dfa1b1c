"""Runaway updates: weights that an optimiser step made non-finite or exploded.

A non-finite loss or gradient is caught before the step (``step/update.py`` skips that update).
A finite gradient times an absurd learning rate is not: ``optim.lr=1e30`` gives weights of about
1e30, the next step's sampling fails deep inside ``torch.multinomial`` and the checkpoint in
between saves the broken weights. So after every optimiser step the global L2 norm of the
policy's parameters (one ``torch._foreach_norm`` pass) must be finite and at most
``optim.max_param_norm_growth`` times its value at the first update of this fit (after a resume:
the resumed weights; 0 keeps only the finiteness check). Relative, not absolute, because a sensible absolute bound depends on the model's size;
the default of 100x is far above what a working run drifts (weight decay pulls the other way)
and far below what a runaway gives (1e30x at lr 1e30). A norm that overflows float32 counts as
non-finite: such weights are broken either way.

On a runaway the run stops (:class:`RunawayError`) with the step and the likely causes, before
Lightning's checkpoint of that step: a roll-back would also have to undo the optimiser's moments
and would repeat the same update, so a clear stop is the honest outcome.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

LIKELY_CAUSES = (
    "Likely causes: a learning rate far too high (optim.lr) or an overflow of the training "
    "precision (fp16: use bf16 or 32-bit)"
)

NONFINITE_SAMPLING = "the sampling probabilities are not finite (inf or nan logits)"


class RunawayError(RuntimeError):
    """The weights, logits or sampling probabilities became non-finite or exploded."""


def param_norm_sq(tensors: Iterable[torch.Tensor]) -> float:
    """Sum of squares of ``tensors`` (float32 per tensor, one fused pass): square-rooted after
    summing over ranks when each rank holds a shard."""
    tensors = [t.detach() for t in tensors if t.numel()]
    if not tensors:
        return 0.0
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return float(torch.stack([n.to(norms[0].device) for n in norms]).square().sum())


def runaway_reason(norm: float, start_norm: float | None, max_growth: float) -> str | None:
    """Why the weights of norm ``norm`` are broken, or None when they are fine."""
    if not math.isfinite(norm):
        return (f"the policy's parameter norm is {norm} (non-finite weights, or weights too "
                "large for float32)")
    if max_growth > 0 and start_norm and norm > max_growth * start_norm:
        return (f"the policy's parameter norm grew from {start_norm:.4g} to {norm:.4g}, more "
                f"than {max_growth:g}x its value at the start")
    return None


def runaway_message(step: int, what: str, lr: float | None = None, precision: str | None = None) -> str:
    """The error of a runaway at ``step``: what broke, that the run stops, the likely causes."""
    settings = ", ".join(
        f"{k}={v}" for k, v in (("optim.lr", lr), ("trainer.precision", precision)) if v is not None
    )
    return (f"step {step}: runaway update: {what}; stopping the run here (no checkpoint of this "
            f"step is written). {LIKELY_CAUSES}" + (f"; this run has {settings}" if settings else ""))


def nonfinite_tensors(named: Mapping[str, object]) -> list[str]:
    """The names of the floating-point tensors in ``named`` holding NaN or inf (one fused
    max-abs pass, which cannot overflow)."""
    items = [(k, v.detach()) for k, v in named.items()
             if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()]
    if not items:
        return []
    peaks = torch._foreach_norm([v for _, v in items], float("inf"))
    finite = torch.stack([torch.isfinite(p).to("cpu") for p in peaks]).tolist()
    return [k for (k, _), ok in zip(items, finite, strict=True) if not ok]
