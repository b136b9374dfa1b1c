"""HFRolloutEngine on the tiny random model and on a hand-wired deterministic model."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from transformers import GenerationConfig

from logprob_reference import teacher_forced_logprobs
from medsrl.data.template import render_prompt
from medsrl.models.char_tokenizer import build_char_tokenizer
from medsrl.models.tiny import build_tiny_model
from medsrl.rollout.base import RolloutBatch, SamplingParams
from medsrl.rollout.hf import HFRolloutEngine

PROBLEMS = ["1+1?", "What is 7*6?", "Solve x^2 = 4 for x > 0."]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture()
def model():
    return build_tiny_model(seed=0, hidden_size=64, num_hidden_layers=2, intermediate_size=128)


@pytest.fixture()
def sharp_model():
    """Large random weights, so greedy continuations depend on the whole (unpadded) context."""
    model = build_tiny_model(seed=0, hidden_size=64, num_hidden_layers=2, intermediate_size=128)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.4)
    return model


def _prompts():
    return [render_prompt(p) for p in PROBLEMS]


def _manual_greedy(model, ids: list[int], steps: int) -> list[int]:
    """Argmax decoding with full (uncached) forwards on the unpadded sequence."""
    seq = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
            nxt = int(logits.argmax())
            out.append(nxt)
            seq.append(nxt)
    return out


def test_default_stop_ids_and_pad(model, tok):
    engine = HFRolloutEngine(model, tok)
    assert engine.stop_token_ids == [2, 0]  # <|im_end|>, <|endoftext|> (eos is <|im_end|>)
    assert engine.pad_token_id == 0
    assert HFRolloutEngine(model, tok, stop_token_ids=[2]).stop_token_ids == [2]
    assert len(engine.generate([], SamplingParams(n=2, max_new_tokens=3))) == 0


def test_batch_fields_are_consistent(model, tok):
    prompts = _prompts()
    engine = HFRolloutEngine(model, tok, max_batch_size=4)  # 6 sequences -> chunks of 4 and 2
    batch = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=5, seed=0))
    assert isinstance(batch, RolloutBatch)
    assert len(batch) == 6
    assert batch.prompt_index == [0, 0, 1, 1, 2, 2]
    for k in range(len(batch)):
        i = batch.prompt_index[k]
        assert batch.prompt_ids[k] == tok(prompts[i])["input_ids"]
        ids = batch.response_ids[k]
        assert 1 <= len(ids) <= 5
        assert batch.response_text[k] == tok.decode(ids, skip_special_tokens=True)
        stops = [j for j, t in enumerate(ids) if t in (0, 2)]
        if batch.finish_reason[k] == "stop":
            assert stops == [len(ids) - 1]  # exactly one stop token, at the end
        else:
            assert batch.finish_reason[k] == "length"
            assert stops == [] and len(ids) == 5
    assert batch.truncated == [r == "length" for r in batch.finish_reason]
    # a random model rarely samples one of two stop tokens among 101 within 5 tokens
    assert sum(batch.truncated) >= 4


def test_seeded_generation_is_reproducible_and_keeps_global_rng(model, tok):
    engine = HFRolloutEngine(model, tok, max_batch_size=8)
    params = SamplingParams(n=4, max_new_tokens=6, seed=123)
    torch.manual_seed(999)
    state = torch.get_rng_state()
    a = engine.generate(_prompts()[:2], params)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG stream is untouched
    b = engine.generate(_prompts()[:2], params)
    assert a.response_ids == b.response_ids
    c = engine.generate(_prompts()[:2], SamplingParams(n=4, max_new_tokens=6, seed=124))
    assert c.response_ids != a.response_ids
    # samples within one call differ (temperature 1 on a random model)
    assert len({tuple(r) for r in a.response_ids}) > 1


def test_greedy_matches_manual_argmax_and_is_chunking_invariant(sharp_model, tok):
    model = sharp_model
    prompts = _prompts()
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=4)
    big = HFRolloutEngine(model, tok, max_batch_size=64).generate(prompts, params)
    small = HFRolloutEngine(model, tok, max_batch_size=1).generate(prompts, params)
    assert big.response_ids == small.response_ids
    for k in range(len(big)):
        expected = _manual_greedy(model, big.prompt_ids[k], 4)
        got = big.response_ids[k]
        assert got == expected[: len(got)]
    # greedy: the n copies of a prompt are identical; different prompts continue differently
    assert big.response_ids[0] == big.response_ids[1]
    assert len({tuple(r) for r in big.response_ids}) == 3


def test_model_generation_config_defaults_do_not_leak(model, tok):
    """Checkpoints ship generation configs (top_k, repetition_penalty, ...); ours must win."""
    odd = GenerationConfig(
        do_sample=True,
        temperature=0.05,
        top_k=1,
        top_p=0.1,
        repetition_penalty=50.0,
        no_repeat_ngram_size=1,
        max_new_tokens=1,
        eos_token_id=5,
    )
    model.generation_config = odd
    prompt = _prompts()[0]
    engine = HFRolloutEngine(model, tok)
    greedy = engine.generate([prompt], SamplingParams(n=1, temperature=0.0, max_new_tokens=6))
    assert (
        greedy.response_ids[0]
        == _manual_greedy(model, greedy.prompt_ids[0], 6)[: len(greedy.response_ids[0])]
    )
    assert model.generation_config is odd  # restored
    # sampling is not collapsed by the model's top_k=1: several distinct continuations
    sampled = engine.generate([prompt], SamplingParams(n=8, max_new_tokens=3, seed=0))
    assert len({tuple(r) for r in sampled.response_ids}) > 1


def test_generation_emits_no_warnings(model, tok):
    from transformers.utils import logging as hf_logging

    hf_logging.get_logger("x").warning_once.cache_clear()  # warn_once caches across tests
    records: list[logging.LogRecord] = []

    class _Collect(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = _Collect(level=logging.WARNING)
    root = logging.getLogger("transformers")
    root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine = HFRolloutEngine(model, tok)
            engine.generate(_prompts()[:2], SamplingParams(n=2, max_new_tokens=3, seed=1))
            engine.generate(_prompts()[:2], SamplingParams(n=1, temperature=0, max_new_tokens=3))
            engine.generate(_prompts()[:1], SamplingParams(n=2, top_p=0.9, max_new_tokens=3))
    finally:
        root.removeHandler(handler)
    assert [str(w.message) for w in caught] == []
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == []


def test_train_mode_is_restored(model, tok):
    engine = HFRolloutEngine(model, tok)
    model.train()
    frozen = model.model.layers[0]
    frozen.eval()  # a submodule deliberately in eval mode stays so
    seen = []
    orig_forward = model.forward

    def spy(*args, **kwargs):
        seen.append(model.training)
        return orig_forward(*args, **kwargs)

    model.forward = spy
    try:
        engine.generate(["ab"], SamplingParams(n=1, max_new_tokens=2, seed=0))
    finally:
        del model.forward
    assert seen and not any(seen)  # generated in eval mode
    assert model.training and model.lm_head.training
    assert not frozen.training
    model.eval()
    engine.generate(["ab"], SamplingParams(n=1, max_new_tokens=2, seed=0))
    assert not model.training
    assert all(p.grad is None for p in model.parameters())


def _sloped_model(tok):
    """Logits independent of the input: -0.01 * token id, stop tokens never sampled."""
    model = build_tiny_model(seed=0, hidden_size=32, num_hidden_layers=1, intermediate_size=32)
    vocab = model.config.vocab_size
    head = torch.nn.Linear(model.config.hidden_size, vocab, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.copy_(-0.01 * torch.arange(vocab, dtype=torch.float32))
        head.bias[[0, 2]] = -100.0
    model.lm_head = head
    model.config.tie_word_embeddings = False
    return model


def test_sampling_uses_full_distribution_and_top_p(tok):
    """No hidden top_k (transformers defaults to 50); top_p cuts the tail."""
    engine = HFRolloutEngine(_sloped_model(tok), tok)
    full = engine.generate(["a"], SamplingParams(n=16, max_new_tokens=16, seed=0))
    drawn = [t for r in full.response_ids for t in r]
    assert len(drawn) == 256 and max(drawn) >= 60
    cut = engine.generate(["a"], SamplingParams(n=16, top_p=0.3, max_new_tokens=16, seed=0))
    drawn = [t for r in cut.response_ids for t in r]
    assert max(drawn) < 40
    assert len(set(drawn)) > 10


def _chain_model(tok, successor: dict[str, str]):
    """A model whose greedy next token depends only on the current token: ``successor`` map.

    Every layer's output projections are zeroed (the residual stream carries the input
    embedding), embeddings are one-hot and the untied ``lm_head`` maps token ``a`` to ``b``.
    """
    model = build_tiny_model(seed=0, hidden_size=128, num_hidden_layers=1, intermediate_size=32)
    vocab = len(tok)
    hidden = model.config.hidden_size
    assert vocab <= hidden
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = torch.zeros(model.config.vocab_size, hidden)
        emb[torch.arange(vocab), torch.arange(vocab)] = 1.0
        model.model.embed_tokens.weight.copy_(emb)
        head = torch.nn.Linear(hidden, model.config.vocab_size, bias=False)
        head.weight.zero_()
        for a, b in successor.items():
            ia = tok.convert_tokens_to_ids(a)
            ib = tok.convert_tokens_to_ids(b)
            head.weight[ib, ia] = 10.0
    model.lm_head = head
    model.config.tie_word_embeddings = False
    return model


def test_forced_stop_token_trims_and_reports_stop(tok):
    # "1" -> a -> b -> c -> <|im_end|>;  "2" -> x -> y -> x -> y ... (never stops)
    model = _chain_model(
        tok,
        {"1": "a", "a": "b", "b": "c", "c": "<|im_end|>", "2": "x", "x": "y", "y": "x"},
    )
    engine = HFRolloutEngine(model, tok)
    batch = engine.generate(["q1", "qq2"], SamplingParams(n=2, temperature=0.0, max_new_tokens=6))
    ids_abc = tok("abc")["input_ids"]
    assert batch.prompt_index == [0, 0, 1, 1]
    assert batch.response_ids[0] == ids_abc + [2]
    assert batch.response_ids[1] == ids_abc + [2]
    assert batch.response_text[:2] == ["abc", "abc"]
    assert batch.finish_reason[:2] == ["stop", "stop"]
    assert batch.response_ids[2] == tok("xyxyxy")["input_ids"]
    assert batch.response_text[2] == "xyxyxy"
    assert batch.finish_reason[2:] == ["length", "length"]
    assert batch.truncated == [False, False, True, True]
    # sampling at a low temperature follows the same chain
    sampled = engine.generate(
        ["q1"], SamplingParams(n=3, temperature=0.3, max_new_tokens=8, seed=0)
    )
    assert sampled.response_ids == [ids_abc + [2]] * 3
    assert sampled.finish_reason == ["stop"] * 3


def test_custom_stop_ids(tok):
    model = _chain_model(tok, {"1": "a", "a": "b", "b": "c", "c": "<|im_end|>"})
    # with only "b" as the stop token the response ends at "b"
    engine = HFRolloutEngine(model, tok, stop_token_ids=[tok.convert_tokens_to_ids("b")])
    batch = engine.generate(["1"], SamplingParams(n=1, temperature=0.0, max_new_tokens=6))
    assert batch.response_ids == [tok("ab")["input_ids"]]
    assert batch.response_text == ["ab"]
    assert batch.finish_reason == ["stop"]


def test_sync_weights_is_noop_for_shared_module(model, tok):
    engine = HFRolloutEngine(model, tok)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine.sync_weights(model)
    assert engine.model is model
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_kv_cache_used_even_with_checkpointing_training_setup(model, tok):
    """Training sets ``config.use_cache=False`` with activation checkpointing; rollouts still cache."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()
    model.config.use_cache = False
    model.train()
    shapes = []
    orig_forward = model.forward

    def spy(*args, **kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))
        return orig_forward(*args, **kwargs)

    model.forward = spy
    try:
        engine = HFRolloutEngine(model, tok)
        batch = engine.generate(["hello", "hi"], SamplingParams(n=2, max_new_tokens=4, seed=0))
    finally:
        del model.forward
    assert shapes[0] == (2, 4)  # prefill of the 2 left-padded prompts but their last token, once each
    assert all(s == (4, 1) for s in shapes[1:])  # then one token per row and step (KV cache)
    assert len(shapes) == 1 + max(len(r) for r in batch.response_ids)
    assert model.training


