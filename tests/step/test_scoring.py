"""The scoring forward's micro-batches drop the left padding they share, exactly."""

from __future__ import annotations

import torch

from medsrl.meds.features import AnswerFeatureReader, FeatureSpec
from medsrl.models.char_tokenizer import build_char_tokenizer
from medsrl.models.tiny import build_tiny_model
from medsrl.rollout.base import pack_rollouts
from medsrl.step.scoring import response_logits, scoring_pass

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
            assert torch.allclose(got, want, atol=1e-5), rows


def test_meds_features_are_read_at_the_same_tokens_from_trimmed_forwards():
    model, packed = _model(), _batch()
    responses = [TOK.encode(r, add_special_tokens=False) for r in RESPONSES]
    spec = FeatureSpec(layers="all")

    def features(forward):
        reader = AnswerFeatureReader(model, TOK, spec)
        reader.begin(responses, packed.prompt_length)
        with torch.no_grad():
            for start, stop in ((0, 1), (1, 2), (2, 4)):  # rows 2:4 run 60 columns narrower
                with reader.microbatch(start, stop):
                    forward(model, packed, slice(start, stop))
        return reader.finish()

    (trimmed, rows), (full, full_rows) = features(response_logits), features(_full_width)
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
