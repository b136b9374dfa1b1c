"""The MEDS feature (features/reader.py): reference-style diffs, bf16 rounding, the shared reader."""

from __future__ import annotations

import pytest
import torch

from logit_reference import hook_count, reference_features
from medsrl.features.answer_locator import locate_answers
from medsrl.features.logit_capture import (
    LayerLogitCapture,
    answer_targets,
    find_decoder_layers,
    select_layers,
)
from medsrl.features.reader import (
    AnswerFeatureReader,
    FeatureSpec,
    capture_layers,
    feature_layers,
    layer_diffs,
    resolve_feature_dtype,
    round_to_bfloat16,
)
from medsrl.models.char_tokenizer import build_char_tokenizer
from medsrl.models.tiny import build_tiny_model
from medsrl.rollout.base import pack_rollouts

TOK = build_char_tokenizer()

# Rows 1 and 4 have no answer ("{" last in row 4: nothing to score); row 3 has two boxes.
PROMPTS = ["1+2=", "what is 7*6?", "9-4", "2+2=", "10/5="]
RESPONSES = [
    "so \\boxed{3}",
    "no box here",
    "it is \\boxed{5} ok",
    "\\boxed{1} no, \\boxed{4}",
    "\\boxed{",
]


def enc(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def batch():
    prompts, responses = [enc(p) for p in PROMPTS], [enc(r) for r in RESPONSES]
    return prompts, responses, pack_rollouts(prompts, responses, TOK.pad_token_id)


def forward(model, packed, rows=slice(None)):
    return model(
        input_ids=packed.input_ids[rows],
        attention_mask=packed.attention_mask[rows],
        position_ids=packed.position_ids[rows],
        use_cache=False,
        logits_to_keep=1,
    )


def read(model, spec, micro=(0, 2, 5)):
    """Features and rows of BATCH, one forward per micro-batch ``micro[i]:micro[i+1]``."""
    _, responses, packed = batch()
    reader = AnswerFeatureReader(model, TOK, spec)
    reader.begin(responses, packed.prompt_length)
    with torch.no_grad():
        for start, stop in zip(micro[:-1], micro[1:], strict=True):
            with reader.microbatch(range(start, stop)):
                forward(model, packed, slice(start, stop))
    return reader.finish()


def all_layer_logits(model) -> torch.Tensor:
    """[M, N] logit of the first answer token from every layer, for the responses of BATCH with
    an answer (the reference recompute, ``tests/helpers/logit_reference.py``)."""
    _, responses, packed = batch()
    targets = answer_targets(locate_answers(responses, TOK), responses, packed.prompt_length)
    layers = range(1, len(find_decoder_layers(model)) + 1)
    return reference_features(model, packed, targets, layers)


# --------------------------------------------------------------------------- pure steps


def test_capture_and_feature_layers():
    last3 = select_layers(6, 3)
    assert last3 == [4, 5, 6]
    assert capture_layers(last3, diff=True) == [3, 4, 5, 6]
    assert feature_layers(last3, diff=True) == [4, 5, 6]  # L4-L3, L5-L4, L6-L5
    assert capture_layers([2, 5], diff=True) == [1, 2, 4, 5]
    assert feature_layers([2, 5], diff=True) == [2, 5]  # L2-L1, L5-L4
    every = select_layers(6, "all")
    assert capture_layers(every, diff=True) == [1, 2, 3, 4, 5, 6]
    assert feature_layers(every, diff=True) == [2, 3, 4, 5, 6]  # N - 1 values
    assert capture_layers([1, 2], diff=True) == [1, 2] and feature_layers([1, 2], True) == [2]
    assert capture_layers([1], diff=True) == [] and feature_layers([1], diff=True) == []
    assert capture_layers([2, 5], diff=False) == feature_layers([2, 5], diff=False) == [2, 5]
    # The reference's 14-of-28: diffs over all 28, keep the last 14 = L15-L14 .. L28-L27.
    sel = select_layers(28, 14)
    assert capture_layers(sel, True) == list(range(14, 29))
    assert feature_layers(sel, True) == list(range(15, 29))


def test_layer_diffs():
    logits = torch.tensor([[1.0, 3.0, 10.0, 6.0], [0.0, -2.0, 0.5, 0.5]])  # layers 1, 2, 4, 5
    out = layer_diffs(logits, [1, 2, 4, 5], [2, 5])
    torch.testing.assert_close(out, torch.tensor([[2.0, -4.0], [-2.0, 0.0]]), rtol=0, atol=0)
    out = layer_diffs(torch.tensor([[1.0, 2.0, 4.0, 8.0]]), [3, 4, 5, 6], [4, 5, 6])
    torch.testing.assert_close(out, torch.tensor([[1.0, 2.0, 4.0]]), rtol=0, atol=0)
    assert layer_diffs(torch.zeros(0, 4), [3, 4, 5, 6], [4, 5, 6]).shape == (0, 3)
    with pytest.raises(ValueError, match="predecessors"):
        layer_diffs(logits, [1, 2, 4, 5], [4])  # layer 3 was not captured


def test_round_to_bfloat16_by_hand():
    # bf16 keeps 8 significant bits (1 implicit + 7 stored), so in [2^e, 2^(e+1)) the step is
    # 2^(e-7): 0.125 in [16, 32), 0.25 in [32, 64), 2^-9 = 0.001953125 in [0.25, 0.5).
    #   17.3 / 0.125 = 138.4 -> 138 -> 17.25;    40.1 / 0.25 = 160.4 -> 160 -> 40.0
    #   -20.06 / 0.125 = -160.48 -> -160 -> -20.0
    #   0.3 / 2^-9 = 153.6 -> 154 -> 154 / 512 = 0.30078125
    #   ties go to the even multiple: 16.0625 = 128.5 steps -> 128 -> 16.0,
    #   16.1875 = 129.5 steps -> 130 -> 16.25
    x = torch.tensor([17.3, 40.1, -20.06, 0.3, 16.0625, 16.1875, 17.27])
    want = torch.tensor([17.25, 40.0, -20.0, 0.30078125, 16.0, 16.25, 17.25])
    out = round_to_bfloat16(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert out[0] == out[-1]  # 17.3 and 17.27 become an exact tie, as in the reference


def test_resolve_feature_dtype():
    model = build_tiny_model(0)
    assert resolve_feature_dtype("auto", model) == torch.float32
    assert resolve_feature_dtype("bfloat16", model) == torch.bfloat16
    model = model.to(torch.bfloat16)
    assert resolve_feature_dtype("auto", model) == torch.bfloat16
    assert resolve_feature_dtype("float32", model) == torch.float32
    with pytest.raises(ValueError, match="float16"):
        resolve_feature_dtype("float16", model)


def test_feature_spec_validation():
    assert FeatureSpec() == FeatureSpec(layers=14, diff=False, final_norm=False, dtype="auto")
    assert FeatureSpec(layers=[2, 5]).layers == (2, 5) and hash(FeatureSpec(layers=[2, 5]))
    with pytest.raises(ValueError, match="must be one of 'auto', 'float32', 'bfloat16'"):
        FeatureSpec(dtype="fp16")
    with pytest.raises(ValueError, match="diff"):
        FeatureSpec(diff="yes")
    with pytest.raises(ValueError, match="final_norm"):
        FeatureSpec(final_norm=1)


# --------------------------------------------------------------------------- the reader


def test_defaults_are_bit_identical_to_layer_logit_capture():
    """FeatureSpec() on an fp32 model: exactly the numbers LayerLogitCapture(model, 14) gives."""
    model = build_tiny_model(0).eval()
    feats, rows = read(model, FeatureSpec())
    _, responses, packed = batch()
    targets = answer_targets(locate_answers(responses, TOK), responses, packed.prompt_length)
    cap = LayerLogitCapture(model, 14)
    with torch.no_grad():
        for start, stop in ((0, 2), (2, 5)):
            with cap.capture(targets.for_rows(range(start, stop))):
                forward(model, packed, slice(start, stop))
    want = cap.pop_features().float().cpu()
    assert rows.tolist() == [0, 2, 3] == targets.sample_index.tolist()
    assert feats.dtype == torch.float32 and feats.shape == (3, 4) and feats.device.type == "cpu"
    assert torch.equal(feats, want)
    torch.testing.assert_close(feats, all_layer_logits(model), rtol=1e-5, atol=1e-5)


def test_diff_is_the_reference_diff_over_all_layers():
    model = build_tiny_model(0, num_hidden_layers=6).eval()
    every = all_layer_logits(model)  # [3, 6]: columns are layers 1..6
    ref = every[:, 1:] - every[:, :-1]  # reference: diffs over all N, columns L2-L1 .. L6-L5
    last3, _ = read(model, FeatureSpec(layers=3, diff=True, dtype="float32"))
    assert last3.shape == (3, 3)  # L4-L3, L5-L4, L6-L5 (not 2 values)
    torch.testing.assert_close(last3, ref[:, -3:], rtol=1e-5, atol=1e-5)
    some, _ = read(model, FeatureSpec(layers=[2, 5], diff=True))
    want = torch.stack([every[:, 1] - every[:, 0], every[:, 4] - every[:, 3]], dim=1)
    torch.testing.assert_close(some, want, rtol=1e-5, atol=1e-5)
    whole, _ = read(model, FeatureSpec(layers="all", diff=True))
    assert whole.shape == (3, 5)
    torch.testing.assert_close(whole, ref, rtol=1e-5, atol=1e-5)


def test_bfloat16_rounds_per_layer_logits_before_the_diff():
    model = build_tiny_model(0, num_hidden_layers=6).eval()
    fp32, _ = read(model, FeatureSpec(layers=[3, 4, 5, 6], dtype="float32"))
    assert not torch.equal(fp32, round_to_bfloat16(fp32))  # fp32 features are not rounded
    rounded, _ = read(model, FeatureSpec(layers=[3, 4, 5, 6], dtype="bfloat16"))
    assert torch.equal(rounded, round_to_bfloat16(fp32))
    diffed, _ = read(model, FeatureSpec(layers=3, diff=True, dtype="bfloat16"))
    r = round_to_bfloat16(fp32)
    assert torch.equal(diffed, r[:, 1:] - r[:, :-1])


def test_auto_rounds_when_the_policy_computes_in_bf16_only():
    model = build_tiny_model(0).eval()
    reader = AnswerFeatureReader(model, TOK, FeatureSpec())
    assert reader.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 masters, bf16-mixed
        assert reader.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.float16):
        assert reader.dtype == torch.float32
    model = model.to(torch.bfloat16)
    assert reader.dtype == torch.bfloat16  # resolved when reading, not when built
    feats, _ = read(model, FeatureSpec())
    assert feats.dtype == torch.float32 and torch.equal(feats, round_to_bfloat16(feats))


def test_num_features_and_empty_batches():
    model = build_tiny_model(0).eval()  # 4 layers
    assert AnswerFeatureReader(model, TOK, FeatureSpec()).num_features == 4
    assert AnswerFeatureReader(model, TOK, FeatureSpec(diff=True)).num_features == 3
    assert AnswerFeatureReader(model, TOK, FeatureSpec(layers=2, diff=True)).num_features == 2
    with pytest.raises(ValueError, match="only layer 1"):
        AnswerFeatureReader(model, TOK, FeatureSpec(layers=[1], diff=True))
    reader = AnswerFeatureReader(model, TOK, FeatureSpec(diff=True))
    reader.begin([enc("no box"), enc("none")], prompt_length=3)
    assert reader.answer_rows.tolist() == []
    with reader.microbatch(range(0, 2)):
        assert hook_count(model) == 0  # no answer: no hooks, the forward costs nothing extra
    feats, rows = reader.finish()
    assert feats.shape == (0, 3) and feats.dtype == torch.float32
    assert rows.shape == (0,) and rows.dtype == torch.long


def test_reasoning_end_reads_the_answer_after_the_reasoning():
    """grader.reasoning_end: the feature is read where the grader reads the answer, after the
    last </think>; a box only inside the reasoning, or an unclosed reasoning, gives no feature."""
    model = build_tiny_model(0).eval()
    responses = [enc("<think>\\boxed{3}</think>so \\boxed{5}"), enc("<think>\\boxed{3}</think>so 5"),
                 enc("<think>\\boxed{3}")]
    plain = AnswerFeatureReader(model, TOK, FeatureSpec())
    plain.begin(responses, prompt_length=3)
    assert plain.answer_rows.tolist() == [0, 1, 2]
    reader = AnswerFeatureReader(model, TOK, FeatureSpec(), reasoning_end="</think>")
    reader.begin(responses, prompt_length=3)
    assert reader.answer_rows.tolist() == [0]
    assert reader._targets.positions.tolist() == plain._targets.positions[:1].tolist()  # the last box


def test_micro_batch_contract():
    model = build_tiny_model(0).eval()
    whole, rows = read(model, FeatureSpec(), micro=(0, 5))
    # Any order of micro-batches gives the rows ascending and the same features.
    _, responses, packed = batch()
    reader = AnswerFeatureReader(model, TOK, FeatureSpec())
    reader.begin(responses, packed.prompt_length)
    with torch.no_grad():
        for start, stop in ((3, 5), (0, 3)):
            with reader.microbatch(range(start, stop)):
                assert hook_count(model) == 4
                forward(model, packed, slice(start, stop))
    feats, got = reader.finish()
    assert got.tolist() == rows.tolist() == [0, 2, 3]
    torch.testing.assert_close(feats, whole, rtol=1e-5, atol=1e-5)
    assert hook_count(model) == 0
    # begin() forgets an earlier, unfinished batch.
    reader.begin(responses, packed.prompt_length)
    with torch.no_grad(), reader.microbatch(range(0, 5)):
        forward(model, packed)
    reader.begin(responses, packed.prompt_length)
    with torch.no_grad(), reader.microbatch(range(0, 5)):
        forward(model, packed)
    assert reader.finish()[1].tolist() == [0, 2, 3]
    # A row with an answer that no micro-batch read is an error, not a silently missing feature.
    reader.begin(responses, packed.prompt_length)
    with torch.no_grad(), reader.microbatch(range(0, 3)):
        forward(model, packed, slice(0, 3))
    with pytest.raises(RuntimeError, match="rows read"):
        reader.finish()
    with pytest.raises(RuntimeError, match="begin"):
        reader.finish()


def test_digit_logits_hold_the_answer_digit_column_at_every_layer():
    """``logits="digits"``: ten columns per layer, layer by layer; at the answers' first digit
    (3, 5 and 4 here) the column of that digit is the reference feature; with ``diff`` each
    digit's column is differenced over the layers as the reference's."""
    model = build_tiny_model(0, num_hidden_layers=4).eval()
    ref, rows = read(model, FeatureSpec(dtype="float32"))
    digits, rows2 = read(model, FeatureSpec(dtype="float32", logits="digits"))
    assert torch.equal(rows, rows2) and digits.shape == (3, 4 * 10)
    per_layer = digits.view(3, 4, 10)
    for j, d in enumerate((3, 5, 4)):  # the last box of each response
        torch.testing.assert_close(per_layer[j, :, d], ref[j], rtol=1e-5, atol=1e-6)
    diffed, _ = read(model, FeatureSpec(dtype="float32", logits="digits", diff=True, layers=3))
    torch.testing.assert_close(diffed.view(3, 3, 10), per_layer[:, 1:] - per_layer[:, :-1], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="logits"):
        FeatureSpec(logits="all")
