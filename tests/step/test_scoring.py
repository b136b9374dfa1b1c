"""The scoring forward's micro-batches drop the left padding they share, exactly."""

from __future__ import annotations

import pytest
import torch

from medsrl.algo import token_entropy, token_logprobs
from medsrl.features.reader import AnswerFeatureReader, FeatureSpec
from medsrl.models.char_tokenizer import build_char_tokenizer
from medsrl.models.tiny import build_tiny_model
from medsrl.rollout.base import pack_rollouts
from medsrl.step.scoring import output_head, response_logits, response_logprobs, scoring_pass

TOK = build_char_tokenizer()
# one long prompt (an R3 reflection prompt quotes a whole response) among short ones
PROMPTS = ["1+2=", "what is 7*6? An earlier attempt said 41, which is wrong. Try again:", "9-4", "2+2="]
RESPONSES = ["so \\boxed{3}", "7*6 = \\boxed{42}", "\\boxed{5} ok", "it is \\boxed{4}"]


def _batch():
    enc = lambda s: TOK.encode(s, add_special_tokens=False)  # noqa: E731
    return pack_rollouts([enc(p) for p in PROMPTS], [enc(r) for r in RESPONSES], TOK.pad_token_id)


def _model():
    return build_tiny_model(seed=5, hidden_size=32, num_hidden_layers=3, intermediate_size=64).eval()


def _full_width(model, packed, rows):
    out = model(input_ids=packed.input_ids[rows], attention_mask=packed.attention_mask[rows],
                position_ids=packed.position_ids[rows], use_cache=False,
                logits_to_keep=packed.response_mask.shape[1] + 1)
    return out.logits[:, :-1]


def test_trimmed_micro_batches_give_the_full_width_logits():
    model, packed = _model(), _batch()
    with torch.no_grad():
        for rows in (slice(2, 4), slice(0, 1), slice(0, 4)):
            got, want = response_logits(model, packed, rows), _full_width(model, packed, rows)
            assert got.shape == want.shape
            mask = packed.response_mask[rows].bool()
            assert torch.allclose(got[mask], want[mask], atol=1e-5), rows
            # the right padding all the rows share is not run: zeros there
            end = packed.columns_end(rows) - packed.prompt_length
            assert end < packed.response_length or rows == slice(0, 4)
            assert not got[:, end:].any(), rows


def test_meds_features_are_read_at_the_same_tokens_from_trimmed_forwards():
    model, packed = _model(), _batch()
    responses = [TOK.encode(r, add_special_tokens=False) for r in RESPONSES]
    spec = FeatureSpec(layers="all")

    def features(forward, trimmed):
        reader = AnswerFeatureReader(model, TOK, spec)
        reader.begin(responses, packed.prompt_length)
        with torch.no_grad():
            for start, stop in ((0, 1), (1, 2), (2, 4)):  # rows 2:4 run 60 columns narrower
                end = packed.columns_end(slice(start, stop)) if trimmed else None
                with reader.microbatch(range(start, stop), end):
                    forward(model, packed, slice(start, stop))
        return reader.finish()

    (trimmed, rows), (full, full_rows) = features(response_logits, True), features(_full_width, False)
    assert torch.equal(rows, full_rows) and rows.tolist() == [0, 1, 2, 3]
    assert torch.allclose(trimmed, full, atol=1e-5)
    # and the scoring pass's log-probs match a full-width forward's
    logp, _ = scoring_pass(model, packed, micro_batch_size=2)
    with torch.no_grad():
        ref = torch.log_softmax(_full_width(model, packed, slice(None)), -1)
    labels = packed.input_ids[:, packed.prompt_length:]
    want = ref.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    m = packed.response_mask.bool()
    assert torch.allclose(logp[m], want[m], atol=1e-5)


# --- the shared-prompt forward: groups of responses to one prompt run that prompt once ----------

GROUP_PROMPTS = ["1+2=", "1+2=", "1+2=", "what is 7*6? Think first.", "what is 7*6? Think first.", "9-4", "1+2="]
GROUP_RESPONSES = ["so \\boxed{3}", "3", "\\boxed{4} no", "7*6 = \\boxed{42}", "42", "\\boxed{5} ok",
                   "it is \\boxed{3}"]


def _groups():
    enc = lambda s: TOK.encode(s, add_special_tokens=False)  # noqa: E731
    packed = pack_rollouts([enc(p) for p in GROUP_PROMPTS], [enc(r) for r in GROUP_RESPONSES], TOK.pad_token_id)
    return packed, [enc(r) for r in GROUP_RESPONSES]


