"""medsrl-eval on what a training run produced: the exported policy and a Lightning checkpoint."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from medsrl.eval import evaluate
from medsrl.train import train
from run_helpers import ROOT, compose_train

pytestmark = pytest.mark.slow


def _eval_cfg(out, model_path):
    overrides = [f"paths.output_dir={out}", f"model_path={model_path}", "dataset.num=4", "n=2",
                 "max_new_tokens=8", "batch_size=4"]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("eval", overrides=overrides)


def test_eval_reads_exported_policy_and_checkpoint_alike(tmp_path):
    run = tmp_path / "run"
    run_cfg = compose_train(run, ["export_policy=true", "trainer.max_steps=1"])
    train(run_cfg)
    results = {}
    for name, path in [("policy", run / "policy"), ("ckpt", run / "checkpoints" / "last.ckpt")]:
        out = tmp_path / name
        out.mkdir()
        if name == "ckpt":  # a Hydra run saves its config here; compose_train runs without Hydra
            (run / ".hydra").mkdir(exist_ok=True)
            OmegaConf.save({"model": run_cfg.model}, run / ".hydra" / "config.yaml")
        results[name] = evaluate(_eval_cfg(out, path))
        lines = (out / "generations.jsonl").read_text().splitlines()
        assert len(lines) == 8  # 4 problems x n=2
        assert json.loads((out / "metrics.json").read_text())["problems"] == 4
    # same weights, same seed: the checkpoint and the exported policy evaluate identically
    assert results["ckpt"] == results["policy"]


def test_eval_ckpt_without_run_config_names_the_missing_file(tmp_path):
    bad = tmp_path / "x" / "checkpoints" / "last.ckpt"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="config.yaml"):
        evaluate(_eval_cfg(tmp_path, bad))
