"""End to end on CPU: a two-step run, resume, weights-only start, config errors."""

from __future__ import annotations

import pytest
import torch
from hydra.errors import ConfigCompositionException

from medsrl.train import train
from run_helpers import compose_train, read_metrics

pytestmark = pytest.mark.slow


def test_two_step_run_writes_metrics_checkpoints_and_policy(tmp_path):
    out = tmp_path / "run"
    cfg = compose_train(out, ["export_policy=true"])
    summary = train(cfg)
    assert summary["steps"] == 2
    assert 0.0 <= summary["val_accuracy_start"] <= 1.0
    assert 0.0 <= summary["val_accuracy_end"] <= 1.0
    assert (out / "checkpoints" / "last.ckpt").exists()
    assert (out / "checkpoints" / "step_000002.ckpt").exists()
    assert (out / "policy" / "config.json").exists()
    metrics = read_metrics(out)
    step_rows = [m for m in metrics.values() if "train/reward" in m]
    assert len(step_rows) == 2
    for name in ["train/acc", "train/response_length", "train/truncation_rate", "train/clipfrac",
                 "train/entropy", "train/zero_spread_group_frac", "train/time/generate",
                 "train/time/update", "train/grader/timeouts_step"]:
        assert any(name in m for m in step_rows), name


STEP_METRICS = ["train/reward", "train/acc", "train/pg_loss", "train/entropy", "train/grad_norm",
                "train/response_length", "train/clipfrac", "train/ppo_kl"]


def test_resume_gives_the_same_step3_metrics(tmp_path):
    straight = tmp_path / "straight"
    train(compose_train(straight, ["trainer.max_steps=3", "algorithm=grpo"]))
    first = tmp_path / "first"
    train(compose_train(first, ["trainer.max_steps=2", "algorithm=grpo"]))
    ckpt = first / "checkpoints" / "last.ckpt"
    resumed = tmp_path / "resumed"
    train(compose_train(resumed, ["trainer.max_steps=3", "algorithm=grpo", f"ckpt_path={ckpt}"]))

    a = read_metrics(straight)
    b = read_metrics(resumed)
    step3_a = next(m for s, m in a.items() if m.get("train/reward") is not None and s == 2)
    step3_b = next(m for s, m in b.items() if m.get("train/reward") is not None and s == 2)
    for name in STEP_METRICS:
        assert step3_b[name] == pytest.approx(step3_a[name], rel=1e-5, abs=1e-6), name
    wa = torch.load(straight / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    wb = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)


def test_weights_only_start_keeps_weights_and_resets_step(tmp_path):
    first = tmp_path / "a"
    train(compose_train(first, ["trainer.max_steps=1"]))
    ckpt = first / "checkpoints" / "last.ckpt"
    second = tmp_path / "b"
    cfg = compose_train(second, ["trainer.max_steps=1", f"ckpt_path={ckpt}", "resume_mode=weights",
                                 "optim.optimizer.lr=0.0"])
    summary = train(cfg)
    assert summary["steps"] == 1  # a fresh step counter, not 1 + 1
    wa = torch.load(ckpt, weights_only=False)
    wb = torch.load(second / "checkpoints" / "last.ckpt", weights_only=False)
    assert wb["global_step"] == 1
    for k, v in wa["state_dict"].items():  # lr 0: the stage-A weights came through unchanged
        torch.testing.assert_close(v, wb["state_dict"][k])
    assert wb["optimizer_states"][0]["state"][0]["step"] == 1  # fresh optimiser: one step only


def test_stage_switch_happens_at_its_step_and_is_logged(tmp_path, caplog):
    out = tmp_path / "stages"
    stage_b = ("data.stages=[{name: A, start_step: 0, datasets: [{name: a, weight: 1.0, source: "
               "{_target_: medsrl.data.arithmetic.generate_arithmetic, num: 32, level: 1, split: train}}]},"
               "{name: B, start_step: 1, datasets: [{name: b, weight: 1.0, source: "
               "{_target_: medsrl.data.arithmetic.generate_arithmetic, num: 32, level: 2, split: train}}]}]")
    cfg = compose_train(out, [stage_b])
    with caplog.at_level("INFO"):
        train(cfg)
    stages = [m["train/stage"] for s, m in sorted(read_metrics(out).items()) if "train/stage" in m]
    assert stages == [0.0, 1.0]
    assert any("A -> B" in r.getMessage() for r in caplog.records)