def _logp_and_grads(model, forward, packed, rows):
    model.zero_grad(set_to_none=True)
    logits = forward(model, packed, rows)
    labels = packed.input_ids[rows, packed.prompt_length :]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    (logp * packed.response_mask[rows] * torch.linspace(0.5, 1.5, logp.shape[1])).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _backbone_calls(model, fn):
    """``fn()``, and the number of rows each backbone forward ran with a cache passed in."""
    calls = []

    def hook(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        calls.append(None if cache is None else kwargs["input_ids"].shape[0])

    handle = model.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        fn()
    finally:
        handle.remove()
    return calls


def test_shared_prompts_give_the_full_forwards_logits_and_gradients():
    """Runs of one prompt (3, 2, 1, then the first prompt again, not shared with its first run)
    give the logits and the gradients of the full forward: the gradient reaches the prompt's
    forward through the expanded KV cache, summed over the group's rows."""
    model, (packed, _) = _model().train(), _groups()
    # the prompts' forward (4 runs, no cache), then the 7 responses on top of the cache
    assert _backbone_calls(model, lambda: response_logits(model, packed, slice(0, 7))) == [None, 7]
    # no shared prompt: one full forward
    assert _backbone_calls(model, lambda: response_logits(model, packed, slice(4, 7))) == [None]
    for rows in (slice(0, 7), slice(1, 5), torch.tensor([0, 1, 2, 6])):
        got, got_grads = _logp_and_grads(model, response_logits, packed, rows)
        want, want_grads = _logp_and_grads(model, _full_width, packed, rows)
        mask = packed.response_mask[rows].bool()
        assert torch.allclose(got[mask], want[mask], atol=1e-5), rows
        for name, g in want_grads.items():
            assert torch.allclose(got_grads[name], g, rtol=1e-4, atol=1e-6), (rows, name)


def test_meds_features_are_read_from_the_response_forward_of_shared_prompts():
    model, (packed, responses) = _model(), _groups()
    reader = AnswerFeatureReader(model, TOK, FeatureSpec(layers="all"))

    def features(forward, trimmed):
        reader.begin(responses, packed.prompt_length)
        with torch.no_grad():
            for start, stop in ((0, 4), (4, 7)):
                end = packed.columns_end(slice(start, stop)) if trimmed else None
                forward(model, packed, slice(start, stop), reader.microbatch(range(start, stop), end))
        return reader.finish()

    def full(model, packed, rows, context):
        with context:
            return _full_width(model, packed, rows)

    (shared, rows), (want, want_rows) = features(response_logits, True), features(full, False)
    assert torch.equal(rows, want_rows) and rows.tolist() == [0, 2, 3, 5, 6]
    assert torch.allclose(shared, want, atol=1e-5)


def test_the_scoring_pass_is_the_full_forwards_with_shared_prompts():
    model, (packed, _) = _model(), _groups()
    logp, stats = scoring_pass(model, packed, 3, reducers={"entropy": lambda logits, labels: logits.logsumexp(-1)})
    with torch.no_grad():
        logits = _full_width(model, packed, slice(0, 7))
    labels = packed.input_ids[:, packed.prompt_length :]
    want = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    mask = packed.response_mask.bool()
    assert torch.allclose(logp[mask], want[mask], atol=1e-5)
    assert torch.allclose(stats["entropy"][mask], logits.logsumexp(-1)[mask], atol=1e-5)


def test_checkpointing_runs_the_full_forward_in_training_and_the_scoring_pass_still_shares_prompts():
    from medsrl.models.policy import enable_activation_checkpointing

    model, (packed, _) = _model(), _groups()
    want, _ = scoring_pass(model, packed, 7)
    enable_activation_checkpointing(model)
    model.train()
    assert _backbone_calls(model, lambda: response_logits(model, packed, slice(0, 7))) == [None]
    # the scoring pass runs in eval mode: nothing is checkpointed, the prompts run once
    calls = _backbone_calls(model, lambda: scoring_pass(model, packed, 7))
    assert calls == [None, 7] and model.training
    got, _ = scoring_pass(model, packed, 7)
    assert torch.equal(got, want)


# --- the fused head: log-probs of the response positions without [b, R, V] logits ----------------



@pytest.mark.parametrize("rows", [slice(0, 7), slice(1, 5), slice(4, 7), torch.tensor([0, 1, 2, 6])],
                         ids=["all-shared", "part-shared", "unshared", "index"])
def test_response_logprobs_equal_the_logits_path_in_values_and_gradients(rows):
    """Both ways (shared prompt and whole rows): the fused head's log-probs and entropies, and the
    model's gradients through them, are those of the full logits."""
    model, (packed, _) = _model().train(), _groups()
    labels = packed.input_ids[rows, packed.prompt_length :]
    mask = packed.response_mask[rows]
    weights = mask * torch.linspace(0.5, 1.5, mask.shape[1])

    def run(fn):
        model.zero_grad(set_to_none=True)
        logp, ent = fn()
        ((logp + 0.1 * ent) * weights).sum().backward()
        return logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    def logits_path():
        logits = response_logits(model, packed, rows)
        return token_logprobs(logits, labels), token_entropy(logits)

    def fused_path():
        out = response_logprobs(model, packed, rows, entropy=True)
        return out.logp, out.entropy

    (logp, ent, grads), (want_logp, want_ent, want_grads) = run(fused_path), run(logits_path)
    m = mask.bool()
    torch.testing.assert_close(logp[m], want_logp[m], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent[m], want_ent[m], atol=1e-5, rtol=1e-5)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-4, msg=name)


