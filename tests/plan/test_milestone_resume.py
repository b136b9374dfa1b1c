"""The plan's milestone and resume phases (issue 43), and LoRA's bf16 base, computed only.

The bf16 milestones used to gather the whole fp32 policy on every rank with vLLM's weights
awake, plus a bf16 copy on rank 0's GPU: about 73.5 GiB at 8B against 71.6 GiB usable. They now
release the engine and make one parameter whole at a time; a resume loads the sharded checkpoint
in place beside the engine just built. Every shipped GPU experiment must fit both, under the
trainer it documents (FSDP on 8 GPUs for 7B / 8B, one GPU for the others).
"""

from __future__ import annotations

import pytest

from medsrl.plan.gpu_bytes import GIB, MemoryPlan
from plans import phase_items, plan_of
from run_helpers import ROOT

GPU_MODELS = ("qwen2.5-math-1.5b_", "qwen2.5-math-7b_", "qwen3-1.7b_", "qwen3-8b_", "r1-distill-")
# the experiments sharded over 8 GPUs (docs/SCALING.md); the others run on one
FSDP_MODELS = ("qwen2.5-math-7b_", "qwen3-8b_")


def gpu_experiments() -> list[str]:
    """The shipped GPU experiments (tests/plan/test_cli.py counts 10 by their trainer)."""
    return sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("*.yaml") if p.stem.startswith(GPU_MODELS))




def _total(plan: MemoryPlan, phase: str) -> int:
    return sum(phase_items(plan, phase).values())


def _milestone_before_issue_43(plan: MemoryPlan) -> int:
    """The old save: what the milestone still holds (shards, runtime, the step's rollout tensors),
    vLLM's woken weights, the whole policy gathered in the master dtype on every rank and rank 0's
    state dict cast to the milestone's dtype on the GPU."""
    size, run = plan.size, plan.run
    held = sum(b for name, b in phase_items(plan, "milestone").items()
               if name in ("weights", "AdamW moments", "runtime", "rollout tensors"))
    return (held + size.params * run.vllm_weight_bytes + size.params * run.master_bytes
            + size.params * run.milestone_bytes)


@pytest.mark.parametrize("name", gpu_experiments())
def test_every_gpu_experiment_fits_its_milestone_and_resume_under_its_trainer(name):
    plan = plan_of(f"experiment={name}")
    run = plan.run
    assert len(gpu_experiments()) == 10 and run.on_gpu
    # the documented trainer: FSDP on 8 GPUs, or one GPU
    assert (run.sharded, run.devices) == ((True, 8) if name.startswith(FSDP_MODELS) else (False, 1))
    names = [p.name for p in plan.phases]
    assert names[0] == "resume" and names[-1] == "milestone", names  # every 50 steps in every GPU experiment
    for phase in plan.phases:
        assert phase.total <= plan.usable_bytes, (name, phase.name, phase.total / GIB)
    assert plan.fits


