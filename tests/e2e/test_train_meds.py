"""MEDS end to end: a micro warm-started model writes boxed answers, the memory fills, wrong
answers that repeat are penalised, and a resumed run continues with the same memory."""

from __future__ import annotations

import pytest
import torch

from medsrl.train import train
from run_helpers import MICRO_WARM_START, compose_train, read_metrics

pytestmark = pytest.mark.slow

# Four prompts, all of them every step: each key comes back every step, so memory matters.
FOUR_PROMPTS = [
    "data.stages=[{name: A, start_step: 0, datasets: [{name: a, weight: 1.0, source: "
    "{_target_: medsrl.data.arithmetic.generate_arithmetic, num: 4, level: 1, split: train}}]}]",
    "algorithm=meds",
    "algorithm.plugins.meds.snapshot_every_n_steps=1",
    "algorithm.plugins.meds.mixed_groups_only=false",  # debug=fast has no DAPO filter
]


@pytest.fixture
def cache_dir(micro_cache):
    return micro_cache


def _run(out, cache_dir, extra):
    return train(compose_train(out, MICRO_WARM_START + FOUR_PROMPTS + extra, cache_dir=cache_dir))


def test_meds_fills_memory_penalises_and_resumes_identically(tmp_path, cache_dir):
    straight = tmp_path / "straight"
    _run(straight, cache_dir, ["trainer.max_steps=3"])
    m = read_metrics(straight)
    steps = [m[s] for s in sorted(m) if "train/meds/memory_entries" in m[s]]
    assert len(steps) == 3
    assert steps[0]["train/meds/answer_found_rate"] > 0.5  # the warm start taught the \boxed{}
    assert steps[0]["train/meds/penalty_max"] == 0.0  # first visit: memory only
    assert steps[2]["train/meds/memory_entries"] > steps[0]["train/meds/memory_entries"] > 0
    assert steps[2]["train/meds/penalty_max"] > 0.0  # repeated mistakes now cost
    assert (straight / "memory" / "memory.npz").exists() or any(straight.rglob("memory.npz"))

    first = tmp_path / "first"
    _run(first, cache_dir, ["trainer.max_steps=2"])
    resumed = tmp_path / "resumed"
    _run(resumed, cache_dir, ["trainer.max_steps=3", f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}"])
    a = read_metrics(straight)[2]
    b = read_metrics(resumed)[2]
    for name in ["train/reward", "train/score", "train/meds/penalty_mean", "train/meds/penalty_max",
                 "train/meds/memory_entries", "train/meds/cluster_size_mean", "train/pg_loss"]:
        assert b[name] == pytest.approx(a[name], rel=1e-5, abs=1e-6), name
    ckpt = torch.load(resumed / "checkpoints" / "last.ckpt")  # loads with weights_only=True
    assert "plugin:meds" in ckpt["callbacks"]


def test_remember_dropped_puts_the_filtered_groups_into_memory(tmp_path, cache_dir):
    """DAPO's filter drops the groups without spread; with the option their features enter the
    memory too, and nothing else about the first step changes."""
    dapo = ["algorithm=meds", "trainer.max_steps=2",
            "algorithm.plugins.dynamic_sampling="
            "{_target_: medsrl.methods.dynamic_sampling.DynamicSampling, max_rounds: 3}"]
    runs = {}
    for flag in ("false", "true"):
        out = tmp_path / flag
        cfg = compose_train(out, MICRO_WARM_START + dapo + [f"algorithm.plugins.meds.remember_dropped={flag}"],
                            cache_dir=cache_dir)
        assert train(cfg)["steps"] == 2
        runs[flag] = read_metrics(out)
    off, on = runs["false"], runs["true"]
    assert sum(on[s].get("train/meds/dropped_rows_remembered", 0.0) for s in on) > 0
    assert all("train/meds/dropped_rows_remembered" not in off[s] for s in off)
    assert on[0]["train/pg_loss"] == off[0]["train/pg_loss"]  # step 0: the memory was empty either way
    assert on[1]["train/meds/memory_entries"] > off[1]["train/meds/memory_entries"]
