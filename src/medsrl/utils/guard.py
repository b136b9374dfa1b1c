"""Runaway updates: a finite gradient times an absurd learning rate passes the update's non-finite
check, so after every optimiser step :class:`RunawayGuard` checks that the parameter norm is finite
and at most ``optim.max_param_norm_growth`` times its start value (a bound relative to the model's
size), stopping the run before Lightning checkpoints the step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from medsrl.utils.distributed import all_reduce_sum, local

LIKELY_CAUSES = (
    "Likely causes: a learning rate far too high (optim.optimizer.lr) or an overflow of the training "
    "precision (fp16: use bf16 or 32-bit)"
)

NONFINITE_SAMPLING = "the sampling probabilities are not finite (inf or nan logits)"


class RunawayError(RuntimeError):
    """The weights, logits or sampling probabilities became non-finite or exploded."""


def param_norm(params: Iterable[torch.Tensor], sharded: bool) -> float:
    """The global L2 norm of ``params`` (float32 per tensor, one fused pass), over ranks' shards."""
    tensors = [local(t.detach()) for t in params if t.numel()]
    sq = 0.0
    if tensors:
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
        sq = float(torch.stack([n.to(norms[0].device) for n in norms]).square().sum())
    return (all_reduce_sum(sq) if sharded else sq) ** 0.5


def runaway_reason(norm: float, start_norm: float | None, max_growth: float) -> str | None:
    """Why the weights of norm ``norm`` are broken, or None when they are fine."""
    if not math.isfinite(norm):
        return (f"the policy's parameter norm is {norm} (non-finite weights, or weights too "
                "large for float32)")
    if max_growth > 0 and start_norm and norm > max_growth * start_norm:
        return (f"the policy's parameter norm grew from {start_norm:.4g} to {norm:.4g}, more "
                f"than {max_growth:g}x its value at the start")
    return None


@dataclass(frozen=True)
class RunawayGuard:
    """The run's one guard: the weights' norm at the fit's start, the growth allowed from it, and
    the settings its error names."""

    max_growth: float
    start_norm: float | None = None
    lr: float | None = None
    precision: str | None = None

    def check(self, params: list[torch.Tensor], sharded: bool, step: int, where: str) -> None:
        """Raise when the last optimiser step broke the weights (every rank sees the same norm)."""
        reason = runaway_reason(param_norm(params, sharded), self.start_norm, self.max_growth)
        if reason is not None:
            raise self.error(step, f"{reason} ({where})")

    def error(self, step: int, what: str) -> RunawayError:
        """What broke at ``step``, that the run stops, the likely causes."""
        settings = {"optim.optimizer.lr": self.lr, "trainer.precision": self.precision}
        named = ", ".join(f"{k}={v}" for k, v in settings.items() if v is not None)
        return RunawayError(f"step {step}: runaway update: {what}; stopping the run here (no checkpoint of this "
                            f"step is written). {LIKELY_CAUSES}" + (f"; this run has {named}" if named else ""))


def nonfinite_tensors(named: Mapping[str, object]) -> list[str]:
    """The names of the float tensors in ``named`` holding NaN or inf (one fused max-abs pass)."""
    items = [(k, v.detach()) for k, v in named.items()
             if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()]
    if not items:
        return []
    peaks = torch._foreach_norm([v for _, v in items], float("inf"))
    finite = torch.stack([torch.isfinite(p).to("cpu") for p in peaks]).tolist()
    return [k for (k, _), ok in zip(items, finite, strict=True) if not ok]