def test_shared_prompt_prefill_gives_the_samples_of_a_full_prefill(model, tok, monkeypatch):
    """The prompts' KV cache, computed once per prompt and expanded to its ``n`` rows, samples
    what ``generate``'s own prefill of every row samples."""
    import medsrl.rollout.hf as hf

    prompts, params = _prompts(), SamplingParams(n=4, max_new_tokens=8, seed=3, logprobs=True)
    shared = HFRolloutEngine(model, tok).generate(prompts, params)
    monkeypatch.setattr(hf, "_shared_prompt_cache", lambda *args: None)
    full = HFRolloutEngine(model, tok).generate(prompts, params)
    assert shared.response_ids == full.response_ids
    for a, b in zip(shared.response_logprobs, full.response_logprobs, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_splitting_prompts_at_chunk_boundaries_with_offset_seeds_gives_the_same_samples(model, tok):
    """What a distributed run relies on: rank r generating prompts s..s+k-1 with seed + s
    samples exactly what one process generating all prompts with seed does."""
    prompts = [*_prompts(), "3 + 4 = ?"]
    engine = HFRolloutEngine(model, tok, max_batch_size=4)  # 2 prompts per chunk at n=2
    params = SamplingParams(n=2, max_new_tokens=6, seed=7)
    whole = engine.generate(prompts, params)
    first = engine.generate(prompts[:2], params)
    second = engine.generate(prompts[2:], SamplingParams(n=2, max_new_tokens=6, seed=7 + 2))
    assert first.response_ids + second.response_ids == whole.response_ids
    assert len({tuple(r) for r in whole.response_ids}) > 1


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5), (0.0, 1.0)])
def test_sampling_logprobs_match_a_teacher_forced_recompute(sharp_model, tok, temperature, top_p):
    engine = HFRolloutEngine(sharp_model, tok, max_batch_size=4)
    params = SamplingParams(n=3, max_new_tokens=12, temperature=temperature, top_p=top_p, seed=5, logprobs=True)
    batch = engine.generate(_prompts(), params)
    assert batch.response_logprobs is not None
    sharp_model.eval()
    for k in range(len(batch)):
        got = torch.tensor(batch.response_logprobs[k])
        assert got.shape == (len(batch.response_ids[k]),)
        want = teacher_forced_logprobs(
            sharp_model, batch.prompt_ids[k], batch.response_ids[k], temperature, top_p
        )
        assert torch.isfinite(got).all() and (got <= 0).all()
        torch.testing.assert_close(got, want, atol=2e-4, rtol=0)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_asking_for_logprobs_does_not_change_the_samples(sharp_model, tok, temperature, top_p):
    engine = HFRolloutEngine(sharp_model, tok, max_batch_size=4)
    params = SamplingParams(n=4, max_new_tokens=10, temperature=temperature, top_p=top_p, seed=3)
    plain = engine.generate(_prompts(), params)
    with_lp = engine.generate(_prompts(), SamplingParams(**{**params.__dict__, "logprobs": True}))
    assert plain.response_logprobs is None
    assert with_lp.response_ids == plain.response_ids
    assert with_lp.finish_reason == plain.finish_reason
    assert engine.generate([], SamplingParams(logprobs=True)).response_logprobs == []