def test_mistyped_key_fails_at_start(tmp_path):
    with pytest.raises(ConfigCompositionException, match="clip_hgh"):
        compose_train(tmp_path, ["algorithm.clip_hgh=0.3"])


def test_added_unknown_algorithm_key_fails_before_training(tmp_path):
    cfg = compose_train(tmp_path / "x", ["+algorithm.clip_hgh=0.3"])
    with pytest.raises(ValueError, match="clip_hgh"):
        train(cfg)


def test_missing_required_value_fails_at_start(tmp_path):
    cfg = compose_train(tmp_path / "x", ["model.name_or_path=???"])
    with pytest.raises(ValueError, match="model.name_or_path"):
        train(cfg)


def test_the_run_drops_prompts_longer_than_the_engine_takes(tmp_path):
    """Issue 35: the data is cut at build to max_model_len - max_new_tokens, for either backend."""
    from medsrl.train import build_run

    run = build_run(compose_train(tmp_path, []))  # debug=fast: the tiny model's 1024 positions
    assert run.datamodule.prompt_token_limit == 1024 - 16  # rollout.max_new_tokens
    assert [(d.dataset, d.dropped) for d in run.datamodule.prompt_drops] == [
        ("arithmetic_l1", 0), ("arithmetic_l1_val", 0)]


def test_data_the_engine_cannot_take_fails_at_start_naming_the_settings(tmp_path):
    cfg = compose_train(tmp_path, ["rollout.max_new_tokens=1000"])  # 24 tokens left of 1024
    with pytest.raises(ValueError, match=r"stage 'A' dataset 'arithmetic_l1': 64 of 64 prompts .* longer "
                       r"than 24 tokens.*min\(rollout.max_prompt_tokens 2048 \+ rollout.max_new_tokens "
                       r"1000, the model's 1024 positions\) - rollout.max_new_tokens 1000"):
        train(cfg)


def test_plugins_are_built_in_order_named_by_their_keys(caplog):
    from medsrl.run_config import RunConfig
    from medsrl.train import build_plugins
    from run_helpers import BASE_CONFIG, config_problems

    group = {
        "overlong": {"_target_": "medsrl.methods.overlong.OverlongPenalty", "buffer_length": 4},
        "dropped": None,  # algorithm.plugins.dropped=null
        "orphan": {"buffer_length": 16},  # an experiment's settings for a plug-in not chosen
        "bonus": {"_target_": "medsrl.methods.entropy_bonus.EntropyBonus", "coef": 0.2},
    }
    with caplog.at_level("WARNING"):
        plugins = build_plugins(RunConfig.parse({**BASE_CONFIG, "algorithm": {"plugins": group}}).algorithm.plugins)
    assert [(p.name, type(p).__name__) for p in plugins] == [
        ("overlong", "OverlongPenalty"), ("bonus", "EntropyBonus")]
    assert plugins[1].coef == 0.2
    assert any("algorithm.plugins.orphan" in r.getMessage() for r in caplog.records)
    assert config_problems({"algorithm": {"plugins": {"x": {"_target_": "collections.OrderedDict"}}}}) == [
        "algorithm.plugins.x._target_ must be a medsrl Plugin class, got 'collections.OrderedDict'"]


# ---------------------------------------------------------------- sweeps: metric, skip, continue


def test_summary_has_the_final_validation_figures_and_main_returns_the_optimized_one(tmp_path):
    from medsrl.train import optimized_value

    cfg = compose_train(tmp_path / "run", ["trainer.max_steps=1", "optimized_metric=val/pass@2"])
    summary = train(cfg)
    for key in ("val/accuracy", "val/pass@1", "val/pass@2", "val/maj@n", "val/distinct_answers"):
        assert 0.0 <= summary[key] < float("inf"), key
    assert summary["val/accuracy"] == summary["val_accuracy_end"] == summary["val/pass@1"]
    assert "val/n" not in summary and "val/run" not in summary
    assert optimized_value(cfg, summary) == summary["val/pass@2"]
    cfg.optimized_metric = "val/pass@8"  # n=2: no pass@8
    with pytest.raises(ValueError, match=r"optimized_metric='val/pass@8'.*available: \[.*'val/pass@2'"):
        optimized_value(cfg, summary)
    assert optimized_value(cfg, summary, strict=False) is None  # a single run only warns
    cfg.optimized_metric = None
    assert optimized_value(cfg, summary) is None


