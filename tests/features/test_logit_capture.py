"""Per-layer answer logits captured by hooks equal those from ``output_hidden_states=True``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from logit_reference import hook_count, reference_features
from medsrl.features.logit_capture import (
    CaptureTargets,
    LayerLogitCapture,
    answer_targets,
    select_layers,
)
from medsrl.models.loading import random_model_like
from medsrl.models.tiny import build_tiny_model
from medsrl.rollout.base import pack_rollouts

PAD = 0


def make_batch(vocab: int, seed: int = 0, batch: int = 6):
    """Ragged prompts / responses packed like the training step; one answer index per response
    (``None`` for one response, and one whose answer token is last, so both are dropped)."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses, answers = [], [], []
    for _ in range(batch):
        p_len = int(torch.randint(3, 12, (1,), generator=g))
        r_len = int(torch.randint(4, 15, (1,), generator=g))
        prompts.append(torch.randint(3, vocab, (p_len,), generator=g).tolist())
        responses.append(torch.randint(3, vocab, (r_len,), generator=g).tolist())
        answers.append(int(torch.randint(0, r_len - 1, (1,), generator=g)))
    answers[1] = None
    answers[3] = len(responses[3]) - 1  # "{" is the last token: nothing to score
    return prompts, responses, answers


def run_forward(model, packed, rows=slice(None)):
    resp_len = packed.response_mask.shape[1]
    return model(
        input_ids=packed.input_ids[rows],
        attention_mask=packed.attention_mask[rows],
        position_ids=packed.position_ids[rows],
        use_cache=False,
        logits_to_keep=resp_len + 1,
    )


MODELS = {
    "tiny-qwen2": lambda: build_tiny_model(0),
    "qwen3": lambda: random_model_like("qwen3", 120, num_hidden_layers=3, seed=1),
    "llama": lambda: random_model_like("llama", 120, num_hidden_layers=3, seed=2),
    "qwen2-untied": lambda: random_model_like(
        "qwen2", 120, num_hidden_layers=3, seed=3, tie_word_embeddings=False
    ),
}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("final_norm", [False, True])
def test_matches_output_hidden_states(name, final_norm):
    model = MODELS[name]().eval()
    vocab = model.config.vocab_size
    prompts, responses, answers = make_batch(vocab)
    packed = pack_rollouts(prompts, responses, PAD)
    targets = answer_targets(answers, responses, packed.prompt_length)
    assert targets.sample_index.tolist() == [0, 2, 4, 5]
    n = model.config.num_hidden_layers
    cap = LayerLogitCapture(model, layers="all", final_norm=final_norm)
    assert cap.layers == list(range(1, n + 1))
    with torch.no_grad(), cap.capture(targets):
        logits = run_forward(model, packed).logits
    feats = cap.pop_features()
    ref = reference_features(model, packed, targets, cap.layers, final_norm)
    base_hooks = hook_count(model)  # HF installs its own (idle) hooks for output_hidden_states
    assert feats.dtype == torch.float32 and feats.shape == (4, n)
    torch.testing.assert_close(feats, ref, atol=1e-5, rtol=1e-5)
    # The last layer is the model's own final logit at that position (normed, like HF).
    # logits_to_keep=R+1 keeps columns P-1 .. P+R-1, so column P+t is index t+1.
    last = logits[targets.rows, targets.positions - packed.prompt_length + 1]
    last = last.float().gather(1, targets.next_token_ids[:, None])[:, 0]
    torch.testing.assert_close(feats[:, -1], last, atol=1e-5, rtol=1e-5)
    # Intermediate layers really are un-normed by default (the flag changes them).
    other = LayerLogitCapture(model, layers=[1], final_norm=not final_norm)
    with torch.no_grad(), other.capture(targets):
        run_forward(model, packed)
    assert not torch.allclose(other.pop_features()[:, 0], feats[:, 0], atol=1e-3)
    assert len(cap.features()) == 0 and hook_count(model) == base_hooks


