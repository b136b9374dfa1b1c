"""Rollout generation: the engine protocol, the HF ``generate`` engine, the backend factory
(``build_engine``; the vLLM engine is imported only when asked for) and batch packing."""

from medsrl.rollout.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    PackedRollouts,
    RolloutBatch,
    RolloutEngine,
    SamplingParams,
    pack_rollouts,
)
from medsrl.rollout.factory import build_engine
from medsrl.rollout.hf import HFRolloutEngine

__all__ = [
    "FINISH_LENGTH",
    "FINISH_STOP",
    "HFRolloutEngine",
    "PackedRollouts",
    "RolloutBatch",
    "RolloutEngine",
    "SamplingParams",
    "build_engine",
    "pack_rollouts",
]
