"""Rollout generation: the engine protocol, the HF ``generate`` engine and batch packing."""

from medsrl.rollout.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    PackedRollouts,
    RolloutBatch,
    RolloutEngine,
    SamplingParams,
    pack_rollouts,
    response_logits_slice,
)
from medsrl.rollout.hf import HFRolloutEngine

__all__ = [
    "FINISH_LENGTH",
    "FINISH_STOP",
    "HFRolloutEngine",
    "PackedRollouts",
    "RolloutBatch",
    "RolloutEngine",
    "SamplingParams",
    "pack_rollouts",
    "response_logits_slice",
]