def test_response_logprobs_reducers_equal_those_of_the_logits():
    model, (packed, _) = _model(), _groups()
    reducers = {"entropy": lambda logits, y: token_entropy(logits)}
    with torch.no_grad():
        out = response_logprobs(model, packed, slice(0, 7), reducers=reducers)
        logits = response_logits(model, packed, slice(0, 7))
    m = packed.response_mask.bool()
    torch.testing.assert_close(out.stats["entropy"][m], token_entropy(logits)[m], atol=1e-5, rtol=1e-5)
    labels = packed.input_ids[:, packed.prompt_length :]
    torch.testing.assert_close(out.logp[m], token_logprobs(logits, labels)[m], atol=1e-5, rtol=1e-5)


def test_response_logprobs_leave_the_head_as_it_was():
    model, (packed, _) = _model(), _groups()
    head = output_head(model)
    with torch.no_grad():
        response_logprobs(model, packed, slice(0, 7))
    assert "forward" not in head.__dict__  # the class's forward again
    out = model(input_ids=packed.input_ids[:1])
    assert out.logits.shape[-1] == model.config.vocab_size


def test_output_head_refuses_a_model_that_transforms_its_logits():
    model = _model()
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        output_head(model)


def test_a_token_budget_scoring_pass_gives_the_row_order_ones_log_probs_stats_and_features():
    """Rows sorted by length and cut by a token budget (micro-batches of rows in no fixed order,
    each run only to its own longest response): the log-probs, the reducers' values and the MEDS
    features read through ``microbatch_context`` are those of row-order micro-batches."""
    from medsrl.step.scoring import scoring_micro_batches

    model, (packed, responses) = _model(), _groups()
    reader = AnswerFeatureReader(model, TOK, FeatureSpec(layers="all"))
    reducers = {"entropy": lambda logits, labels: token_entropy(logits)}

    def run(mb, max_tokens):
        reader.begin(responses, packed.prompt_length)
        seen = []

        def context(rows):
            seen.append(rows.tolist())
            return reader.microbatch(rows, packed.columns_end(rows))

        logp, stats = scoring_pass(model, packed, mb, max_tokens=max_tokens, reducers=reducers,
                                   microbatch_context=context)
        return logp, stats["entropy"], *reader.finish(), seen

    logp, ent, feats, rows, seen = run(2, None)
    b_logp, b_ent, b_feats, b_rows, b_seen = run(7, 60)
    assert seen == [[0, 1], [2, 3], [4, 5], [6]]
    assert b_seen == [b.tolist() for b in scoring_micro_batches(packed, 7, 60)] and len(b_seen) > 1
    assert any(b != list(range(b[0], b[0] + len(b))) for b in b_seen)  # a cut that is not a slice
    m = packed.response_mask.bool()
    torch.testing.assert_close(b_logp[m], logp[m], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b_ent[m], ent[m], atol=1e-5, rtol=1e-5)
    for b in b_seen:  # each ran to its own longest response: zeros past it
        assert not b_logp[b, packed.columns_end(torch.tensor(b)) - packed.prompt_length:].any()
    assert torch.equal(b_rows, rows)
    torch.testing.assert_close(b_feats, feats, atol=1e-5, rtol=1e-5)