def test_features_depend_on_position_and_token():
    """Guards against reading the wrong column (e.g. off by one) or the wrong vocab row."""
    model = build_tiny_model(0).eval()
    prompts, responses, answers = make_batch(model.config.vocab_size, seed=5)
    packed = pack_rollouts(prompts, responses, PAD)
    targets = answer_targets(answers, responses, packed.prompt_length)
    shifted = CaptureTargets(
        targets.rows, targets.positions + 1, targets.next_token_ids, targets.sample_index
    )
    cap = LayerLogitCapture(model, layers=2)
    with torch.no_grad(), cap.capture(shifted):
        run_forward(model, packed)
    ref = reference_features(model, packed, targets, cap.layers)
    assert not torch.allclose(cap.pop_features(), ref, atol=1e-3)
    with torch.no_grad(), cap.capture(targets):
        run_forward(model, packed)
    other_ids = (targets.next_token_ids + 1) % model.config.vocab_size
    assert not torch.allclose(
        cap.pop_features(),
        reference_features(
            model,
            packed,
            CaptureTargets(targets.rows, targets.positions, other_ids, targets.sample_index),
            cap.layers,
        ),
        atol=1e-3,
    )


def test_micro_batches_equal_one_batch():
    model = build_tiny_model(0).eval()
    prompts, responses, answers = make_batch(model.config.vocab_size, seed=1, batch=9)
    packed = pack_rollouts(prompts, responses, PAD)
    targets = answer_targets(answers, responses, packed.prompt_length)
    cap = LayerLogitCapture(model, layers="half")
    with torch.no_grad(), cap.capture(targets):
        run_forward(model, packed)
    whole = cap.pop_features()
    mb = 4
    with torch.no_grad():
        for start in range(0, 9, mb):
            stop = min(start + mb, 9)
            with cap.capture(targets.for_rows(range(start, stop))):
                run_forward(model, packed, slice(start, stop))
    parts = cap.pop_features()
    torch.testing.assert_close(parts, whole, atol=1e-5, rtol=1e-5)
    assert whole.shape == (len(targets), 2)


def take(targets: CaptureTargets, part: slice) -> CaptureTargets:
    """Some of the targets (rows unchanged: still rows of the whole batch)."""
    return CaptureTargets(
        targets.rows[part],
        targets.positions[part],
        targets.next_token_ids[part],
        targets.sample_index[part],
    )


def test_only_logits_are_kept_between_forwards():
    """Each capture is reduced to M x L fp32 logits on exit (no M x L x H vectors kept), and
    several captures concatenate in call order."""
    model = build_tiny_model(0).eval()
    prompts, responses, answers = make_batch(model.config.vocab_size, seed=2)
    packed = pack_rollouts(prompts, responses, PAD)
    targets = answer_targets(answers, responses, packed.prompt_length)
    cap = LayerLogitCapture(model, layers=[2, 4])
    with torch.no_grad():
        with cap.capture(take(targets, slice(0, 2))):
            run_forward(model, packed)
        assert cap.features().numel() == 2 * 2  # two positions x two layers, no hidden vectors
        with cap.capture(take(targets, slice(2, None))):
            run_forward(model, packed)
    m = len(targets)
    assert len(cap.features()) == m and cap.features().numel() == m * 2
    feats = cap.features()
    assert feats.dtype == torch.float32 and feats.shape == (m, 2)
    ref = reference_features(model, packed, targets, [2, 4])
    torch.testing.assert_close(feats, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cap.pop_features(), ref, atol=1e-5, rtol=1e-5)
    assert cap.features().numel() == 0 and cap.features().shape == (0, 2)


def test_no_capture_outside_context_and_grad_forward():
    model = build_tiny_model(0)
    prompts, responses, answers = make_batch(model.config.vocab_size, seed=3)
    packed = pack_rollouts(prompts, responses, PAD)
    targets = answer_targets(answers, responses, packed.prompt_length)
    cap = LayerLogitCapture(model, layers=14)  # clipped to the 4 layers
    assert cap.layers == [1, 2, 3, 4]
    assert hook_count(model) == 0
    with torch.no_grad():
        run_forward(model, packed)
    assert len(cap.features()) == 0 and cap.features().numel() == 0
    with cap.capture(targets):
        assert cap.armed and hook_count(model) == 4
        with torch.no_grad():
            run_forward(model, packed)
    assert not cap.armed and hook_count(model) == 0
    assert len(cap.features()) == len(targets)
    # A grad-enabled training forward afterwards is untouched and differentiable.
    model.train()
    out = run_forward(model, packed)
    out.logits.float().logsumexp(-1).mean().backward()
    assert model.model.layers[0].mlp.up_proj.weight.grad is not None
    assert len(cap.features()) == len(targets)
    cap.clear()
    # Capture during a grad forward too: stored vectors are detached, autograd still works.
    model.zero_grad()
    with cap.capture(targets):
        out = run_forward(model, packed)
    out.logits.float().mean().backward()
    feats = cap.pop_features()
    assert not feats.requires_grad and feats.shape == (len(targets), 4)


