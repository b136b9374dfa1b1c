"""``algorithm``: the advantage estimator and policy loss (by registry name, each with its typed
options), their shared settings and the update's batching."""

from typing import Annotated, Any

from pydantic import Field, model_validator

from medsrl.algo.advantages import ADVANTAGE_ESTIMATORS, ADVANTAGE_OPTIONS
from medsrl.algo.aggregation import LOSS_AGG_MODES
from medsrl.algo.engine_correction import ENGINE_IS_MODES
from medsrl.algo.kl import KL_ALIASES
from medsrl.algo.policy_loss import POLICY_LOSS_OPTIONS, POLICY_LOSSES
from medsrl.settings import (
    Finite,
    NonNegative,
    Positive,
    PositiveInt,
    Settings,
    Text,
    must,
    nullable,
    one_of,
    problems,
    raise_problems,
)


class AlgorithmConfig(Settings):
    """The RL loss: an advantage estimator and a policy loss from the registries (by name),
    their settings, and the update's batching. GRPO, DAPO, Dr.GRPO and MEDS are presets of these
    plus the plug-ins of ``algorithm.plugins``."""

    name: Text = "dapo"
    """The preset's name (logged; no effect)."""
    advantage: one_of(lambda: sorted(ADVANTAGE_ESTIMATORS)) = "grpo"
    """The advantage estimator (algo/advantages.py registry)."""
    advantage_options: dict[str, Any] = {}
    """The estimator's own options, checked against the options it registers (gdpo: weights, eps)."""
    policy_loss: one_of(lambda: sorted(POLICY_LOSSES)) = "vanilla"
    """The policy loss (algo/policy_loss.py registry)."""
    policy_loss_options: dict[str, Any] = {}
    """The loss's own options, checked against the options it registers (lp_reg: tau, rho, ...)."""
    clip_low: NonNegative = 0.2
    """PPO clip range below 1, for the losses that clip."""
    clip_high: NonNegative = 0.28
    """PPO clip range above 1 (DAPO's clip-higher: larger than clip_low)."""
    dual_clip: nullable(Annotated[Finite, Field(gt=1), must("a number > 1")]) = 10.0
    """Caps a negative-advantage token's loss at -A * dual_clip; null: off."""
    loss_agg_mode: one_of(LOSS_AGG_MODES) = "token-mean"
    """How token losses become the step's loss (algo/aggregation.py)."""
    kl_coef: NonNegative = 0.0
    """> 0 adds a KL loss against a frozen reference model (the start policy)."""
    kl_kind: one_of(KL_ALIASES) = "k3"
    """The KL estimator (algo/kl.py)."""
    entropy_coef: NonNegative = 0.0
    """> 0 adds an entropy bonus term to the loss."""
    ppo_epochs: PositiveInt = 1
    """Passes over the step's rollouts."""
    mini_batch_prompts: nullable(PositiveInt) = None
    """Prompts per optimiser update; null: the whole step in one update."""
    micro_batch_size: PositiveInt = 32
    """Sequences per forward/backward (at most)."""
    max_tokens_per_microbatch: nullable(PositiveInt) = None
    """Padded tokens per forward/backward: rows sorted by length, cut by this budget
    (step/micro_batches.py); null: cut by micro_batch_size alone, in row order."""
    engine_is_cap: nullable(Positive) = None
    """Truncated importance sampling of the engine's sampling mismatch: each token's
    policy-gradient term times min(pi_old / pi_engine, cap) (algo/engine_correction.py); needs
    rollout.logprobs. null: off."""
    engine_is_mode: one_of(ENGINE_IS_MODES) = "token_truncate"
    """What the cap does, per token or per response: token_truncate (min(ratio, cap)), token_mask
    (0 above the cap), sequence_truncate, sequence_mask (TRL's default)."""

    @model_validator(mode="after")
    def _options_known(self) -> "AlgorithmConfig":
        raise_problems(option_problems(self, "algorithm"))
        return self


def option_problems(algo: AlgorithmConfig, prefix: str) -> list[str]:
    """The estimator's and the loss's options each checked against the model it registered."""
    found = []
    for kind, name, options, models in (("advantage", algo.advantage, algo.advantage_options, ADVANTAGE_OPTIONS),
                                        ("policy_loss", algo.policy_loss, algo.policy_loss_options,
                                         POLICY_LOSS_OPTIONS)):
        found += problems(models[name], options, f"{prefix}.{kind}_options", owner=f"{kind} {name!r}")
    return found
