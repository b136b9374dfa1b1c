"""The pass@k validation callback logs val/pass@k and diversity before training and every N steps."""

from __future__ import annotations

import pytest

from medsrl.train import train
from run_helpers import MICRO_WARM_START, compose_train, read_metrics

pytestmark = pytest.mark.slow


def test_pass_at_k_and_diversity_are_logged_at_start_and_every_n_steps(tmp_path):
    out = tmp_path / "run"
    overrides = [
        *MICRO_WARM_START,
        "callbacks.pass_at_k.n=4",
        "callbacks.pass_at_k.num_problems=6",
        "trainer.max_steps=2",
        "data.val_size=8",
    ]
    train(compose_train(out, overrides))
    metrics = read_metrics(out)
    for step in (0, 2):
        m = metrics[step]
        for name in [
            "val/pass@1",
            "val/pass@2",
            "val/pass@4",
            "val/maj@n",
            "val/distinct_answers",
            "val/distinct_wrong",
            "val/wrong_clusters",
        ]:
            assert name in m, (step, name)
        assert m["val/pass@1"] <= m["val/pass@2"] <= m["val/pass@4"]
        assert 1.0 <= m["val/distinct_answers"] <= 4.0  # the warm-started micro model boxes answers
    assert "val/pass@1" not in metrics.get(1, {})
