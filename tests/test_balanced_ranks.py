"""Balanced ranks end to end: DAPO's fill left every kept group of step 0 on rank 0 (rank 1 would
have had none and skipped the step); the deal (step/balance.py) moves whole groups, and the
2-process DDP run is still one process's run: the same metrics, MEDS memory, R3 history and weights."""

from __future__ import annotations

import pytest

from run_helpers import (
    CPU_TWO_PROCESSES,
    TWO_RANK_RUN,
    assert_matches_one_process,
    read_metrics,
    train_in_subprocess,
)

pytestmark = pytest.mark.slow

DAPO = "algorithm.plugins.dynamic_sampling={_target_: medsrl.methods.dynamic_sampling.DynamicSampling, max_rounds: 10}"
# 64 training problems (TWO_RANK_RUN has 8): enough for the extra rounds to fill the batch
RUN = [o.replace("num: 8,", "num: 64,") for o in TWO_RANK_RUN] + [DAPO]


def test_dapo_fill_dealt_over_two_ranks_is_one_process(tmp_path, micro_cache):
    assert RUN != [*TWO_RANK_RUN, DAPO]
    one, two = tmp_path / "one", tmp_path / "two"
    train_in_subprocess(one, micro_cache, RUN)
    train_in_subprocess(two, micro_cache, [*RUN, "trainer=ddp", *CPU_TWO_PROCESSES])
    a, b = read_metrics(one), read_metrics(two)
    assert a[0]["train/dynamic_sampling/extra_rounds"] > 0  # the fill ran extra rounds
    assert b[0]["train/rank_token_imbalance_before"] > 1.3  # seen: 2.0, every group on one rank
    assert b[0]["train/rank_token_imbalance"] < 1.1
    assert sum(b[s]["train/rank_moved_groups"] for s in range(3)) > 0
    assert all(a[s]["train/rank_token_imbalance"] == 1.0 for s in range(3))  # one process: nothing to deal
    assert_matches_one_process(one, two, b)
