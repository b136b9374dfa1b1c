"""LoRA end to end (``model.lora.r=8``): only the adapters train and are checkpointed, the KL
reference is the base with the adapters off, MEDS captures through the adapters, the export is
a plain merged model, and a resumed run is the uninterrupted one. On the tiny preset, and on a
real architecture (Qwen2.5-Math-1.5B's experiment at 2 narrow random layers, shared tokenizer)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from medsrl.models.lora import LoraSettings, apply_lora, is_adapter_key, is_lora
from medsrl.models.tiny import build_tiny_model
from medsrl.module import RLModule
from medsrl.reward.grader import GradeResult, MathGrader
from medsrl.train import build_run, train
from run_helpers import MICRO_WARM_START, compose_train, read_metrics
from shared_paths import require_shared

pytestmark = pytest.mark.slow

LORA = ["model.lora.r=8", "algorithm.kl_coef=0.01"]  # KL on: the reference is the adapters-off base
# Four prompts, all of them every step (tests/e2e/test_train_meds.py): MEDS's memory fills and shapes.
MEDS_FOUR_PROMPTS = [
    "data.stages=[{name: A, start_step: 0, datasets: [{name: a, weight: 1.0, source: "
    "{_target_: medsrl.data.arithmetic.generate_arithmetic, num: 4, level: 1, split: train}}]}]",
    "algorithm=meds",
    "algorithm.plugins.meds.mixed_groups_only=false",  # debug=fast has no DAPO filter
    "callbacks.pass_at_k.every_n_steps=0", "callbacks.pass_at_k.at_start=false",  # time: the steps are the test
]
RESUMED_METRICS = ["train/reward", "train/score", "train/pg_loss", "train/kl", "train/grad_norm", "train/entropy",
                   "train/meds/penalty_mean", "train/meds/memory_entries"]


def _weights(module) -> tuple[dict, dict]:
    """(frozen base weights, adapter weights) of the module's policy, by name, copied."""
    named = list(module.policy.named_parameters())
    base = {n: p.detach().clone() for n, p in named if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in named if p.requires_grad}
    return base, adapters


def _run_and_weights(cfg):
    run = build_run(cfg)
    before = _weights(run.module)
    summary = train(cfg, run)
    return run, summary, before, _weights(run.module)


def _resume_from_step_1(straight, resumed, overrides, **kw):
    """Continue the straight run's step-1 checkpoint to step 2 in ``resumed``: a run stopped at
    step 1 saves the same checkpoint, so this is the interrupted-and-resumed run, one build cheaper."""
    ckpt = straight / "checkpoints" / "step_000001.ckpt"
    train(compose_train(resumed, overrides + ["trainer.max_steps=2", f"ckpt_path={ckpt}"], **kw))


def _assert_resumed_equals_straight(straight, resumed, step, names):
    a, b = read_metrics(straight)[step], read_metrics(resumed)[step]
    for name in names:
        assert b[name] == pytest.approx(a[name], rel=1e-5, abs=1e-7), name
    wa = torch.load(straight / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    wb = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-7, msg=k)


