"""Activation checkpointing as a per-model choice: non-reentrant, the same gradients."""

from __future__ import annotations

import torch

from medsrl.models.policy import enable_activation_checkpointing
from medsrl.models.tiny import build_tiny_model


def _grads(model, ids):
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_checkpointing_is_non_reentrant_and_changes_no_gradient():
    model = build_tiny_model(seed=1, hidden_size=32, num_hidden_layers=2, intermediate_size=64).train()
    ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    want = _grads(model, ids)
    enable_activation_checkpointing(model)
    layer = model.model.layers[0]
    assert layer.gradient_checkpointing
    assert layer._gradient_checkpointing_func.keywords["use_reentrant"] is False
    got = _grads(model, ids)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7, msg=name)
