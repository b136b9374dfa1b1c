"""``medsrl-plan``: every shipped experiment plans, every GPU experiment fits what it declares."""

from __future__ import annotations

import functools

import pytest

from medsrl.plan.cli import compose_train_config, main, plan_for
from run_helpers import ROOT


@functools.cache
def experiments() -> list[str]:
    return sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("*.yaml") if not p.stem.startswith("_"))


@pytest.mark.slow
def test_every_experiment_plans():
    for name in experiments():
        cfg = compose_train_config([f"experiment={name}"])
        plan = plan_for(cfg)
        phases = ["generation", "scoring", "update", "optimizer step"]
        if cfg.rollout.backend == "vllm":  # the engine's own copy of the weights: synced at start and after each update
            phases = ["first weight sync", *phases, "weight sync"]
        phases.insert(0, "resume")  # any run can resume from its checkpoint
        callbacks = cfg.get("callbacks") or {}
        val = callbacks.get("pass_at_k")
        if val is not None and "_target_" in val and val.every_n_steps > 0:
            phases.append("validation sampling")
            if val.get("features", "run") is not None:
                phases.append("validation features")
        milestones = callbacks.get("milestones")
        if milestones is not None and "_target_" in milestones and milestones.every_n_steps > 0:
            phases.append("milestone")
        assert [p.name for p in plan.phases] == phases, name
        assert all(p.total > 0 for p in plan.phases), name


@pytest.mark.slow
def test_every_gpu_experiment_declares_its_hardware_and_fits_it():
    gpu = []
    for name in experiments():
        cfg = compose_train_config([f"experiment={name}"])
        if cfg.trainer.accelerator == "cpu":
            continue
        gpu.append(name)
        assert cfg.get("hardware"), f"{name}: a GPU experiment must declare hardware.gpu_memory_gib"
        plan = plan_for(cfg)
        assert plan.fits, f"{name} does not fit {cfg.hardware.name}: {plan.hints()}"
    assert len(gpu) == 10, gpu  # 4 Qwen models x (DAPO, MEDS) and R1-Distill x (DAPO, R3)


def test_7b_on_one_gpu_does_not_fit_and_says_what_to_turn(capsys):
    assert main(["experiment=qwen2.5-math-7b_meds", "trainer=gpu", "trainer.devices=1"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out
    assert "trainer=fsdp" in out  # the knob for weights, gradients and AdamW states


def test_too_many_generate_rows_do_not_fit_and_name_the_knob(capsys):
    assert main(["experiment=qwen3-8b_dapo", "rollout.backend=hf", "rollout.max_batch_size=256"]) == 1
    hint = capsys.readouterr().out.split("DOES NOT FIT")[1]
    assert "KV cache" in hint and "rollout.max_batch_size" in hint


def test_fits_prints_every_phase(capsys):
    assert main(["experiment=qwen2.5-math-1.5b_meds"]) == 0
    out = capsys.readouterr().out
    for phase in ("resume:", "first weight sync:", "generation:", "scoring:", "update:", "optimizer step:",
                  "weight sync:", "validation sampling:", "validation features:", "milestone:", "FITS 1x H100 80GB"):
        assert phase in out


def test_cpu_presets_plan_without_a_verdict(capsys):
    assert main(["--prompt-tokens", "32"]) == 0
    assert "not checked" in capsys.readouterr().out


def test_devices_auto_is_refused_with_the_setting_to_give():
    with pytest.raises(ValueError, match="trainer.devices=N"):
        plan_for(compose_train_config(["experiment=qwen2.5-math-7b_meds", "trainer.devices=auto"]))