@pytest.mark.parametrize(("experiment", "old_gib"), [("qwen2.5-math-7b_meds", 68.5), ("qwen3-8b_meds", 73.6)])
def test_the_milestone_releases_the_engine_and_gathers_one_parameter(experiment, old_gib):
    plan = plan_of(f"experiment={experiment}")
    size = plan.size
    assert size.largest_param == size.vocab_size * size.hidden_size  # the embedding (or the LM head)
    items = phase_items(plan, "milestone")
    assert items["gathered parameter"] == size.largest_param * 2  # bf16, whole on every rank
    assert items["shard copies"] == 2 * -(-size.largest_param // 8) * 2
    assert not {"vLLM engine", "vLLM weights (woken)", "gradients", "policy gathered whole"} & set(items)
    old = _milestone_before_issue_43(plan)
    assert round(old / GIB, 1) == old_gib  # the issue's figure at 8B: about 73.5 GiB
    assert (old > plan.usable_bytes) == (experiment == "qwen3-8b_meds")  # 8B did not fit
    assert _total(plan, "milestone") < old - 50 * GIB


def test_a_one_gpu_milestone_casts_the_state_dict_and_an_engine_without_sleep_stays():
    plan = plan_of("experiment=qwen2.5-math-1.5b_meds")
    size = plan.size
    assert phase_items(plan, "milestone")["state dict cast"] == size.params * 2  # save_policy: fp32 -> bf16 on the GPU
    awake = plan_of("experiment=qwen2.5-math-1.5b_meds", "rollout.vllm.enable_sleep_mode=false")
    assert phase_items(awake, "milestone")["vLLM engine"] == phase_items(awake, "generation")["vLLM engine"]
    fp32 = plan_of("experiment=qwen2.5-math-1.5b_meds", "callbacks.milestones.dtype=float32")
    assert "state dict cast" not in phase_items(fp32, "milestone")  # saved as it is
    off = plan_of("experiment=qwen2.5-math-1.5b_meds", "callbacks.milestones.every_n_steps=0")
    assert "milestone" not in [p.name for p in off.phases]
    assert not any("milestone" in note for note in off.notes)


def test_a_sharded_resume_makes_the_adamw_states_beside_the_engine_just_built():
    plan = plan_of("experiment=qwen3-8b_meds")
    size = plan.size
    resume = phase_items(plan, "resume")
    assert resume["vLLM engine"] == phase_items(plan, "first weight sync")["vLLM engine"]  # awake whole
    assert resume["zero gradients"] == resume["AdamW temporaries"] == size.params * 4 // 8
    assert resume["checkpoint reads"] == 0  # host memory, copied into the shards in place
    assert "rollout tensors" not in resume
    one_gpu = phase_items(plan_of("experiment=qwen2.5-math-1.5b_meds"), "resume")
    assert "zero gradients" not in one_gpu and "AdamW temporaries" not in one_gpu  # Lightning's load


@pytest.mark.parametrize("experiment", ["qwen3-8b_meds", "qwen2.5-math-1.5b_meds"])
def test_no_phase_but_the_update_and_the_optimizer_step_holds_the_steps_gradients(experiment):
    """Gradients are set to None after each optimizer step (FSDP2: zero_grad frees them)."""
    plan = plan_of(f"experiment={experiment}")
    with_grads = {p.name for p in plan.phases if "gradients" in phase_items(plan, p.name)}
    assert with_grads == {"update", "optimizer step"}


def test_a_lora_plan_holds_its_base_in_bf16_under_bf16_mixed_and_fp32_when_asked():
    plan = plan_of("experiment=qwen2.5-math-7b_meds", "model.lora.r=16")
    size, run = plan.size, plan.run
    assert (run.master_bytes, run.weight_bytes, run.autocast) == (4, 2, False)
    items = phase_items(plan, "update")
    assert items["weights"] == size.params * 2 // 8
    assert items["adapter weights"] == size.trainable_params * 4 // 8
    assert phase_items(plan, "milestone")["gathered base weight"] == size.lora_largest_matrix * 2  # merged alone
    fp32 = plan_of("experiment=qwen2.5-math-7b_meds", "model.lora.r=16", "model.lora.base_dtype=float32")
    assert phase_items(fp32, "update")["weights"] == size.params * 4 // 8
    assert fp32.peak.total > plan.peak.total
    # one GPU: a bf16 base is not cast per op, an fp32 one is
    one_gpu = plan_of("experiment=qwen2.5-math-1.5b_meds", "model.lora.r=16")
    assert "bf16 cast of a weight" not in phase_items(one_gpu, "scoring")
    one_fp32 = plan_of("experiment=qwen2.5-math-1.5b_meds", "model.lora.r=16", "model.lora.base_dtype=float32")
    assert "bf16 cast of a weight" in phase_items(one_fp32, "scoring")
    assert phase_items(one_gpu, "scoring")["weights"] * 2 == phase_items(one_fp32, "scoring")["weights"]
