"""The LightningModule on its own: real-model architectures, the NaN guard, dynamic sampling."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from medsrl.algo.settings import AlgorithmConfig
from medsrl.data.arithmetic import generate_arithmetic
from medsrl.data.datamodule import MathDataModule
from medsrl.data.settings import DataConfig
from medsrl.methods.dynamic_sampling import DynamicSampling
from medsrl.models.char_tokenizer import build_char_tokenizer
from medsrl.models.loading import load_tokenizer, random_model_like
from medsrl.models.tiny import build_tiny_model
from medsrl.module import RLModule
from medsrl.rollout.settings import RolloutConfig
from medsrl.step.settings import OptimConfig
from run_helpers import compose_train
from shared_paths import require_shared

pytestmark = pytest.mark.slow


def _datamodule(n_prompts: int = 2) -> MathDataModule:
    return MathDataModule(DataConfig(
        stages=[{"name": "A", "start_step": 0, "datasets": [
            {"name": "a", "weight": 1.0, "source": generate_arithmetic(16, level=1, seed=0, split="train")}]}],
        val=None,
        prompts_per_step=n_prompts,
    ))


def _fit(module: RLModule, dm: MathDataModule, steps: int = 1) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0)
    trainer.fit(module, datamodule=dm)
    return trainer


SMALL_ALGO = {"name": "grpo", "clip_high": 0.2, "dual_clip": None, "loss_agg_mode": "seq-mean-token-mean",
              "kl_coef": 0.001, "entropy_coef": 0.01, "micro_batch_size": 4}


@pytest.mark.parametrize("model_cfg", ["qwen2.5-math-1.5b", "qwen2.5-math-7b", "qwen3-1.7b", "qwen3-8b"])
def test_real_model_config_takes_one_training_step(tmp_path, model_cfg):
    """Each real config's architecture, at 2 random layers, with the shared Qwen tokenizer."""
    tok_dir = require_shared("tokenizers", "qwen2.5-math")
    cfg = compose_train(tmp_path, [f"model={model_cfg}"])
    assert cfg.model.name_or_path.startswith("Qwen/")
    tok = load_tokenizer(str(tok_dir))
    policy = random_model_like(cfg.model.architecture, len(tok), num_hidden_layers=2)
    assert policy.config.model_type == cfg.model.architecture
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    module = RLModule(policy, tok, algorithm=AlgorithmConfig(**SMALL_ALGO),
                      rollout=RolloutConfig(**{"n": 2, "max_new_tokens": 6}),
                      optim=OptimConfig(optimizer={"lr": 1e-2}, scheduler={"warmup_steps": 0}))
    dm = _datamodule()
    prompt = dm.prompts_for_step(0)[0].text
    assert tok(prompt)["input_ids"][0] == tok.convert_tokens_to_ids("<|im_start|>")
    trainer = _fit(module, dm)
    assert trainer.global_step == 1
    changed = [k for k, v in policy.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "one step must change the weights"
    assert module.ref_policy is not None  # KL on: a frozen reference copy
    assert module.last_rollouts.ref_logp is not None


def test_nonfinite_loss_skips_the_update_and_keeps_the_weights(monkeypatch, caplog):
    tok = build_char_tokenizer()
    policy = build_tiny_model(seed=0, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=1, intermediate_size=32)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    module = RLModule(policy, tok, algorithm=AlgorithmConfig(**{**SMALL_ALGO, "kl_coef": 0.0}),
                      rollout=RolloutConfig(**{"n": 2, "max_new_tokens": 4}),
                      optim=OptimConfig(optimizer={"lr": 1e-1}, scheduler={"warmup_steps": 0}))
    import medsrl.step.update as update

    real = update.micro_loss

    def nan_loss(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return loss * float("nan"), metrics

    monkeypatch.setattr(update, "micro_loss", nan_loss)
    with caplog.at_level("WARNING"):
        trainer = _fit(module, _datamodule())
    assert trainer.global_step == 1  # the step still counts
    for k, v in policy.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert any("non-finite loss" in r.getMessage() and "step 0" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("dynamic_sampling", [False, True])
def test_engine_logprobs_are_carried_and_compared_with_the_trainers(dynamic_sampling, monkeypatch):
    """HF rollouts share the trainer's module, so the gap is numerics only (KV cache vs one
    forward); sampling at temperature 0.5 opens a real gap, which the metric must show. With
    dynamic sampling the log-probs must follow the kept groups (a random model answers nothing
    right, so every third response is graded right here to give groups a spread)."""
    from medsrl.reward.grader import GradeResult, MathGrader

    real = MathGrader.grade_batch

    def some_right(self, responses, golds):
        return [GradeResult(1.0, "x", True) if i % 3 == 0 else g
                for i, g in enumerate(real(self, responses, golds))]

    monkeypatch.setattr(MathGrader, "grade_batch", some_right)
    tok = build_char_tokenizer()
    gaps = {}
    for temperature in (1.0, 0.5):
        policy = build_tiny_model(seed=0, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1, intermediate_size=32)
        algo = {**SMALL_ALGO, "kl_coef": 0.0}
        plugins = [DynamicSampling(max_rounds=2)] if dynamic_sampling else []
        module = RLModule(policy, tok, algorithm=AlgorithmConfig(**algo),
                          optim=OptimConfig(optimizer={"lr": 1e-2}, scheduler={"warmup_steps": 0}), plugins=plugins,
                          rollout=RolloutConfig(**{"n": 4, "max_new_tokens": 6, "temperature": temperature,
                                                   "logprobs": True}))
        trainer = _fit(module, _datamodule(4))
        r = module.last_rollouts
        assert r.engine_logp is not None and r.engine_logp.shape == r.old_logp.shape
        assert (r.engine_logp * (1 - r.packed.response_mask)).abs().sum() == 0  # padding stays 0
        assert ((r.engine_logp < 0) == r.packed.response_mask.bool()).all()
        gaps[temperature] = {k: float(v) for k, v in trainer.callback_metrics.items() if "engine/" in k}
    assert gaps[1.0]["train/engine/logprob_diff_mean"] < 1e-4
    assert gaps[1.0]["train/engine/kl_k3"] < 1e-6
    assert gaps[0.5]["train/engine/logprob_diff_mean"] > 1e-2
    assert gaps[0.5]["train/engine/kl_k3"] > 1e-4


def test_truncated_is_runs_in_a_step_and_needs_plain_sampling_with_engine_logprobs():
    """With the HF engine (the trainer's own module) the engine/trainer ratio is 1 up to KV-cache
    numerics: the weights' mean is 1 and none is capped. Settings under which the weight would
    not measure the engine are refused, naming them."""
    tok = build_char_tokenizer()
    algo = {**SMALL_ALGO, "kl_coef": 0.0, "engine_is_cap": 2.0}
    module = RLModule(_tiny_policy(), tok, algorithm=AlgorithmConfig(**algo),
                      optim=OptimConfig(optimizer={"lr": 1e-2}, scheduler={"warmup_steps": 0}),
                      rollout=RolloutConfig(**{"n": 4, "max_new_tokens": 6, "logprobs": True}))
    metrics = {k: float(v) for k, v in _fit(module, _datamodule(2)).callback_metrics.items()}
    assert metrics["train/engine_is/weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["train/engine_is/capped_frac"] == 0.0
    with pytest.raises(ValueError, match="rollout.logprobs=true"):
        RLModule(_tiny_policy(), tok, algorithm=AlgorithmConfig(**algo), rollout=RolloutConfig(**{"logprobs": False}))
    with pytest.raises(ValueError, match="temperature=0.6"):
        RLModule(_tiny_policy(), tok, algorithm=AlgorithmConfig(**algo),
                 rollout=RolloutConfig(**{"logprobs": True, "temperature": 0.6}))


def _tiny_policy():
    return build_tiny_model(seed=0, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, intermediate_size=32)


def test_which_steps_need_the_scoring_forward():
    from medsrl.methods.entropy_bonus import EntropyBonus
    from medsrl.methods.overlong import OverlongPenalty

    tok = build_char_tokenizer()
    on_policy = {**SMALL_ALGO, "kl_coef": 0.0, "entropy_coef": 0.0}

    def needed(algo=on_policy, plugins=(), rollout=None):
        return RLModule(_tiny_policy(), tok, algorithm=AlgorithmConfig(**algo), plugins=list(plugins),
                        rollout=rollout).scoring_forward_needed

    assert not needed()
    assert not needed(plugins=[DynamicSampling(max_rounds=2), OverlongPenalty(buffer_length=4)])
    assert not needed({**on_policy, "kl_coef": 0.01})  # the reference pass is its own
    assert needed({**on_policy, "ppo_epochs": 2})  # the second epoch is off-policy
    assert needed({**on_policy, "mini_batch_prompts": 1})  # so is every mini-batch after the first
    assert needed(plugins=[EntropyBonus(coef=0.01)])  # reads the token entropies
    assert needed({**on_policy, "policy_loss": "lp_reg"})  # its proxy is a token stat
    assert needed(rollout=RolloutConfig(**{"logprobs": True}))  # the engine's log-probs are compared with it


def test_an_on_policy_step_without_the_scoring_forward_makes_the_same_update(monkeypatch):
    """Old log-probs = the update's own, detached: the same gradient as a separate forward's
    (which equal them up to float rounding), one forward fewer."""
    import medsrl.module as module_py

    calls = []
    real = module_py.scoring_pass
    monkeypatch.setattr(module_py, "scoring_pass", lambda *a, **k: calls.append(1) or real(*a, **k))
    tok = build_char_tokenizer()
    weights = {}
    for forced in (False, True):
        if forced:
            monkeypatch.setattr(RLModule, "scoring_forward_needed", property(lambda self: True))
        policy = _tiny_policy()
        module = RLModule(policy, tok, algorithm=AlgorithmConfig(**{**SMALL_ALGO, "kl_coef": 0.0, "entropy_coef": 0.0}),
                          rollout=RolloutConfig(**{"n": 4, "max_new_tokens": 6}),
                          optim=OptimConfig(optimizer={"lr": 1e-2}, scheduler={"warmup_steps": 0}))
        _fit(module, _datamodule(2), steps=2)
        weights[forced] = {k: v.clone() for k, v in policy.state_dict().items()}
        assert len(calls) == (2 if forced else 0)
    for k, v in weights[True].items():
        assert torch.allclose(weights[False][k], v, atol=1e-6), k
    assert any(not torch.equal(v, _tiny_policy().state_dict()[k]) for k, v in weights[True].items())


def test_gradients_are_freed_after_the_last_optimiser_step_of_a_step():
    """They would otherwise stay allocated (4 bytes a parameter) through the next generation."""
    seen: list[bool] = []

    class AfterStep(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(all(p.grad is None for p in pl_module.policy.parameters()))

    tok = build_char_tokenizer()
    module = RLModule(_tiny_policy(), tok,
                      algorithm=AlgorithmConfig(**{**SMALL_ALGO, "kl_coef": 0.0, "mini_batch_prompts": 1}),
                      rollout=RolloutConfig(**{"n": 2, "max_new_tokens": 4}),
                      optim=OptimConfig(optimizer={"lr": 1e-2}, scheduler={"warmup_steps": 0}))
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[AfterStep()])
    trainer.fit(module, datamodule=_datamodule())
    assert seen == [True, True]
    assert any(not torch.equal(v, before[k]) for k, v in module.policy.state_dict().items())  # it did train


def test_prompt_visits_are_counted_logged_and_kept_in_the_checkpoint():
    from medsrl.step.metrics import PromptVisits

    v = PromptVisits()
    assert v.metrics() == {"data/visits_mean": 0.0, "data/prompts_seen": 0.0}
    v.add(["a", "a", "c"])
    v.begin_step()
    v.add(["a", "b"])  # this step: a (3rd visit), b (1st)
    assert v.metrics() == {"data/visits_mean": 2.0, "data/prompts_seen": 3.0}
    tok = build_char_tokenizer()
    module = RLModule(_tiny_policy(), tok, algorithm=AlgorithmConfig(**{**SMALL_ALGO, "kl_coef": 0.0}),
                      rollout=RolloutConfig(**{"n": 2, "max_new_tokens": 4}))
    dm = _datamodule(2)  # 2 prompts a step from a pool of 16
    metrics = {k: float(v) for k, v in _fit(module, dm, steps=3).callback_metrics.items()}
    counts = module.prompt_visits.counts
    assert sum(counts.values()) == 6 and metrics["train/data/prompts_seen"] == len(counts)
    assert metrics["train/data/visits_mean"] >= 1.0
    ckpt: dict = {}
    module.on_save_checkpoint(ckpt)
    other = RLModule(_tiny_policy(), tok, algorithm=AlgorithmConfig(**{**SMALL_ALGO, "kl_coef": 0.0}))
    other.on_load_checkpoint(ckpt)
    assert other.prompt_visits.counts == counts