def test_lora_meds_on_the_tiny_preset_trains_only_adapters_and_resumes_exactly(tmp_path, micro_cache):
    overrides = MICRO_WARM_START + MEDS_FOUR_PROMPTS + LORA
    straight = tmp_path / "straight"
    extra = ["trainer.max_steps=2", "export_policy=true", "callbacks.milestones.every_n_steps=2"]
    cfg = compose_train(straight, overrides + extra, cache_dir=micro_cache)
    run, _, (base0, adapters0), (base1, adapters1) = _run_and_weights(cfg)
    assert is_lora(run.module.policy) and run.module.ref_policy is None  # no second copy for the KL
    for name, w in base0.items():  # the base is bit-identical
        assert torch.equal(base1[name], w), name
    assert adapters0 and all(is_adapter_key(n) for n in adapters0)
    assert any(not torch.equal(adapters1[n], w) for n, w in adapters0.items())

    m = read_metrics(straight)
    assert m[0]["train/meds/answer_found_rate"] > 0.5  # MEDS's capture ran through the adapters
    assert m[1]["train/meds/memory_entries"] > m[0]["train/meds/memory_entries"] > 0
    assert m[0]["train/kl"] < 1e-6 < m[1]["train/kl"]  # lora_B starts at 0: the policy is the reference

    ckpt = torch.load(straight / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert set(ckpt) == {f"policy.{n}" for n in adapters0}  # the adapters only

    # the export: a plain model with the adapters merged; the bf16 milestone: the same weights
    assert not (straight / "policy" / "adapter_config.json").exists()
    exported = AutoModelForCausalLM.from_pretrained(straight / "policy")
    ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, run.module.policy(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)  # merged: rounded once, not twice
    milestone = AutoModelForCausalLM.from_pretrained(straight / "milestones" / "step_000002")
    assert milestone.dtype == torch.bfloat16
    merged, in_bf16 = exported.state_dict(), milestone.state_dict()
    for k, v in merged.items():
        torch.testing.assert_close(in_bf16[k].float(), v, rtol=1e-2, atol=1e-3, msg=k)

    resumed = tmp_path / "resumed"
    _resume_from_step_1(straight, resumed, overrides, cache_dir=micro_cache)
    _assert_resumed_equals_straight(straight, resumed, 1, RESUMED_METRICS)


def test_checkpoints_of_full_and_lora_runs_do_not_mix_and_say_why():
    from medsrl.models.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    plain = build_tiny_model(seed=0, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, intermediate_size=32)
    full_state = RLModule(plain, tok).state_dict()
    lora_module = RLModule(apply_lora(plain, LoraSettings(r=4)), tok)
    with pytest.raises(RuntimeError, match="holds full weights"):
        lora_module.load_state_dict(full_state)
    adapters = lora_module.state_dict()
    plain2 = build_tiny_model(seed=0, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=1, intermediate_size=32)
    with pytest.raises(RuntimeError, match="holds LoRA adapter weights"):
        RLModule(plain2, tok).load_state_dict(adapters)
    lora_module.load_state_dict(adapters)  # its own: fine, the base needs nothing


# Qwen2.5-Math-1.5B's experiment (precision bf16-mixed, gradient checkpointing, DAPO + MEDS) at 2
# narrow random layers of its architecture with the shared tokenizer, small batches, HF rollouts;
# with LoRA its base is bf16 and its adapters fp32 (model.lora.base_dtype: compute).
SMALL_REAL = [
    "experiment=qwen2.5-math-1.5b_meds", "trainer=gpu", "trainer.accelerator=cpu", "trainer.devices=1",
    "rollout.backend=hf", "data.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=8",
    "rollout.max_batch_size=16", "algorithm.mini_batch_prompts=2", "algorithm.micro_batch_size=4",
    "algorithm.plugins.overlong.buffer_length=4", "optim.scheduler.warmup_steps=0",
    "callbacks.pass_at_k.every_n_steps=0", "callbacks.pass_at_k.at_start=false",
    "callbacks.sample_logger.every_n_steps=0", "logger=csv", "export_policy=false",
    "model.random_init=true", "model.shape.num_hidden_layers=2", "model.shape.hidden_size=128",
    "model.shape.num_attention_heads=4", "model.shape.num_key_value_heads=2", "model.shape.head_dim=32",
    "model.shape.intermediate_size=256", "optim.optimizer.lr=1e-4",
    "callbacks.model_checkpoint.every_n_train_steps=1", *LORA,
]


def _some_right(self, responses, golds):
    """A random model answers nothing right: grade every third response right, so DAPO keeps groups."""
    return [GradeResult(1.0, "x", True) if i % 3 == 0 else GradeResult(0.0, None, False)
            for i in range(len(responses))]


@pytest.mark.usefixtures("cpu_bf16_gemms")
def test_lora_on_a_real_architecture_trains_adapters_and_resumes_exactly(tmp_path, monkeypatch):
    tok = str(require_shared("tokenizers", "qwen2.5-math"))
    monkeypatch.setattr(MathGrader, "grade_batch", _some_right)
    overrides = [*SMALL_REAL, f"model.tokenizer={tok}"]
    straight = tmp_path / "straight"
    cfg = compose_train(straight, overrides + ["trainer.max_steps=2"], debug=None)
    assert cfg.model.gradient_checkpointing and cfg.trainer.precision == "bf16-mixed"
    run, summary, (base0, adapters0), (base1, adapters1) = _run_and_weights(cfg)
    assert summary["steps"] == 2 and is_lora(run.module.policy)
    # LoRA as users run it (model.lora.base_dtype: compute): a bf16 frozen base, fp32 adapters
    assert {w.dtype for w in base1.values()} == {torch.bfloat16}
    assert {w.dtype for w in adapters1.values()} == {torch.float32}
    assert all(torch.equal(base1[n], w) for n, w in base0.items())
    assert any(not torch.equal(adapters1[n], w) for n, w in adapters0.items())
    ckpt = torch.load(straight / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert set(ckpt) == {f"policy.{n}" for n in adapters0}

    resumed = tmp_path / "resumed"
    _resume_from_step_1(straight, resumed, overrides, debug=None)
    _assert_resumed_equals_straight(straight, resumed, 1,
                                    ["train/reward", "train/pg_loss", "train/kl", "train/grad_norm"])


def test_lora_under_fsdp_matches_one_process(tmp_path):
    """Two FSDP processes (the adapters their own units, so a layer's unit holds frozen weights
    only) train the adapters as one process does, the KL reference being the adapters switched
    off inside the gathered policy."""
    from run_helpers import CPU_TWO_PROCESSES, train_in_subprocess

    # 4 prompts in generate chunks of 2: each rank samples what one process samples for its half
    run = ["debug=fast", *LORA, "rollout.max_batch_size=8", "trainer.max_steps=2"]
    train_in_subprocess(tmp_path / "one", tmp_path / "cache", run)
    train_in_subprocess(tmp_path / "two", tmp_path / "cache",
                        [*run, "trainer=fsdp", *CPU_TWO_PROCESSES, "trainer.strategy.state_dict_type=full"])
    a, b = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    for step in range(2):
        for name in ["train/reward", "train/grad_norm", "train/entropy"]:
            assert b[step][name] == pytest.approx(a[step][name], rel=1e-5), (step, name)
    assert b[1]["train/kl"] == pytest.approx(a[1]["train/kl"], rel=0.05)  # ~3e-5: rounding shows
    wa, wb = (torch.load(tmp_path / name / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
              for name in ("one", "two"))
    assert wa.keys() == wb.keys() and all(is_adapter_key(k) for k in wa)  # whole adapter tensors, no base
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5, msg=k)
