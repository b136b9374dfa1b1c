"""``optim``: the optimiser, its schedule and the guards of the update."""

from typing import Annotated

from pydantic import BeforeValidator, Field

from medsrl.settings import Beta, Count, Finite, NonNegative, Positive, Settings, as_tuple, must


class OptimConfig(Settings):
    """AdamW with linear warm-up then constant lr, stepped once per RL step."""

    lr: NonNegative = 1e-6
    """0 on purpose: a weights-only start that must keep the weights."""
    weight_decay: NonNegative = 0.1
    """AdamW's decoupled weight decay."""
    betas: Annotated[tuple[Beta, Beta], BeforeValidator(as_tuple),
                     must("a pair of numbers each in [0, 1)")] = (0.9, 0.999)
    """AdamW's moment decays."""
    eps: Positive = 1e-8
    """AdamW's epsilon."""
    warmup_steps: Count = 10
    """Linear warm-up over this many RL steps, then constant."""
    grad_clip: Annotated[Finite, Field(ge=0), must("a number >= 0 (0: no clipping)")] = 1.0
    """Gradient-norm clip per update; 0: no clipping."""
    max_param_norm_growth: Annotated[
        Annotated[Finite, Field(ge=0, le=0)] | Annotated[Finite, Field(gt=1)], must("0 (off) or a number > 1")
    ] = 100.0
    """Runaway guard (utils/guard.py): stop when the weights' norm exceeds this many times its
    value at the fit's first update; 0 leaves only the non-finite check."""

