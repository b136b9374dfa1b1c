"""The micro-batch loss (the registered policy loss, times the plug-ins' per-token weights) and
the update on explicit inputs."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from medsrl.algo.settings import AlgorithmConfig
from medsrl.data.example import Prompt
from medsrl.models.tiny import build_tiny_model
from medsrl.reward.grader import GradeResult
from medsrl.rollout.base import RolloutBatch
from medsrl.step.rollouts import StepRollouts, split_groups
from medsrl.step.scoring import scoring_pass
from medsrl.step.update import UpdateConfig, engine_is_weights, micro_loss, policy_update
from medsrl.utils.guard import RunawayError, RunawayGuard, param_norm


def _setup():
    policy = build_tiny_model(seed=0, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=1, intermediate_size=32)
    cfg = UpdateConfig(AlgorithmConfig(micro_batch_size=4), grad_clip=0.0, max_new_tokens=8)
    batch = RolloutBatch([0, 0], [[5, 6], [5, 6]], [[7, 8, 9], [10, 11]], ["a", "b"], ["stop", "stop"])
    grades = [GradeResult(1.0, "1", True), GradeResult(0.0, "2", True)]
    r = StepRollouts.from_groups(split_groups([Prompt("k", "k", "k", "1", "t")], batch, grades), 0, None, 0, "cpu")
    r.old_logp, _ = scoring_pass(policy, r.packed, 4)
    r.old_logp = r.old_logp - 0.1  # a ratio away from 1, so clipping and weights both show
    return (policy, cfg), r


def _loss(inputs, r, adv):
    rows = torch.arange(len(r))
    return micro_loss(*inputs, r, adv, rows, float(r.packed.response_mask.sum()), float(len(r)))[0]


def _with(inputs, **algorithm):
    policy, cfg = inputs
    return policy, replace(cfg, algorithm=AlgorithmConfig(micro_batch_size=4, **algorithm))


def test_loss_weights_scale_each_tokens_term():
    inputs, r = _setup()
    adv = torch.tensor([1.0, -1.0])
    plain = _loss(inputs, r, adv)
    r.loss_weights = torch.full_like(r.packed.response_mask, 2.0)
    assert _loss(inputs, r, adv).item() == pytest.approx(2 * plain.item(), rel=1e-6)
    r.loss_weights = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # the second row silenced
    only_first = _loss(inputs, r, torch.tensor([1.0, 0.0]))
    r.loss_weights = None
    assert _loss(inputs, r, torch.tensor([1.0, 0.0])).item() == pytest.approx(only_first.item(), rel=1e-6)


def test_token_level_advantages_equal_broadcast_sequence_ones():
    inputs, r = _setup()
    seq = torch.tensor([0.5, -0.5])
    tok = seq[:, None].expand(2, r.packed.response_length).clone()
    assert _loss(inputs, r, tok).item() == pytest.approx(_loss(inputs, r, seq).item(), rel=1e-6)


def test_truncated_is_weights_the_policy_gradient_term_like_loss_weights():
    """algorithm.engine_is_cap: each sampled token's term times min(pi_old / pi_engine, cap),
    the same loss as those numbers given as plug-in loss weights; a row a plug-in added (R3's
    replay) keeps weight 1; no engine log-probs is an error that names the setting."""
    inputs, r = _setup()
    adv = torch.tensor([1.0, -1.0])
    ratio = torch.tensor([[1.0, 3.0, 0.5], [0.25, 1.5, 1.0]])  # pi_old / pi_engine per token
    r.engine_logp = r.old_logp - ratio.log()
    weights = ratio.clamp(max=2.0)
    r.loss_weights = weights
    want = _loss(inputs, r, adv)
    r.loss_weights = None
    inputs = _with(inputs, engine_is_cap=2.0)
    rows = torch.arange(len(r))
    loss, metrics = micro_loss(*inputs, r, adv, rows, float(r.packed.response_mask.sum()), float(len(r)))
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    mask = r.packed.response_mask.bool()  # rows of 3 and 2 tokens
    assert metrics["engine_is/weight_mean"] == pytest.approx(float(weights[mask].mean()), rel=1e-6)
    assert metrics["engine_is/capped_frac"] == pytest.approx(1 / int(mask.sum()))
    r.source = ["sampled", "r3"]
    r.loss_weights = torch.stack([weights[0], torch.ones(3)])
    want = _loss(_with(inputs), r, adv)
    r.loss_weights = None
    assert _loss(inputs, r, adv).item() == pytest.approx(want.item(), rel=1e-6)
    r.engine_logp = None
    with pytest.raises(ValueError, match="rollout.logprobs"):
        _loss(inputs, r, adv)



def test_sequence_modes_give_each_row_one_weight_across_its_tokens():
    """algorithm.engine_is_mode=sequence_*: one weight per response, exp(the sum of its tokens'
    log-ratios) over its response mask (rows of 3 and 2 tokens; the padding's 9.0 never counts),
    truncated or masked at the cap, on every column; a row a plug-in added keeps weight 1."""
    inputs, r = _setup()
    adv = torch.tensor([1.0, -1.0])
    diff = torch.tensor([[0.1, 0.2, -0.1], [0.5, 0.8, 9.0]])  # sums 0.2 and 1.3 (exp 1.22, 3.67)
    r.engine_logp = r.old_logp - diff
    rows = torch.arange(len(r))
    w = engine_is_weights(r, rows, r.old_logp, 2.0, "sequence_truncate")
    assert w.tolist() == [pytest.approx([math.exp(0.2)] * 3, rel=1e-6), [2.0] * 3]
    assert engine_is_weights(r, rows, r.old_logp, 2.0, "sequence_mask").tolist() == [
        pytest.approx([math.exp(0.2)] * 3, rel=1e-6), [0.0] * 3]
    r.loss_weights = torch.tensor([[math.exp(0.2)] * 3, [0.0] * 3])
    want = _loss(inputs, r, adv)
    r.loss_weights = None
    masked = _with(inputs, engine_is_cap=2.0, engine_is_mode="sequence_mask")
    loss, metrics = micro_loss(*masked, r, adv, rows, float(r.packed.response_mask.sum()), float(len(r)))
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert metrics["engine_is/masked_frac"] == pytest.approx(2 / 5)  # the second row's 2 tokens
    assert metrics["engine_is/weight_mean"] == pytest.approx(3 * math.exp(0.2) / 5, rel=1e-6)
    assert "engine_is/capped_frac" not in metrics
    r.source = ["sampled", "r3"]
    assert engine_is_weights(r, rows, r.old_logp, 2.0, "sequence_mask")[1].tolist() == [1.0] * 3


class TorchStepper:
    """A plain-torch optimiser stepper (what the module builds from Lightning's), recording calls."""

    def __init__(self, params, lr: float) -> None:
        self.opt = torch.optim.SGD(params, lr=lr)
        self.steps: list[bool] = []

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def backward(self, loss) -> None:
        loss.backward()

    def step(self, last: bool) -> None:
        self.steps.append(last)
        self.opt.step()

    def end_step(self) -> float:
        return self.opt.param_groups[0]["lr"]


def _two_groups() -> StepRollouts:
    batch = RolloutBatch([0, 0, 1, 1], [[5, 6]] * 4, [[7, 8], [9], [7], [8, 9]], list("abcd"), ["stop"] * 4)
    grades = [GradeResult(float(i % 2), "1", True) for i in range(4)]
    groups = split_groups([Prompt(k, k, k, "1", "t") for k in "ab"], batch, grades)
    return StepRollouts.from_groups(groups, 3, None, 0, "cpu")


def test_the_update_runs_on_explicit_inputs_without_lightning():
    """Two mini-batches: two optimiser steps, only the second the step's last; the guard checks
    the weights after each, naming step and update when they grew too much."""
    (policy, cfg), _ = _setup()
    cfg = replace(cfg, algorithm=AlgorithmConfig(micro_batch_size=4, mini_batch_prompts=1), grad_clip=1.0)
    r, adv = _two_groups(), torch.tensor([1.0, -1.0, 1.0, -1.0])
    before = [p.detach().clone() for p in policy.parameters()]
    stepper = TorchStepper(policy.parameters(), lr=1e-2)
    out = policy_update(policy, stepper, r, adv, cfg, RunawayGuard(100.0, start_norm=param_norm(before, False)))
    assert stepper.steps == [False, True] and out["lr"] == 1e-2 and out["nonfinite_updates"] == 0.0
    assert any(not torch.equal(p, b) for p, b in zip(policy.parameters(), before, strict=True))
    tiny_start = RunawayGuard(1.5, start_norm=1e-3, lr=1e-2)
    with pytest.raises(RunawayError,
                       match=r"^step 3: runaway update: .* grew from .*\(update 1/2\).*optim.optimizer.lr=0.01"):
        policy_update(policy, TorchStepper(policy.parameters(), lr=1e-2), r, adv, cfg, tiny_start)
