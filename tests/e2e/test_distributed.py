"""Two processes (Lightning DDP or FSDP, gloo on CPU) against one process with the same global batch.

Each rank generates for its own half of the prompts; the MEDS memory is all-gathered every step
and compared across ranks (a mismatch stops the run), and the result must be the run of one
process: the same metrics, the same memory, the same weights. The FSDP run stops after step 2
and resumes from its (full) checkpoint for step 3, so its checkpoint is checked too.
"""

from __future__ import annotations

import pytest
import torch

from medsrl.plugins.host import batch_share
from run_helpers import (
    CPU_TWO_PROCESSES,
    TWO_RANK_RUN,
    assert_matches_one_process,
    read_metrics,
    train_in_subprocess,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, micro_cache):
    root = tmp_path_factory.mktemp("one")
    train_in_subprocess(root / "run", micro_cache, TWO_RANK_RUN)
    return root


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_match_one_with_the_same_global_batch(tmp_path, one_process, strategy, micro_cache):
    one, two = one_process / "run", tmp_path / "two"
    cache = micro_cache  # the same warm start
    if strategy == "ddp":
        train_in_subprocess(two, cache, [*TWO_RANK_RUN, f"trainer={strategy}", *CPU_TWO_PROCESSES])
    else:
        first = tmp_path / "first"
        full = "trainer.strategy.state_dict_type=full"  # one file of whole tensors, checked below
        train_in_subprocess(first, cache,
                            [*TWO_RANK_RUN, f"trainer={strategy}", *CPU_TWO_PROCESSES, full, "trainer.max_steps=2"])
        ckpt = torch.load(first / "checkpoints" / "last.ckpt", weights_only=False)
        policy = {k: v for k, v in ckpt["state_dict"].items() if k.startswith("policy.")}
        shapes = {k: tuple(v.shape) for k, v in policy.items()}
        assert shapes["policy.model.embed_tokens.weight"][0] > 1  # whole tensors, not shards
        plain = torch.load(one / "checkpoints" / "last.ckpt", weights_only=False)
        assert shapes == {k: tuple(v.shape) for k, v in plain["state_dict"].items() if k.startswith("policy.")}
        opt, plain_opt = ckpt["optimizer_states"][0]["state"], plain["optimizer_states"][0]["state"]
        assert opt.keys() == plain_opt.keys()  # whole AdamW states, in the plain layout
        assert all(opt[i]["exp_avg"].shape == plain_opt[i]["exp_avg"].shape for i in opt)
        resume_from = f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}"
        train_in_subprocess(two, cache, [*TWO_RANK_RUN, f"trainer={strategy}", *CPU_TWO_PROCESSES, full, resume_from])

    b = read_metrics(first if strategy == "fsdp" else two)
    if strategy == "fsdp":
        for s, m in read_metrics(two).items():  # the resumed steps (validation at 2 was before the stop)
            if s >= 2:
                b.setdefault(s, {}).update(m)
    assert_matches_one_process(one, two, b)


def test_dynamic_sampling_share_keeps_the_first_groups_in_round_then_rank_order():
    # rank 0 kept 2 then 3 groups (rounds 0, 1); rank 1 kept 1 then 4; target 5:
    # round 0 -> r0: 2, r1: 1 (3 so far); round 1 -> r0: 2 (full), r1: 0
    counts = [[2, 3], [1, 4]]
    assert batch_share(counts, 0, 5) == [2, 2]
    assert batch_share(counts, 1, 5) == [1, 0]
    assert batch_share([[3, 9]], 0, 8) == [3, 5]  # one process: the first 8 in round order


