"""LoRA through PEFT (models/lora.py): wrapping, checkpoint keys, the KL reference with the
adapters off, merged weights for vLLM and the export, and the layer finders through the wrapper."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from medsrl.features.logit_capture import find_decoder_layers, find_final_norm, find_lm_head
from medsrl.models.lora import (
    apply_lora,
    checkpoint_state,
    export_view,
    is_lora,
    merged_state_dict,
    mismatch_message,
    reference_policy,
    target_problems,
    trainable_params,
    unwrap_peft,
)
from medsrl.models.policy import enable_activation_checkpointing
from medsrl.models.settings import DEFAULT_TARGETS, LoraSettings, ModelConfig
from medsrl.models.sharding import layer_classes
from medsrl.models.tiny import build_tiny_model
from medsrl.settings import parse

SETTINGS = LoraSettings(r=4, alpha=8.0)


def _tiny(seed: int = 0):
    return build_tiny_model(seed=seed, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, intermediate_size=64)


def _trained(policy):
    """``policy`` with every adapter weight random (lora_B starts at zero: the adapter would add nothing)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return policy


def _ids():
    return torch.randint(3, 60, (2, 10), generator=torch.Generator().manual_seed(0))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_settings_from_the_model_config():
    assert not ModelConfig().lora.enabled  # a model config without lora: off
    assert not parse(ModelConfig, {"lora": {"r": 0}}, "model").lora.enabled
    s = parse(ModelConfig, {"lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}}, "model").lora
    assert s.enabled and s.alpha / s.r == 2.0 and s.target_modules == ("q_proj", "v_proj") and s.merge_on_export
    assert parse(ModelConfig, {"lora": {"r": 8}}, "model").lora.target_modules == DEFAULT_TARGETS
    with pytest.raises(ValueError, match=r"model.lora.rank is not a setting of model.lora \(known: "):
        parse(ModelConfig, {"lora": {"rank": 8}}, "model")


def test_r0_leaves_the_policy_as_it_is():
    policy = _tiny()
    assert apply_lora(policy, LoraSettings(r=0)) is policy and not is_lora(policy)


def test_only_the_adapters_train_and_their_count_is_known_on_meta():
    policy = apply_lora(_tiny(), SETTINGS)
    assert is_lora(policy) and isinstance(policy, PeftModel)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    wrapped = {n.split(".base_layer")[0].rsplit(".", 1)[-1]
               for n, _ in policy.named_parameters() if ".base_layer." in n}
    assert wrapped == set(DEFAULT_TARGETS)
    with torch.device("meta"):
        meta = _tiny()
    assert trainable_params(meta, SETTINGS) == sum(p.numel() for n, p in policy.named_parameters() if n in trainable)


def test_adapters_start_the_same_whatever_the_global_generator():
    torch.manual_seed(1)
    a = apply_lora(_tiny(), SETTINGS)
    plain = _tiny()
    torch.manual_seed(2)
    before = torch.random.get_rng_state()
    b = apply_lora(plain, SETTINGS)
    assert torch.equal(torch.random.get_rng_state(), before)  # the run's own draws are untouched
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb), na


def test_a_target_that_matches_nothing_is_named():
    policy = _tiny()
    assert target_problems(policy, ["q_proj", "v_proj"]) == []
    (msg,) = target_problems(policy, ["q_proj", "qkv_proj"])
    assert msg.startswith("model.lora.target_modules: 'qkv_proj' matches no module of Qwen2ForCausalLM")
    assert "q_proj" in msg and "down_proj" in msg  # the names it could have meant
    with pytest.raises(ValueError, match="'qkv_proj' matches no module"):
        apply_lora(policy, LoraSettings(r=4, target_modules=("q_proj", "qkv_proj")))


def test_with_checkpointing_the_adapters_get_gradients():
    policy = _tiny().train()
    enable_activation_checkpointing(policy)
    policy = apply_lora(policy, SETTINGS)
    assert unwrap_peft(policy)._require_grads_hooks  # enable_input_require_grads, by PEFT
    assert not hasattr(apply_lora(_tiny(), SETTINGS).get_base_model(), "_require_grads_hooks")  # only then
    ids = _ids()
    policy(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in policy.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    assert any(float(g.abs().sum()) > 0 for n, g in grads.items() if "layers.0." in n)  # below the checkpoints too
    assert all(p.grad is None for p in policy.parameters() if not p.requires_grad)


def test_checkpoint_state_keeps_the_adapters_only():
    policy = apply_lora(_tiny(), SETTINGS)
    state = {f"policy.{k}": v for k, v in policy.state_dict().items()}
    kept = checkpoint_state(state, lora=True)
    assert kept and set(kept) == {f"policy.{n}" for n, p in policy.named_parameters() if p.requires_grad}
    assert checkpoint_state(state, lora=False) == state


def test_mismatch_messages_say_which_side_has_adapters():
    msg = mismatch_message(["policy.base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"],
                           ["policy.model.layers.0.self_attn.q_proj.weight"], lora=True)
    assert "holds full weights" in msg and "model.lora.r=0" in msg
    msg = mismatch_message([], ["policy.base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"],
                           lora=False)
    assert "holds LoRA adapter weights" in msg


def test_the_reference_is_the_base_model_with_the_adapters_off():
    base = _tiny()
    want = _logits(base, _ids())
    policy = _trained(apply_lora(copy.deepcopy(base), SETTINGS))
    trained = _logits(policy, _ids())
    assert not torch.allclose(trained, want)
    with reference_policy(policy, None) as ref:
        assert ref is policy
        torch.testing.assert_close(_logits(ref, _ids()), want)
    torch.testing.assert_close(_logits(policy, _ids()), trained)  # the adapters are back on
    assert all(p.requires_grad for n, p in policy.named_parameters() if "lora_" in n)
    other = object()
    with reference_policy(policy, other) as ref:  # full fine-tune: its own frozen copy
        assert ref is other


def test_merged_state_dict_is_the_merged_model_under_the_base_names():
    base = _tiny()
    names = list(base.state_dict())
    policy = _trained(apply_lora(base, SETTINGS))
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    merged = merged_state_dict(policy)
    assert list(merged) == names
    # W + scale * B @ A, by hand for one layer
    q = policy.base_model.model.model.layers[1].self_attn.q_proj
    want = q.base_layer.weight + SETTINGS.alpha / SETTINGS.r * q.lora_B["default"].weight @ q.lora_A["default"].weight
    torch.testing.assert_close(merged["model.layers.1.self_attn.q_proj.weight"], want)
    # and PEFT's own merge, on a copy
    reference = copy.deepcopy(policy).merge_and_unload().state_dict()
    assert list(reference) == names
    for k in names:
        torch.testing.assert_close(merged[k], reference[k], rtol=1e-6, atol=1e-7, msg=k)
    # the training model is untouched: nothing merged, the same weights
    assert not any(getattr(m, "merged", False) for m in policy.modules())
    for k, v in policy.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert merged_state_dict(_tiny()).keys() == _tiny().state_dict().keys()  # a plain model: its own


def test_merged_export_loads_as_a_plain_model(tmp_path):
    policy = _trained(apply_lora(_tiny(), SETTINGS))
    model, state = export_view(policy, merge=True)
    model.save_pretrained(tmp_path / "merged", state_dict=state)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not is_lora(loaded)
    torch.testing.assert_close(_logits(loaded, _ids()), _logits(policy, _ids()), rtol=1e-5, atol=1e-5)


def test_adapter_export_is_a_peft_adapter(tmp_path):
    base = _tiny()
    policy = _trained(apply_lora(copy.deepcopy(base), SETTINGS))
    model, state = export_view(policy, merge=False)
    assert model is policy and state is None
    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    assert not (tmp_path / "adapter" / "config.json").exists()
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    torch.testing.assert_close(_logits(loaded, _ids()), _logits(policy, _ids()))
    assert export_view(base, merge=True) == (base, None)  # a plain policy: as it is


def test_layer_finders_see_inside_the_wrapper():
    base = _tiny()
    layers, norm, head = base.model.layers, base.model.norm, base.lm_head
    policy = apply_lora(base, SETTINGS)
    assert unwrap_peft(policy) is base
    assert find_decoder_layers(policy) is layers  # MEDS's capture hooks
    assert find_final_norm(policy) is norm and find_lm_head(policy) is head  # and novelty's hook
    assert {c.__name__ for c in layer_classes(policy)} == {"Qwen2DecoderLayer"}  # FSDP's units
