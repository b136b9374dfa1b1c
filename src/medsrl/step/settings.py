"""``optim``: the optimiser and the lr schedule (Hydra ``_target_`` / ``_partial_`` nodes, as in
lightning-hydra-template: any torch optimiser or schedule, built by the module with the trained
parameters), and the guards of the update."""

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field

from medsrl.settings import (
    Beta,
    Count,
    Finite,
    NonNegative,
    Open,
    Positive,
    Settings,
    Text,
    as_tuple,
    must,
    nullable,
)

Betas = Annotated[tuple[Beta, Beta], BeforeValidator(as_tuple), must("a pair of numbers each in [0, 1)")]


class OptimizerSettings(Open):
    """``optim.optimizer``: a torch optimiser, called with the trained parameters. The keys named
    here are checked; others go to the optimiser as they are (``momentum`` for SGD ...)."""

    target: Text = Field("torch.optim.AdamW", alias="_target_")
    """The optimiser class."""
    partial: Literal[True] = Field(True, alias="_partial_")
    """Built by the module, with the trained parameters."""
    lr: NonNegative = 1e-6
    """The learning rate (after warm-up); 0 on purpose: a weights-only start that must keep the weights."""
    weight_decay: NonNegative = 0.1
    """Decoupled weight decay (AdamW)."""
    betas: nullable(Betas) = None
    """Adam's moment decays; null: the optimiser's own (AdamW: 0.9, 0.999)."""
    eps: nullable(Positive) = None
    """Adam's epsilon; null: the optimiser's own (AdamW: 1e-8)."""


class SchedulerSettings(Open):
    """``optim.scheduler``: the lr schedule, called with the optimiser, stepped once per RL step."""

    target: Text = Field("medsrl.step.lr_schedule.linear_warmup", alias="_target_")
    """The schedule: a function of the optimiser (and its settings) returning a torch scheduler."""
    partial: Literal[True] = Field(True, alias="_partial_")
    """Built by the module, with the optimiser."""
    warmup_steps: Count = 10
    """Linear warm-up over this many RL steps, then constant."""


class OptimConfig(Settings):
    """The optimiser, its lr schedule, and the update's gradient clip and runaway guard."""

    optimizer: OptimizerSettings = Field(default_factory=OptimizerSettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    grad_clip: Annotated[Finite, Field(ge=0), must("a number >= 0 (0: no clipping)")] = 1.0
    """Gradient-norm clip per update; 0: no clipping."""
    max_param_norm_growth: Annotated[
        Annotated[Finite, Field(ge=0, le=0)] | Annotated[Finite, Field(gt=1)], must("0 (off) or a number > 1")
    ] = 100.0
    """Runaway guard (utils/guard.py): stop when the weights' norm exceeds this many times its
    value at the fit's first update; 0 leaves only the non-finite check."""

    def built(self, params):
        """``(optimiser, scheduler)`` for ``params``: the two nodes through Hydra, a null key
        left to the optimiser's own default."""
        from hydra.utils import instantiate

        optimizer = instantiate({k: v for k, v in self.optimizer.model_dump(by_alias=True).items() if v is not None})
        optimizer = optimizer(params)
        return optimizer, instantiate(self.scheduler.model_dump(by_alias=True))(optimizer)
