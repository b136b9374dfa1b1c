"""The plan's phases follow what a step, its weight sync and validation hold (issue 35).

Computed only: the holders a phase lists and their formulas, for an FSDP vLLM experiment
(qwen2.5-math-7b_meds, qwen3-8b_meds), a one-GPU one (qwen2.5-math-1.5b_meds), HF generation,
LoRA and validation on or off. What a CPU can measure of them is in test_gpu_bytes.py.
"""

from __future__ import annotations

import pytest

from medsrl.plan.gpu_bytes import GIB, MemoryPlan
from plans import phase_items, plan_of

SYNCS = ("first weight sync", "weight sync")
VALIDATION = ("validation sampling", "validation features")
STEP = ("first weight sync", "generation", "scoring", "update", "optimizer step", "weight sync")
# qwen2.5-math-7b's gate/up/down projections: the largest matrix LoRA adapts (18,944 x 3,584)
QWEN_7B_MLP = 18_944 * 3_584




def _names(plan: MemoryPlan) -> list[str]:
    return [p.name for p in plan.phases]


def test_fsdp_vllm_run_has_every_phase_with_its_holders():
    plan = plan_of("experiment=qwen2.5-math-7b_meds")
    size, run = plan.size, plan.run
    V, H = size.vocab_size, size.hidden_size
    assert _names(plan) == ["resume", *STEP, *VALIDATION, "milestone"]
    units = (size.root_params + 2 * size.layer_params) * 2  # root + 2 layers in bf16
    # scoring goes through the FSDP wrapper: units gathered in bf16, no whole policy, no weight cast
    scoring = phase_items(plan, "scoring")
    assert scoring["gathered units"] == units
    assert "policy gathered whole" not in scoring and "bf16 cast of a weight" not in scoring
    # the fused head's weight-gradient buffers (about 4 GiB at 7B)
    update = phase_items(plan, "update")
    assert update["head grad accumulator"] == V * H * 4
    assert update["head grad product"] == update["head grad cast"] == V * H * 2
    assert 3.9 * GIB < V * H * 8 < 4.1 * GIB
    # at train start: the whole engine reservation beside the streamed sync, no rollouts yet
    first = phase_items(plan, "first weight sync")
    assert first["vLLM engine"] == int(run.gpu_bytes * 0.45)
    # one parameter at a time, whole in bf16 (issue 43: FSDP1 gathered a unit in fp32)
    assert first["gathered parameter"] == size.largest_param * 2
    assert first["shard copies"] == 2 * -(-size.largest_param // run.shards) * 2
    assert first["engine-dtype copies"] == max(size.root_params, size.layer_params) * 2
    assert "rollout tensors" not in first and "LoRA merge" not in first
    # validation: vLLM samples from its own weights (awake), then a feature forward like scoring's
    sampling, features = phase_items(plan, "validation sampling"), phase_items(plan, "validation features")
    assert sampling["vLLM engine"] == first["vLLM engine"] and "policy gathered whole" not in sampling
    assert features["gathered units"] == units
    assert features["activations (no grad)"] == scoring["activations (no grad)"]  # same budget, same length
    assert "log-prob head chunk" not in features and "vLLM engine" not in features  # logits_to_keep=1; asleep
    assert not any("policy gathered whole" in phase_items(plan, p.name) for p in plan.phases)


def test_one_gpu_run_casts_weights_and_gathers_nothing():
    plan = plan_of("experiment=qwen2.5-math-1.5b_meds")
    size = plan.size
    V, H = size.vocab_size, size.hidden_size
    assert _names(plan) == ["resume", *STEP, *VALIDATION, "milestone"]
    for phase in plan.phases:
        items = phase_items(plan, phase.name)
        assert not {"gathered units", "gathered parameter", "policy gathered whole"} & set(items), phase.name
    for phase in ("scoring", "validation features"):  # autocast casts the fp32 weight of every op
        assert phase_items(plan, phase)["bf16 cast of a weight"] == V * H * 2
    update = phase_items(plan, "update")
    assert update["head grad accumulator"] == V * H * 4
    assert update["head grad product"] == V * H * 2
    assert "head grad cast" not in update  # fp32 master weight: the sum is returned as it is
    # nothing gathered; each fp32 tensor cast to the engine's bf16 (one unit's worth pending)
    sync = phase_items(plan, "weight sync")
    assert sync["engine-dtype copies"] == max(size.root_params, size.layer_params) * 2
    assert phase_items(plan, "first weight sync")["engine-dtype copies"] == sync["engine-dtype copies"]


@pytest.mark.parametrize(("experiment", "old_gib"), [("qwen2.5-math-7b_meds", 54.3), ("qwen3-8b_meds", 58.4)])
def test_streamed_weight_sync_is_far_below_the_whole_fp32_policy(experiment, old_gib):
    """Before issue 35 the sync gathered the whole fp32 policy (docs/GPU.md: 54.3 / 58.4 GiB);
    since issue 43 it gathers one parameter at a time in bf16, not an fp32 unit."""
    plan = plan_of(f"experiment={experiment}")
    size = plan.size
    unit = max(size.root_params, size.layer_params)
    for name in SYNCS:
        items = phase_items(plan, name)
        assert "policy gathered whole" not in items
        assert items["gathered parameter"] == size.largest_param * 2 < unit * 4
    sync = next(p for p in plan.phases if p.name == "weight sync")
    whole = size.params * 4
    sync_items = phase_items(plan, "weight sync")
    transient = sync_items["gathered parameter"] + sync_items["shard copies"] + sync_items["engine-dtype copies"]
    kept = sync.total - transient
    assert sync.total < kept + whole - 20 * GIB  # the old phase: the same holders and the whole policy
    assert sync.total / GIB < old_gib - 20


def test_validation_off_removes_its_phases():
    on = plan_of("experiment=qwen2.5-math-7b_meds")
    for off, also in ((plan_of("experiment=qwen2.5-math-7b_meds", "callbacks.pass_at_k.every_n_steps=0"), ()),
                      (plan_of("experiment=qwen2.5-math-7b_meds", "callbacks=none"), ("milestone",))):
        assert _names(off) == [n for n in _names(on) if n not in (*VALIDATION, *also)]
        assert not any("validation" in note for note in off.notes)
    no_features = plan_of("experiment=qwen2.5-math-7b_meds", "+callbacks.pass_at_k.features=null")
    assert [n for n in _names(no_features) if n in VALIDATION] == ["validation sampling"]


def test_hf_generation_gathers_the_whole_policy_in_generation_and_validation_sampling_only():
    plan = plan_of("experiment=qwen2.5-math-7b_meds", "rollout.backend=hf")
    size, run = plan.size, plan.run
    # no engine to sync
    assert _names(plan) == ["resume", "generation", "scoring", "update", "optimizer step", *VALIDATION, "milestone"]
    gathered = {p.name for p in plan.phases if "policy gathered whole" in phase_items(plan, p.name)}
    assert gathered == {"generation", "validation sampling"}
    for phase in gathered:  # the fp32 policy, cast per op under autocast
        items = phase_items(plan, phase)
        assert items["policy gathered whole"] == size.params * 4
        assert items["bf16 cast of a weight"] == size.vocab_size * size.hidden_size * 2
    # validation's chunk (batch_size 128 // n 4 problems) cut by the engine's rows per call (32 // 4)
    assert (run.val_generate_rows, run.generate_rows) == (32, 32)
    assert phase_items(plan, "validation sampling")["KV cache"] == phase_items(plan, "generation")["KV cache"]


def test_validation_sampling_uses_its_own_rows_and_length():
    plan = plan_of("experiment=qwen2.5-math-1.5b_meds", "rollout.backend=hf", "callbacks.pass_at_k.batch_size=16",
                 "+callbacks.pass_at_k.max_new_tokens=1024")
    run = plan.run
    assert (run.val_generate_rows, run.val_response_tokens) == (16, 1024)
    kv = phase_items(plan, "validation sampling")["KV cache"]
    per_row_token = plan.size.kv_bytes_per_token * 4  # fp32 K and V under autocast over fp32 weights
    assert kv == 16 * (run.prompt_tokens + 1024) * per_row_token * 29 // 28  # + one layer's copy


def test_lora_adds_one_modules_merge_and_drops_the_head_gradient():
    plan = plan_of("experiment=qwen2.5-math-7b_meds", "model.lora.r=16")  # bf16-mixed: a bf16 base
    size = plan.size
    assert size.lora_largest_matrix == QWEN_7B_MLP
    for name in SYNCS:
        items = phase_items(plan, name)
        # the fp32 delta, its bf16 cast and the bf16 merged sum
        assert items["LoRA merge"] == QWEN_7B_MLP * (4 + 2 + 2)
        assert items["gathered base weight"] == QWEN_7B_MLP * 2  # the bf16 base, merged alone
    assert not any(name.startswith("head grad") for name in phase_items(plan, "update"))  # the head is frozen
    fp32_base = plan_of("experiment=qwen2.5-math-7b_meds", "model.lora.r=16", "model.lora.base_dtype=float32")
    assert phase_items(fp32_base, "weight sync")["LoRA merge"] == 2 * QWEN_7B_MLP * 4  # delta and merged sum in fp32
    one_gpu = plan_of("experiment=qwen2.5-math-1.5b_meds", "model.lora.r=16", "model.lora.target_modules=[q_proj]",
                    "model.lora.base_dtype=float32")
    assert phase_items(one_gpu, "weight sync")["LoRA merge"] == 2 * 1536 * 1536 * 4  # q_proj only
