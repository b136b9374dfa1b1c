"""The RL math: advantages, policy loss, loss aggregation, KL, log-probs, dynamic sampling;
small pure functions on tensors, estimators and losses also by name through their registries."""

from medsrl.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    advantage_change_fraction,
    compute_advantages,
    gdpo_advantages,
    group_advantages,
    register_advantage,
    rloo_advantages,
)
from medsrl.algo.aggregation import LOSS_AGG_MODES, aggregate_loss
from medsrl.algo.covariance_losses import token_covariance  # also registers clip_cov, kl_cov
from medsrl.algo.group_spread import keep_mask_by_group_spread, zero_spread_groups
from medsrl.algo.kl import kl_estimate, sampling_mismatch
from medsrl.algo.logprobs import masked_mean, per_token, token_entropy, token_logprobs
from medsrl.algo.lp_reg import lowest_fraction, proxy_logprobs  # also registers lp_reg
from medsrl.algo.policy_loss import (
    POLICY_LOSSES,
    PolicyLossOutput,
    clipped_surrogate,
    compute_policy_loss,
    register_policy_loss,
)

__all__ = [
    "per_token",
    "lowest_fraction",
    "proxy_logprobs",
    "token_covariance",
    "ADVANTAGE_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdvantageInputs",
    "PolicyLossOutput",
    "aggregate_loss",
    "clipped_surrogate",
    "advantage_change_fraction",
    "compute_advantages",
    "compute_policy_loss",
    "gdpo_advantages",
    "group_advantages",
    "keep_mask_by_group_spread",
    "kl_estimate",
    "masked_mean",
    "register_advantage",
    "register_policy_loss",
    "rloo_advantages",
    "sampling_mismatch",
    "token_entropy",
    "token_logprobs",
    "zero_spread_groups",
]
