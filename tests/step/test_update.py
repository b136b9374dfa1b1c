"""The micro-batch loss: the registered policy loss, times the plug-ins' per-token weights."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from medsrl.config import AlgorithmConfig
from medsrl.data.example import Prompt
from medsrl.models.tiny import build_tiny_model
from medsrl.reward.grader import GradeResult
from medsrl.rollout.base import RolloutBatch
from medsrl.step.rollouts import StepRollouts, split_groups
from medsrl.step.scoring import scoring_pass
from medsrl.step.update import micro_loss


def _setup():
    policy = build_tiny_model(seed=0, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=1, intermediate_size=32)
    module = SimpleNamespace(algorithm=AlgorithmConfig(micro_batch_size=4), policy=policy,
                             rollout_cfg=SimpleNamespace(max_new_tokens=8))
    batch = RolloutBatch([0, 0], [[5, 6], [5, 6]], [[7, 8, 9], [10, 11]], ["a", "b"], ["stop", "stop"])
    grades = [GradeResult(1.0, "1", True), GradeResult(0.0, "2", True)]
    r = StepRollouts.from_groups(split_groups([Prompt("k", "k", "k", "1", "t")], batch, grades), 0, None, 0, "cpu")
    r.old_logp, _ = scoring_pass(policy, r.packed, 4)
    r.old_logp = r.old_logp - 0.1  # a ratio away from 1, so clipping and weights both show
    return module, r


def _loss(module, r, adv):
    rows = torch.arange(len(r))
    return micro_loss(module, r, adv, rows, float(r.packed.response_mask.sum()), float(len(r)))[0]


def test_loss_weights_scale_each_tokens_term():
    module, r = _setup()
    adv = torch.tensor([1.0, -1.0])
    plain = _loss(module, r, adv)
    r.loss_weights = torch.full_like(r.packed.response_mask, 2.0)
    assert _loss(module, r, adv).item() == pytest.approx(2 * plain.item(), rel=1e-6)
    r.loss_weights = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # the second row silenced
    only_first = _loss(module, r, torch.tensor([1.0, 0.0]))
    r.loss_weights = None
    assert _loss(module, r, torch.tensor([1.0, 0.0])).item() == pytest.approx(only_first.item(), rel=1e-6)


def test_token_level_advantages_equal_broadcast_sequence_ones():
    module, r = _setup()
    seq = torch.tensor([0.5, -0.5])
    tok = seq[:, None].expand(2, r.packed.response_length).clone()
    assert _loss(module, r, tok).item() == pytest.approx(_loss(module, r, seq).item(), rel=1e-6)


def test_truncated_is_weights_the_policy_gradient_term_like_loss_weights():
    """algorithm.engine_is_cap: each sampled token's term times min(pi_old / pi_engine, cap),
    the same loss as those numbers given as plug-in loss weights; a row a plug-in added (R3's
    replay) keeps weight 1; no engine log-probs is an error that names the setting."""
    module, r = _setup()
    adv = torch.tensor([1.0, -1.0])
    ratio = torch.tensor([[1.0, 3.0, 0.5], [0.25, 1.5, 1.0]])  # pi_old / pi_engine per token
    r.engine_logp = r.old_logp - ratio.log()
    weights = ratio.clamp(max=2.0)
    r.loss_weights = weights
    want = _loss(module, r, adv)
    r.loss_weights = None
    module.algorithm = AlgorithmConfig(micro_batch_size=4, engine_is_cap=2.0)
    rows = torch.arange(len(r))
    loss, metrics = micro_loss(module, r, adv, rows, float(r.packed.response_mask.sum()), float(len(r)))
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    mask = r.packed.response_mask.bool()  # rows of 3 and 2 tokens
    assert metrics["engine_is/weight_mean"] == pytest.approx(float(weights[mask].mean()), rel=1e-6)
    assert metrics["engine_is/capped_frac"] == pytest.approx(1 / int(mask.sum()))
    r.source = ["sampled", "r3"]
    r.loss_weights = torch.stack([weights[0], torch.ones(3)])
    module.algorithm = AlgorithmConfig(micro_batch_size=4)
    want = _loss(module, r, adv)
    r.loss_weights = None
    module.algorithm = AlgorithmConfig(micro_batch_size=4, engine_is_cap=2.0)
    assert _loss(module, r, adv).item() == pytest.approx(want.item(), rel=1e-6)
    r.engine_logp = None
    with pytest.raises(ValueError, match="rollout.logprobs"):
        _loss(module, r, adv)
