"""Rollout types and packing: hand-checked tensors and log-prob equivalence with unpadded runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from medsrl.data.template import IM_END, render_prompt
from medsrl.models.char_tokenizer import build_char_tokenizer
from medsrl.models.tiny import build_tiny_model
from medsrl.rollout.base import (
    PackedRollouts,
    RolloutBatch,
    RolloutEngine,
    SamplingParams,
    pack_rollouts,
)
from medsrl.rollout.hf import HFRolloutEngine
from medsrl.step.scoring import response_logits


def test_sampling_params_defaults_and_validation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.max_new_tokens, p.seed) == (8, 1.0, 1.0, 256, None)
    assert not p.greedy and SamplingParams(temperature=0.0).greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.n = 3  # type: ignore[misc]
    for bad in (
        {"n": 0},
        {"max_new_tokens": 0},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"temperature": -1},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_rollout_batch_len_and_truncated():
    b = RolloutBatch(
        prompt_index=[0, 0, 1],
        prompt_ids=[[1], [1], [2, 3]],
        response_ids=[[4, 2], [5, 6, 7], [2]],
        response_text=["x", "yzw", ""],
        finish_reason=["stop", "length", "stop"],
    )
    assert len(b) == 3
    assert b.truncated == [False, True, False]
    assert b.response_lengths == [2, 3, 1]
    with pytest.raises(ValueError, match="disagree"):
        RolloutBatch([0], [[1]], [[2], [3]], ["a"], ["stop"])


def test_hf_engine_satisfies_protocol():
    engine = HFRolloutEngine(
        build_tiny_model(hidden_size=32, num_hidden_layers=1), build_char_tokenizer()
    )
    assert isinstance(engine, RolloutEngine)


def test_pack_rollouts_hand_checked():
    packed = pack_rollouts(
        prompt_ids=[[5, 6, 7], [8]],
        response_ids=[[9], [10, 11, 2]],
        pad_token_id=0,
    )
    assert isinstance(packed, PackedRollouts)
    assert packed.prompt_length == 3
    assert packed.response_length == 3
    expected_ids = torch.tensor([[5, 6, 7, 9, 0, 0], [0, 0, 8, 10, 11, 2]])
    expected_attn = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]])
    expected_pos = torch.tensor([[0, 1, 2, 3, 3, 3], [0, 0, 0, 1, 2, 3]])
    expected_resp = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    assert packed.input_ids.dtype == torch.long
    assert packed.attention_mask.dtype == torch.long
    assert packed.position_ids.dtype == torch.long
    assert packed.response_mask.dtype == torch.float32
    assert torch.equal(packed.input_ids, expected_ids)
    assert torch.equal(packed.attention_mask, expected_attn)
    assert torch.equal(packed.position_ids, expected_pos)
    assert torch.equal(packed.response_mask, expected_resp)
    assert torch.equal(packed.response_ids, torch.tensor([[9, 0, 0], [10, 11, 2]]))


def test_pack_rollouts_uses_given_pad_and_rejects_bad_input():
    packed = pack_rollouts([[3, 4], [5, 6]], [[7, 8], [9]], pad_token_id=99)
    assert torch.equal(packed.input_ids, torch.tensor([[3, 4, 7, 8], [5, 6, 9, 99]]))
    assert torch.equal(packed.position_ids, torch.tensor([[0, 1, 2, 3], [0, 1, 2, 2]]))
    with pytest.raises(ValueError):
        pack_rollouts([[1]], [[2], [3]], pad_token_id=0)
    with pytest.raises(ValueError):
        pack_rollouts([], [], pad_token_id=0)


def _token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_match_unpadded_single_runs(attn):
    tok = build_char_tokenizer()
    model = build_tiny_model(seed=3, hidden_size=64, num_hidden_layers=2, intermediate_size=128)
    model.set_attn_implementation(attn)
    model.eval()
    prompts = [render_prompt("1+1?", system_prompt=None), render_prompt("What is 12*13? Be brief.")]
    responses = ["2" + IM_END, "12*13 = 156, so \\boxed{156}"]
    prompt_ids = [tok(p)["input_ids"] for p in prompts]
    response_ids = [tok(r)["input_ids"] for r in responses]
    assert len(prompt_ids[0]) != len(prompt_ids[1])
    assert len(response_ids[0]) != len(response_ids[1])

    packed = pack_rollouts(prompt_ids, response_ids, pad_token_id=tok.pad_token_id)
    with torch.no_grad():  # the training step's forward: only the response positions' logits
        sl = response_logits(model, packed, slice(None))
    assert sl.shape[:2] == (2, packed.response_length)
    batch_lp = _token_logprobs(sl, packed.response_ids) * packed.response_mask

    for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        seq = torch.tensor([p + r])
        with torch.no_grad():
            alone = model(input_ids=seq).logits
        alone_lp = _token_logprobs(alone[:, len(p) - 1 : len(p) + len(r) - 1], torch.tensor([r]))[0]
        got = batch_lp[i, : len(r)]
        assert torch.allclose(got, alone_lp, atol=1e-5, rtol=0), (i, (got - alone_lp).abs().max())
        assert torch.all(batch_lp[i, len(r) :] == 0)


def _batch(logprobs: bool) -> RolloutBatch:
    return RolloutBatch(
        prompt_index=[0, 0, 1],
        prompt_ids=[[1], [1], [2]],
        response_ids=[[5, 6], [7], [8, 9, 3]],
        response_text=["a", "b", "c"],
        finish_reason=["stop", "length", "stop"],
        response_logprobs=[[-0.1, -0.2], [-0.3], [-0.4, -0.5, -0.6]] if logprobs else None,
    )


def test_rollout_batch_checks_logprob_lengths():
    with pytest.raises(ValueError, match="response 1: 1 tokens but 2 log-probs"):
        RolloutBatch([0, 0], [[1], [1]], [[5], [6]], ["a", "b"], ["stop"] * 2, [[-1.0], [-1.0, -2.0]])
    with pytest.raises(ValueError, match="response_logprobs"):
        RolloutBatch([0], [[1]], [[5]], ["a"], ["stop"], [])


@pytest.mark.parametrize("logprobs", [False, True])
def test_select_and_concat_groups_carry_every_field(logprobs):
    b = _batch(logprobs)
    first, second = b.select([0, 1]), b.select([2])
    assert first.prompt_index == [0, 0] and second.prompt_index == [0]
    joined = RolloutBatch.concat_groups([second, first])
    assert joined.prompt_index == [0, 1, 1]
    assert joined.response_ids == [[8, 9, 3], [5, 6], [7]]
    assert joined.finish_reason == ["stop", "stop", "length"]
    if logprobs:
        assert joined.response_logprobs == [[-0.4, -0.5, -0.6], [-0.1, -0.2], [-0.3]]
    else:
        assert joined.response_logprobs is None
    # mixing a batch without log-probs drops them rather than misaligning rows
    assert RolloutBatch.concat_groups([_batch(True).select([0]), _batch(False).select([2])]).response_logprobs is None
    assert len(RolloutBatch.concat_groups([])) == 0


def test_tokenize_prompts_orders_responses_and_refuses_bad_prompts():
    from medsrl.rollout.base import tokenize_prompts

    tok = build_char_tokenizer()
    ids, order = tokenize_prompts(tok, ["ab", "c"], 3, "E")
    assert ids == [tok("ab")["input_ids"], tok("c")["input_ids"]]
    assert order == [0, 0, 0, 1, 1, 1]
    assert tokenize_prompts(tok, [], 3, "E") == ([], [])
    with pytest.raises(TypeError, match="E.generate expects a list"):
        tokenize_prompts(tok, "ab", 1, "E")
    with pytest.raises(ValueError, match="Prompt 1 tokenizes to no tokens"):
        tokenize_prompts(tok, ["ab", ""], 1, "E")
