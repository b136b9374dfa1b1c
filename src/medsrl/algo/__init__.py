"""The RL math: advantages, policy loss, loss aggregation, KL, log-probs, dynamic sampling.

Small pure functions on tensors, each tested on its own with hand-computed values.
"""

from medsrl.algo.advantages import entropy_bonus_advantage, group_advantages
from medsrl.algo.aggregation import LOSS_AGG_MODES, aggregate_loss
from medsrl.algo.dynamic_sampling import (
    DynamicSamplingState,
    fill_batch,
    keep_mask_by_group_spread,
    zero_spread_groups,
)
from medsrl.algo.kl import kl_estimate, sampling_mismatch
from medsrl.algo.logprobs import masked_mean, token_entropy, token_logprobs
from medsrl.algo.policy_loss import PolicyLossOutput, clipped_surrogate

__all__ = [
    "LOSS_AGG_MODES",
    "DynamicSamplingState",
    "PolicyLossOutput",
    "aggregate_loss",
    "clipped_surrogate",
    "entropy_bonus_advantage",
    "fill_batch",
    "group_advantages",
    "keep_mask_by_group_spread",
    "kl_estimate",
    "sampling_mismatch",
    "masked_mean",
    "token_entropy",
    "token_logprobs",
    "zero_spread_groups",
]
