"""Engine selection from ``rollout.backend`` and the vLLM settings (no vLLM needed)."""

from __future__ import annotations

import importlib.util

import pytest

from medsrl.config import RolloutConfig, VLLMConfig, parse_section
from medsrl.models.char_tokenizer import build_char_tokenizer
from medsrl.models.tiny import build_tiny_model
from medsrl.module import RLModule
from medsrl.rollout.factory import build_engine
from medsrl.rollout.hf import HFRolloutEngine


def test_rollout_config_reads_the_vllm_section():
    cfg = parse_section(RolloutConfig, {"backend": "vllm", "vllm": {"enforce_eager": True}}, "rollout")
    assert cfg.vllm == VLLMConfig(enforce_eager=True)
    with pytest.raises(ValueError, match=r"rollout\.vllm.*gpu_mem"):
        parse_section(RolloutConfig, {"vllm": {"gpu_mem": 0.3}}, "rollout")


def test_build_engine_picks_the_backend():
    model, tok = build_tiny_model(hidden_size=32, num_hidden_layers=1), build_char_tokenizer()
    engine = build_engine(RolloutConfig(max_batch_size=5), model, tok)
    assert isinstance(engine, HFRolloutEngine) and engine.max_batch_size == 5
    with pytest.raises(ValueError, match="valid: hf, vllm"):
        build_engine(RolloutConfig.model_construct(backend="sglang"), model, tok)  # past the schema
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ImportError, match="needs vllm"):
            build_engine(RolloutConfig(backend="vllm"), model, tok)


def test_module_accepts_vllm_and_rejects_unknown_backends():
    model, tok = build_tiny_model(hidden_size=32, num_hidden_layers=1), build_char_tokenizer()
    module = RLModule(model, tok, rollout={"backend": "vllm", "vllm": {"dtype": "bfloat16"}})
    assert module.rollout_cfg.vllm.dtype == "bfloat16"
    assert module.hparams["rollout"]["vllm"]["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="rollout.backend must be one of 'hf', 'vllm', got 'sglang'"):
        RLModule(model, tok, rollout={"backend": "sglang"})
