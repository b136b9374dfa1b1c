"""Parameter counts from the meta-device model equal the published sizes of the real checkpoints."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from medsrl.models.loading import random_model_like
from medsrl.models.settings import ModelConfig
from medsrl.plan.model_size import model_size, size_of
from medsrl.settings import parse
from run_helpers import ROOT


def _model(values) -> ModelConfig:
    """A model preset's settings (over the schema's defaults, which its ``defaults`` list names)."""
    values = OmegaConf.to_container(values) if not isinstance(values, dict) else values
    return parse(ModelConfig, {k: v for k, v in values.items() if k != "defaults"}, "model")


# the model cards' figures (tied embeddings counted once)
PUBLISHED = {"qwen2.5-math-1.5b": 1.54e9, "qwen2.5-math-7b": 7.62e9, "qwen3-1.7b": 1.72e9, "qwen3-8b": 8.19e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_the_model_cards(name):
    cfg = OmegaConf.load(ROOT / "configs" / "model" / f"{name}.yaml")
    size = model_size(_model(cfg))
    assert abs(size.params - PUBLISHED[name]) / PUBLISHED[name] < 0.005, size.params
    assert size.num_layers == cfg.shape.num_hidden_layers
    assert size.root_params + size.num_layers * size.layer_params == size.params
    head_dim = cfg.shape.head_dim
    assert size.kv_width == cfg.shape.num_key_value_heads * head_dim


def test_counts_are_the_real_models_counts():
    model = random_model_like("qwen3", 1000, hidden_size=64, num_hidden_layers=3, tie_word_embeddings=False)
    size = size_of(model)
    assert size.params == sum(p.numel() for p in model.parameters())
    layer = model.model.layers[0]
    assert size.layer_params == sum(p.numel() for p in layer.parameters())
    assert size.root_params == 2 * 1000 * 64 + 64  # embeddings, LM head, final norm


def test_tied_embeddings_are_counted_once():
    tied = size_of(random_model_like("qwen2", 1000, hidden_size=64, tie_word_embeddings=True))
    untied = size_of(random_model_like("qwen2", 1000, hidden_size=64, tie_word_embeddings=False))
    assert untied.params - tied.params == 1000 * 64


def test_a_named_model_without_shape_says_what_to_add():
    with pytest.raises(ValueError, match="model.shape"):
        model_size(_model({"name_or_path": "Org/NotHere-7B", "architecture": "qwen2"}))


def test_a_local_config_json_wins(tmp_path):
    random_model_like("qwen2", 500, hidden_size=32, num_hidden_layers=3).config.save_pretrained(tmp_path)
    size = model_size(_model({"name_or_path": str(tmp_path), "shape": {"hidden_size": 9999}}))
    assert (size.hidden_size, size.num_layers, size.vocab_size) == (32, 3, 500)


def test_with_lora_only_the_adapters_have_gradients_and_adamw_states():
    """Qwen2.5-7B with r=16 on every projection: 40,370,176 adapter parameters (PEFT's figure
    for that model); the plan gives gradients and AdamW states to those only, and no KL copy."""
    from medsrl.plan.cli import compose_train_config, plan_for

    cfg = OmegaConf.load(ROOT / "configs" / "model" / "qwen2.5-math-7b.yaml")
    assert model_size(_model(cfg)).trainable_params is None  # r 0: everything trains
    assert model_size(_model({**OmegaConf.to_container(cfg), "lora": {"r": 16}})).trainable_params == 40_370_176

    def bytes_of(overrides):
        plan = plan_for(compose_train_config(
            ["experiment=qwen2.5-math-7b_meds", "algorithm.kl_coef=0.001", *overrides]))
        return {(p.name, i.name): i.bytes for p in plan.phases for i in p.items}, plan.notes

    full, _ = bytes_of([])
    lora, notes = bytes_of(["model.lora.r=16"])
    shards = 8  # the experiment's FSDP ranks
    assert lora[("update", "gradients")] == 4 * 40_370_176 // shards
    assert lora[("update", "AdamW moments")] == 2 * 4 * 40_370_176 // shards
    assert ("scoring", "KL reference model") in full and ("scoring", "KL reference model") not in lora
    # the base stays whole, in bf16 under bf16-mixed (model.lora.base_dtype: compute); the adapters fp32
    assert lora[("update", "weights")] == full[("update", "weights")] // 2
    assert lora[("update", "adapter weights")] == 4 * 40_370_176 // shards
    assert any("LoRA: 40,370,176 adapter parameters" in n for n in notes)