def test_capture_errors():
    model = build_tiny_model(0).eval()
    prompts, responses, answers = make_batch(model.config.vocab_size, seed=4)
    packed = pack_rollouts(prompts, responses, PAD)
    targets = answer_targets(answers, responses, packed.prompt_length)
    cap = LayerLogitCapture(model, layers=2)
    with pytest.raises(RuntimeError, match="did not run"):
        with cap.capture(targets):
            pass
    with pytest.raises(RuntimeError, match="twice"):
        with torch.no_grad(), cap.capture(targets):
            run_forward(model, packed)
            run_forward(model, packed)
    with pytest.raises(RuntimeError, match="nested"):
        with cap.capture(targets), cap.capture(targets):
            pass
    far = CaptureTargets(*(torch.tensor([x]) for x in (0, 10_000, 1, 0)))
    with pytest.raises(IndexError):
        with torch.no_grad(), cap.capture(far):
            run_forward(model, packed)
    with pytest.raises(TypeError, match="CaptureTargets"):  # (row, position) pairs: no token ids
        with cap.capture([(0, 1)]):
            pass
    # An exception inside the body discards the capture and removes the hooks.
    with pytest.raises(KeyError):
        with torch.no_grad(), cap.capture(targets):
            run_forward(model, packed)
            raise KeyError("boom")
    assert len(cap.features()) == 0 and hook_count(model) == 0 and not cap.armed
    # Empty targets: fine, nothing stored, no forward needed.
    empty = answer_targets([None, None], [[1, 2], [3]], 5)
    with cap.capture(empty):
        pass
    assert cap.pop_features().shape == (0, 2)


def test_unknown_layout_is_a_clear_error():
    class NotALM(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(2, 2)])

    with pytest.raises(ValueError, match="model.model.layers"):
        LayerLogitCapture(NotALM())


def test_select_layers():
    assert select_layers(28, 14) == list(range(15, 29))
    assert select_layers(28, "14") == list(range(15, 29))
    assert select_layers(28, "half") == list(range(15, 29))
    assert select_layers(5, "half") == [4, 5]
    assert select_layers(1, "half") == [1]
    assert select_layers(28, "all") == list(range(1, 29))
    assert select_layers(4, 14) == [1, 2, 3, 4]
    assert select_layers(28, [28, 1, 14]) == [1, 14, 28]
    assert select_layers(28, (3,)) == [3]
    for bad in (0, -1, "zero", [0], [29], [1, 1], [], True, 1.5, [1.5]):
        with pytest.raises(ValueError):
            select_layers(28, bad)


def test_answer_targets():
    responses = [[5, 6, 7], [8, 9], [1, 2, 3, 4]]
    t = answer_targets([0, None, 2], responses, prompt_length=10)
    assert t.rows.tolist() == [0, 2] and t.sample_index.tolist() == [0, 2]
    assert t.positions.tolist() == [10, 12]
    assert t.next_token_ids.tolist() == [6, 4]
    sub = t.for_rows(range(1, 3))
    assert sub.rows.tolist() == [1] and sub.sample_index.tolist() == [2] and sub.seq_len == t.seq_len
    # a token-budget micro-batch: any rows, in any order; row rows[j] is its row j
    sub = t.for_rows(torch.tensor([2, 1, 0]), seq_len=13)
    assert sub.rows.tolist() == [2, 0] and sub.sample_index.tolist() == [0, 2] and sub.seq_len == 13
    assert len(t.for_rows([1])) == 0
    assert answer_targets([2], [[1, 2, 3]], 4).rows.numel() == 0  # "{" last: dropped
    with pytest.raises(ValueError):
        answer_targets([0], [[1], [2]], 3)
