"""LoRA as users run it (issue 43): under ``trainer.precision=bf16-mixed`` the frozen base loads in
bf16 (``model.lora.base_dtype: compute``) and the adapters, the only trained weights, are fp32;
``model.lora.base_dtype=float32`` keeps an fp32 base. On the tiny preset's architecture, CPU."""

from __future__ import annotations

import pytest
import torch

from medsrl.models.lora import adapters_to, apply_lora
from medsrl.models.policy import build_policy
from medsrl.models.settings import LoraSettings, ModelConfig, compute_dtype
from medsrl.models.tiny import build_tiny_model
from medsrl.settings import parse

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "intermediate_size": 64}


def _model(**lora) -> ModelConfig:
    return parse(ModelConfig, {"tokenizer": "char", "tiny": TINY, "lora": {"r": 4, **lora}}, "model")


def _dtypes(policy) -> tuple[set, set]:
    """(the frozen parameters' dtypes, the trained ones')."""
    named = list(policy.parameters())
    return {p.dtype for p in named if not p.requires_grad}, {p.dtype for p in named if p.requires_grad}


@pytest.mark.parametrize(("precision", "name"), [("bf16-mixed", "bfloat16"), ("bf16-true", "bfloat16"),
                                                 ("16-mixed", "float16"), ("32-true", None), (32, None)])
def test_compute_dtype_of_a_precision(precision, name):
    assert compute_dtype(precision) == name


@pytest.mark.parametrize(("base_dtype", "precision", "base"), [
    ("compute", "bf16-mixed", torch.bfloat16),  # the default, as users run LoRA on a GPU
    ("compute", "32-true", torch.float32),  # the CPU presets: model.dtype
    ("float32", "bf16-mixed", torch.float32),  # an fp32 base, asked for by name
    ("bfloat16", "32-true", torch.bfloat16),
])
def test_the_base_loads_in_its_dtype_and_the_adapters_in_fp32(base_dtype, precision, base):
    model = _model(base_dtype=base_dtype)
    assert model.weights_dtype(precision) == str(base).removeprefix("torch.")
    policy, _ = build_policy(model, precision=precision)
    assert _dtypes(policy) == ({base}, {torch.float32})
    no_lora = parse(ModelConfig, {"tokenizer": "char", "tiny": TINY}, "model")
    assert no_lora.weights_dtype(precision) == "float32"  # a full fine-tune: model.dtype, whatever the precision


def test_a_bf16_base_trains_fp32_adapters_that_keep_lr_1e_6_updates():
    """Two AdamW steps at lr 1e-6 under bf16 autocast: the base stays bit-identical, and over 90 %
    of every lora_A moves (rounded to bf16, under 10 % would: the step is below half a bf16
    spacing at ~0.1)."""
    policy, _ = build_policy(_model(), precision="bf16-mixed")
    trained = [p for p in policy.parameters() if p.requires_grad]
    base = {n: p.detach().clone() for n, p in policy.named_parameters() if not p.requires_grad}
    lora_a = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_A" in n}
    opt = torch.optim.AdamW(trained, lr=1e-6, weight_decay=0.0)
    ids = torch.randint(3, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # the first step moves lora_B off 0, the second gives lora_A a gradient
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = policy(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert all(p.dtype == torch.float32 for p in trained)
    for n, p in policy.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, base[n]), n
    moved = [(p.detach() != lora_a[n]).float().mean().item() for n, p in policy.named_parameters() if n in lora_a]
    assert min(moved) > 0.9, moved
    as_bf16 = [(p.detach().bfloat16() != lora_a[n].bfloat16()).float().mean().item()
               for n, p in policy.named_parameters() if n in lora_a]
    assert max(as_bf16) < 0.1, as_bf16  # what a bf16 adapter would have kept


def test_apply_lora_casts_only_the_trained_parameters():
    policy = build_tiny_model(seed=0, **TINY).to(torch.bfloat16)
    wrapped = apply_lora(policy, LoraSettings(r=4), adapter_dtype=torch.float32)
    assert _dtypes(wrapped) == ({torch.bfloat16}, {torch.float32})
    adapters_to(wrapped, torch.bfloat16)  # and back: the base is untouched either way
    assert _dtypes(wrapped) == ({torch.bfloat16}, {torch.bfloat16})
