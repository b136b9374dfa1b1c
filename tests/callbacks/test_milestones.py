"""Checkpoint retention (the last K full checkpoints) and bf16 weights-only milestones."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from medsrl.train import train
from run_helpers import compose_train

pytestmark = pytest.mark.slow


def test_last_two_checkpoints_kept_bf16_milestones_and_resume_from_the_link(tmp_path):
    out = tmp_path / "run"
    cfg = compose_train(out, ["trainer.max_steps=4", "callbacks.model_checkpoint.save_top_k=2",
                              "callbacks.model_checkpoint.save_last=link", "callbacks.milestones.every_n_steps=2"])
    train(cfg)
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "step_000003.ckpt", "step_000004.ckpt"]
    assert os.path.islink(ckpts / "last.ckpt")
    assert os.path.realpath(ckpts / "last.ckpt") == str((ckpts / "step_000004.ckpt").resolve())

    assert sorted(p.name for p in (out / "milestones").iterdir()) == ["step_000002", "step_000004"]
    milestone = out / "milestones" / "step_000004"
    loaded = AutoModelForCausalLM.from_pretrained(milestone, dtype="auto")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    state = torch.load(ckpts / "last.ckpt", weights_only=False)["state_dict"]
    for name, value in loaded.state_dict().items():  # the step-4 weights, rounded to bf16
        assert torch.equal(value, state[f"policy.{name}"].to(torch.bfloat16)), name
    assert (milestone / "tokenizer.json").exists()
    assert not list((out / "milestones").glob(".*"))  # no temporary folder left

    resumed = tmp_path / "resumed"
    summary = train(compose_train(resumed, ["trainer.max_steps=5", f"ckpt_path={ckpts / 'last.ckpt'}"]))
    assert summary["steps"] == 5
