"""Engine selection from ``rollout.backend`` and the vLLM settings (no vLLM needed)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from medsrl.models.char_tokenizer import build_char_tokenizer
from medsrl.models.tiny import build_tiny_model
from medsrl.module import RLModule
from medsrl.rollout.factory import (
    build_engine,
    describe_prompt_token_limit,
    engine_max_model_len,
    prompt_token_limit,
)
from medsrl.rollout.hf import HFRolloutEngine
from medsrl.rollout.settings import RolloutConfig, VLLMConfig
from medsrl.settings import parse


def test_rollout_config_reads_the_vllm_section():
    cfg = parse(RolloutConfig, {"backend": "vllm", "vllm": {"enforce_eager": True}}, "rollout")
    assert cfg.vllm == VLLMConfig(enforce_eager=True)
    with pytest.raises(ValueError, match=r"rollout\.vllm.*gpu_mem"):
        parse(RolloutConfig, {"vllm": {"gpu_mem": 0.3}}, "rollout")


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
    module = RLModule(model, tok, rollout=RolloutConfig(backend="vllm", vllm={"dtype": "bfloat16"}))
    assert module.rollout_cfg.vllm.dtype == "bfloat16"
    assert module.hparams["rollout"]["vllm"]["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="must be one of 'hf', 'vllm'"):
        RolloutConfig(backend="sglang")


def model_with(positions: int | None):
    """A stand-in policy whose config has ``positions`` (None: no max_position_embeddings)."""
    return SimpleNamespace(config=SimpleNamespace() if positions is None
                           else SimpleNamespace(max_position_embeddings=positions))


@pytest.mark.parametrize("backend", ["hf", "vllm"])
@pytest.mark.parametrize(
    ("settings", "positions", "max_model_len", "limit"),
    [
        # the budgets: max_prompt_tokens + max_new_tokens within the model's positions
        ({"max_prompt_tokens": 2048, "max_new_tokens": 3072}, 40960, 5120, 2048),
        # positions smaller than the budget cap it (Qwen2.5-Math: 4096): issue 35's 1024
        ({"max_prompt_tokens": 2048, "max_new_tokens": 3072}, 4096, 4096, 1024),
        ({"max_prompt_tokens": 1024, "max_new_tokens": 3072}, 4096, 4096, 1024),
        ({"max_prompt_tokens": 512, "max_new_tokens": 3072}, 4096, 3584, 512),
        ({"max_prompt_tokens": 300, "max_new_tokens": 100}, None, 400, 300),  # no positions known
        # rollout.vllm.max_model_len wins, whatever the positions (both backends)
        ({"max_new_tokens": 3072, "vllm": {"max_model_len": 3600}}, 4096, 3600, 528),
        ({"max_new_tokens": 3072, "vllm": {"max_model_len": 8192}}, 4096, 8192, 5120),
    ],
)
def test_prompt_token_limit_is_max_model_len_less_the_new_tokens(backend, settings, positions,
                                                                 max_model_len, limit):
    cfg = parse(RolloutConfig, {"backend": backend, **settings}, "rollout")
    policy = model_with(positions)
    assert engine_max_model_len(cfg, policy) == max_model_len
    assert prompt_token_limit(cfg, policy) == limit


def test_prompt_token_limit_of_the_tiny_model_and_its_description():
    cfg = RolloutConfig(max_new_tokens=64)
    tiny = build_tiny_model(hidden_size=32, num_hidden_layers=1)  # 1024 positions
    assert prompt_token_limit(cfg, tiny) == 1024 - 64
    assert describe_prompt_token_limit(cfg, tiny) == (
        "min(rollout.max_prompt_tokens 2048 + rollout.max_new_tokens 64, the model's 1024 positions)"
        " - rollout.max_new_tokens 64")
    cfg = RolloutConfig(max_new_tokens=64, vllm=VLLMConfig(max_model_len=512))
    assert describe_prompt_token_limit(cfg, tiny) == (
        "rollout.vllm.max_model_len 512 - rollout.max_new_tokens 64")


def test_no_room_for_a_prompt_fails_naming_the_settings():
    cfg = RolloutConfig(max_new_tokens=3072)  # a 1024-position model
    with pytest.raises(ValueError, match=r"no room for a prompt: min\(rollout.max_prompt_tokens 2048 \+ "
                       r"rollout.max_new_tokens 3072, the model's 1024 positions\) - rollout.max_new_tokens "
                       r"3072 = -2048; lower rollout.max_new_tokens"):
        prompt_token_limit(cfg, model_with(1024))
    with pytest.raises(ValueError, match="rollout.vllm.max_model_len 3072 - rollout.max_new_tokens 3072 = 0"):
        prompt_token_limit(RolloutConfig(max_new_tokens=3072, vllm=VLLMConfig(max_model_len=3072)),
                           model_with(4096))
