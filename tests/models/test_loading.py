"""Loading tokenizers / policies, and real architectures with random weights + the Qwen tokenizer."""

from __future__ import annotations

import pytest
import torch

from medsrl.data.template import render_prompt
from medsrl.models.loading import (
    ModelLoadError,
    load_policy,
    load_tokenizer,
    random_model_like,
    resolve_dtype,
    stop_token_ids,
)
from medsrl.models.tiny import build_tiny_model
from medsrl.rollout.base import SamplingParams
from medsrl.rollout.hf import HFRolloutEngine
from shared_paths import require_shared

TINY = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}


@pytest.fixture(scope="module")
def qwen_tok():
    path = require_shared("tokenizers", "qwen2.5-math")
    return load_tokenizer(str(path))


def test_load_tokenizer_char():
    for name in (None, "char"):
        tok = load_tokenizer(name)
        assert len(tok) == 101
        assert tok.pad_token_id == 0 and tok.eos_token_id == 2
        assert tok.padding_side == "left"
        assert stop_token_ids(tok) == [2, 0]


@pytest.mark.shared
def test_load_tokenizer_shared_qwen_offline(qwen_tok):
    tok = qwen_tok
    assert tok.padding_side == "left"
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 151643
    assert len(tok) == 151665
    assert stop_token_ids(tok) == [151645, 151643]
    assert tok("<|im_start|>system")["input_ids"] == [151644, 8948]
    batch = tok(["a", "a b c d"], padding=True)
    assert batch["attention_mask"][0][0] == 0  # left padding
    assert batch["input_ids"][0][0] == 151643


def test_resolve_dtype():
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype("torch.float16") is torch.float16
    assert resolve_dtype("auto") == "auto"
    with pytest.raises(ValueError):
        resolve_dtype("int3")


def test_load_policy_tiny_param_count_and_dtype():
    model = load_policy(tiny=TINY)
    # tied embedding 101*64 + 2 layers * (q 64*64+64, k/v 2*(64*32+32), o 64*64,
    # mlp 3*64*128, 2 norms 2*64) + final norm 64
    per_layer = (64 * 64 + 64) + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert sum(p.numel() for p in model.parameters()) == 101 * 64 + 2 * per_layer + 64 == 80768
    assert model.config.model_type == "qwen2"
    same = build_tiny_model(**TINY)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters(), strict=True)
    )
    bf16 = load_policy(
        "tiny", tiny={**TINY, "seed": 1}, dtype="bfloat16", attn_implementation="eager"
    )
    assert next(bf16.parameters()).dtype is torch.bfloat16
    assert bf16.config._attn_implementation == "eager"
    # default preset is about 1M parameters
    assert 0.5e6 < sum(p.numel() for p in load_policy().parameters()) < 2e6


def test_load_policy_from_local_directory_round_trip(tmp_path):
    model = load_policy(tiny=TINY)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = load_policy(str(tmp_path / "ckpt"))
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, loaded(ids).logits)
    assert next(loaded.parameters()).dtype is torch.float32


def test_load_policy_missing_path_error_names_path():
    with pytest.raises(ModelLoadError, match="/nonexistent/dir") as info:
        load_policy("/nonexistent/dir")
    assert "local directory" in str(info.value)
    with pytest.raises(OSError, match="/nonexistent/dir"):
        load_tokenizer("/nonexistent/dir")


def test_load_policy_bad_directory_error_mentions_offline(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError) as info:
        load_policy(str(tmp_path / "empty"))
    msg = str(info.value)
    assert str(tmp_path / "empty") in msg
    assert "hub" in msg and "local directory" in msg


def test_random_model_like_rejects_unknown_architecture():
    with pytest.raises(ValueError, match="gpt9"):
        random_model_like("gpt9", 100)


@pytest.mark.shared
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_random_real_architecture_with_qwen_tokenizer(arch, qwen_tok):
    tok = qwen_tok
    model = random_model_like(arch, len(tok), seed=0)
    assert model.config.model_type == arch
    assert model.config.vocab_size == len(tok)
    prompts = [render_prompt("What is 1+1?"), render_prompt("Compute $3^4$.")]
    ids = tok(prompts[0], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()

    engine = HFRolloutEngine(model, tok)
    assert engine.stop_token_ids == [151645, 151643]
    batch = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=4, seed=0))
    assert len(batch) == 4 and batch.prompt_index == [0, 0, 1, 1]
    assert batch.prompt_ids[0] == tok(prompts[0])["input_ids"]
    assert batch.prompt_ids[0][0] == 151644  # <|im_start|>, no BOS added for Qwen
    for ids_, text, reason in zip(
        batch.response_ids, batch.response_text, batch.finish_reason, strict=True
    ):
        assert 1 <= len(ids_) <= 4
        assert all(0 <= t < len(tok) for t in ids_)
        assert text == tok.decode(ids_, skip_special_tokens=True)
        assert reason == ("stop" if ids_[-1] in (151645, 151643) else "length")
    greedy = engine.generate(prompts[:1], SamplingParams(n=1, temperature=0.0, max_new_tokens=4))
    assert len(greedy.response_ids[0]) >= 1


def test_char_tokenizer_saved_beside_a_qwen2_config_keeps_spaces(tmp_path):
    """AutoTokenizer alone would pick Qwen2Tokenizer from config.json and drop spaces/newlines."""
    from medsrl.models.char_tokenizer import build_char_tokenizer
    from medsrl.models.tiny import build_tiny_model

    build_tiny_model(seed=0, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, intermediate_size=32).save_pretrained(tmp_path)
    original = build_char_tokenizer()
    original.save_pretrained(tmp_path)
    text = "<|im_start|>user\nStart at 4, add 2.<|im_end|>\n<|im_start|>assistant\n4 + 2 = 6. \\boxed{6}"
    loaded = load_tokenizer(str(tmp_path))
    assert loaded(text)["input_ids"] == original(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"]) == text
    assert loaded.padding_side == "left"


def test_char_tokenizer_saved_with_plain_names_still_loads(tmp_path):
    """Policies exported before the byte-level names keep loading with their own tokenizer."""
    import json

    from medsrl.models.char_tokenizer import ALPHABET, SPECIAL_TOKENS, UNK, build_char_tokenizer

    original = build_char_tokenizer()
    original.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    data["model"]["vocab"] = {t: i for i, t in enumerate(SPECIAL_TOKENS + [UNK] + ALPHABET)}
    data["pre_tokenizer"] = {"type": "Split", "pattern": {"String": ""}, "behavior": "Isolated", "invert": False}
    data["decoder"] = {"type": "Fuse"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    loaded = load_tokenizer(str(tmp_path))
    text = "a b\nc = 3"
    assert loaded(text)["input_ids"] == original(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"]) == text
