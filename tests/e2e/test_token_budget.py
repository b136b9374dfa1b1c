"""Token-budget micro-batches change no number: a MEDS run cut by a token budget (rows sorted by
length, each micro-batch as wide as its own longest row) logs the per-step metrics and ends with
the weights of the same run cut in row order by a small row count. The loss is normalised by the
mini-batch's global token count, so how it is cut is float rounding only."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from medsrl.train import train
from run_helpers import MICRO_WARM_START, compose_train, read_metrics

pytestmark = pytest.mark.slow

RUN = [
    "algorithm=meds",
    "data.stages=[{name: A, start_step: 0, datasets: [{name: a, weight: 1.0, source: "
    "{_target_: medsrl.data.arithmetic.generate_arithmetic, num: 16, level: 1, split: train}}]}]",
    "data.prompts_per_step=4", "rollout.n=4", "trainer.max_steps=2",
    "algorithm.mini_batch_prompts=2",  # two updates a step, each of several micro-batches
    "algorithm.plugins.meds.mixed_groups_only=false",
    "callbacks.pass_at_k.every_n_steps=0", "callbacks.pass_at_k.at_start=false",
    "export_policy=true",
]
PADDED = ["algorithm.micro_batch_size=3"]  # in row order, each as wide as the step's longest row
BUDGET = ["algorithm.micro_batch_size=8", "algorithm.max_tokens_per_microbatch=160"]
SKIP = ("/time/", "padding/", "refit_blocked", "top1_eigen_ratio")  # the clusters are read with shaping's labels: equal


def test_a_token_budget_gives_the_padded_runs_metrics_and_weights(tmp_path, micro_cache):
    runs = {}
    for name, cut in (("padded", PADDED), ("budget", BUDGET)):
        out = tmp_path / name
        train(compose_train(out, MICRO_WARM_START + RUN + cut, cache_dir=micro_cache))
        runs[name] = out
    padded, budget = read_metrics(runs["padded"]), read_metrics(runs["budget"])
    assert sorted(padded) == sorted(budget) == [0, 1]
    for step in padded:
        keys = [k for k in padded[step] if k.startswith("train/") and not any(s in k for s in SKIP)]
        assert "train/pg_loss" in keys and "train/entropy" in keys and "train/grad_norm" in keys
        for key in keys:
            # rounding: at most 1.2e-6 relative seen (step 1's grad norm, after one update whose sums
            # ran in another order); a wrong row or token count would be off by far more
            assert budget[step][key] == pytest.approx(padded[step][key], rel=2e-6, abs=1e-6), (step, key)
        # the budget ran fewer padded tokens
        assert budget[step]["train/padding/update_frac"] < padded[step]["train/padding/update_frac"]
        assert budget[step]["train/padding/scoring_frac"] < padded[step]["train/padding/scoring_frac"]
    wa = load_file(runs["padded"] / "policy" / "model.safetensors")
    wb = load_file(runs["budget"] / "policy" / "model.safetensors")
    for name in wa:
        # AdamW divides each step by the gradient's own scale: one element of 21,952 off by 1.05e-6
        # seen; a missed row would move weights by about the lr (3e-5 here)
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-6, atol=2e-6, msg=name)