def test_skip_if_done_returns_a_finished_runs_summary_without_building_it(tmp_path, monkeypatch, capsys):
    import medsrl.train as train_mod

    out = tmp_path / "run"
    cfg = compose_train(out, ["trainer.max_steps=1", "skip_if_done=true"])
    first = train_mod.train_or_skip(cfg)
    assert first["steps"] == 1 and (out / "summary.json").exists()
    assert not list(out.glob(".summary.json.*"))  # written atomically: no temp file left

    def no_build(cfg):
        raise AssertionError("a finished run must not be built again")

    monkeypatch.setattr(train_mod, "build_run", no_build)
    capsys.readouterr()
    again = train_mod.train_or_skip(cfg)
    assert again == first
    assert f"[medsrl] {out} finished before (summary.json): skipped" in capsys.readouterr().out
    assert train_mod.optimized_value(cfg, again) == first["val/accuracy"]


@pytest.mark.filterwarnings("ignore:Experiment logs directory", "ignore:Checkpoint directory")
def test_skip_if_done_continues_an_interrupted_run_from_its_last_checkpoint(tmp_path, capsys):
    from medsrl.train import train_or_skip

    out = tmp_path / "run"
    # an interrupted run: its checkpoint of step 1 written, no summary.json
    train(compose_train(out, ["trainer.max_steps=1", "algorithm=grpo"]))
    (out / "summary.json").unlink()

    cfg = compose_train(out, ["trainer.max_steps=2", "algorithm=grpo", "skip_if_done=true"])
    summary = train_or_skip(cfg)
    assert f"continuing from {out / 'checkpoints' / 'last.ckpt'}" in capsys.readouterr().out
    assert summary["steps"] == 2 and (out / "summary.json").exists()
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 2
    steps = sorted(s for s, m in read_metrics(out).items() if "train/reward" in m)
    # the continued process trained step 2 only (its CSV logger rewrote metrics.csv; TensorBoard
    # would append): it started from the checkpoint's step 1
    assert steps == [1]
    assert "val_accuracy_start" not in summary  # no validation before a resumed run's first step


def test_skip_if_done_refuses_a_dir_of_a_run_with_other_settings(tmp_path):
    from medsrl.utils.rerun import check_identity

    out = tmp_path / "run"
    check_identity(compose_train(out, ["skip_if_done=true"]), out)
    check_identity(compose_train(out, ["skip_if_done=true", "ckpt_path=/x.ckpt"]), out)  # same run
    with pytest.raises(ValueError, match=r"other settings.*algorithm\.plugins\.meds\.alpha"):
        check_identity(compose_train(out, ["skip_if_done=true", "algorithm.plugins.meds.alpha=0.2"]), out)
    # a run stored before a setting existed (here data.template.kind, model.lora) is still this run
    import json

    stored = json.loads((out / "run_identity.json").read_text())
    del stored["data"]["template"]["kind"]
    stored["model"].pop("lora", None)
    (out / "run_identity.json").write_text(json.dumps(stored))
    check_identity(compose_train(out, ["skip_if_done=true"]), out)


def test_a_gpu_run_sets_the_allocator_and_thread_settings_the_user_left_unset():
    """vLLM sets torch's intra-op threads to 1 for the whole process unless OMP_NUM_THREADS is set,
    and without expandable segments fragmentation can make the KV-cache wake fail; a CPU run is
    left alone, and what the user set is kept."""
    from medsrl.run_config import TrainerSettings
    from medsrl.train import gpu_environment

    env: dict[str, str] = {}
    assert gpu_environment(TrainerSettings(accelerator="cpu", devices=2), env) == {} and env == {}
    added = gpu_environment(TrainerSettings(accelerator="gpu", devices=2), env)
    assert added == env and env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert int(env["OMP_NUM_THREADS"]) >= 1
    mine = {"OMP_NUM_THREADS": "7"}
    assert gpu_environment(TrainerSettings(accelerator="gpu", devices=[0, 1]), mine) == {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert mine["OMP_NUM_THREADS"] == "7"