def test_fsdp_shards_per_layer_in_bf16_mixed_and_resumes_from_sharded_checkpoints(tmp_path):
    """Per-layer FSDP units: the update never holds more than the root unit (embeddings, final
    norm, LM head) and two decoder layers (the one running and the one prefetched) gathered at
    once, out of four; under bf16-mixed the shards, their gradients and AdamW states stay fp32.
    Sharded checkpoints (one file per rank) resume.

    And validation with an idle rank does not hang: ``debug=fast``'s pass@k check has 4 problems,
    one sampling chunk, all on rank 0. Under FSDP, transformers' ``generate`` defaults to
    ``synced_gpus`` (a collective per token), so rank 0 waited for a rank that never generated."""
    import json

    run = [
        "debug=fast", "trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2",
        "trainer.precision=bf16-mixed", "model.tiny.num_hidden_layers=4",
        "trainer.strategy.state_dict_type=sharded",
        "+callbacks.gather_probe={_target_: fsdp_probe.GatherProbe}",
    ]
    first = tmp_path / "first"
    out = train_in_subprocess(first, tmp_path / "cache", run, timeout_s=300)
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in out  # validated at step 0, no hang
    for rank in (0, 1):
        probe = json.loads((first / f"gather_probe_rank{rank}.json").read_text())
        units = probe["units"]
        layers = sorted(n for name, n in units.items() if name != "root")
        assert len(layers) == 4 and len(units) == 5  # four layer units and the root
        assert probe["samples"] > 0
        # at most the root and two layers at once, never the whole policy
        assert units["root"] + layers[-1] <= probe["max_gathered"] <= units["root"] + layers[-1] + layers[-2]
        assert probe["max_gathered"] < sum(units.values())
        assert probe["param_dtypes"] == probe["optim_state_dtypes"] == ["torch.float32"]
        assert probe["gathered_dtypes"] == ["torch.bfloat16"]  # computed in bf16 over the fp32 shards
    metrics = read_metrics(first)
    # scoring ran through the FSDP wrapper, as the update: its one update starts at ratio 1
    assert [metrics[s]["train/ppo_kl"] for s in (0, 1)] == [0.0, 0.0]
    ckpt = first / "checkpoints" / "last.ckpt"
    assert ckpt.is_dir() and len(list(ckpt.glob("*.distcp"))) == 2  # one shard file per rank
    second = tmp_path / "second"
    out = train_in_subprocess(second, tmp_path / "cache", [*run, "trainer.max_steps=3", f"ckpt_path={ckpt}"],
                              timeout_s=300)
    assert "Restored all states from the checkpoint" in out
    assert read_metrics(second).keys() >= {2}  # the resumed run trained step 2 (its third)
    # FSDP2 through torch.distributed.checkpoint: re-sharded on load, so one rank resumes two ranks'
    # checkpoint; and the checkpoint path warns of no deprecated API (FSDP1's state-dict types did)
    third = tmp_path / "third"
    one_rank = [*run[:3], "trainer.devices=1", *run[4:], "trainer.max_steps=3", f"ckpt_path={ckpt}"]
    out += train_in_subprocess(third, tmp_path / "cache", one_rank, timeout_s=300)
    assert "Restored all states from the checkpoint" in out
    assert read_metrics(third).keys() >= {2}
    assert not [line for line in out.splitlines() if "deprecat" in line.lower() and "checkpoint" in line.lower()]


def test_under_fsdp_scoring_and_the_update_compute_the_same_log_probs(tmp_path):
    """The scoring forward ran on the gathered fp32 weights (fp32 residual stream) while the update
    runs through FSDP with bf16 parameters, so the PPO ratio was off 1 before any update (ppo_kl
    3.5e-6 and -6.3e-5 on this run; 0.0165 mean log-prob gap on a toy model). Scoring now runs
    through the same FSDP module under the same autocast: at FSDP world size 1 with bf16-mixed,
    the step's one update (one mini-batch, one epoch) starts at ratio exactly 1."""
    run = ["debug=fast", "trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=1",
           "trainer.precision=bf16-mixed"]
    train_in_subprocess(tmp_path / "run", tmp_path / "cache", run, timeout_s=300)
    metrics = read_metrics(tmp_path / "run")
    assert [metrics[s]["train/ppo_kl"] for s in (0, 1)] == [0.0, 0.0]
    assert [metrics[s]["train/clipfrac"] for s in (0, 1)] == [0.0, 0.0]
    assert metrics[0]["train/meds/answer_found_rate"] >= 0  # the MEDS plug-in read the scoring forward


# Balanced ranks: DAPO's fill left every kept group of step 0 on rank 0 (rank 1 would have had none
# and skipped the step); the deal (step/balance.py) moves whole groups, and the 2-process DDP run
# is still one process's run: the same metrics, MEDS memory, R3 history and weights.
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
