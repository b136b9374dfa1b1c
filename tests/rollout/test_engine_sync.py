"""The vLLM engine's sleep state and weight syncs on 2 gloo ranks under FSDP, with the real
``VLLMRolloutEngine`` and ``rollout.base.sync_engine`` over a recording fake of ``vllm.LLM``
(``tests/helpers/fake_vllm.py``): vLLM itself cannot run here.

The fault (issue 35): after a mid-run validation that only rank 0 sampled (AIME24's 30 problems
are one chunk), ``release()`` slept only rank 0's engine (rank 1's KV cache was already asleep, so
it did nothing); on the next step only rank 0 found its weights stale and entered the weight sync,
a collective under FSDP, while rank 1 went on: mismatched collectives, a hang until the timeout.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from medsrl.rollout.base import SamplingParams, sync_engine

PARAMS = SamplingParams(n=2, max_new_tokens=4, seed=0, logprobs=True)


def _policy():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from medsrl.models.sharding import shard_policy
    from medsrl.models.tiny import build_tiny_model

    model = build_tiny_model(seed=0, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, intermediate_size=64)
    names = list(model.state_dict())
    strategy = SimpleNamespace(shard_mesh=init_device_mesh("cpu", (dist.get_world_size(),)),
                               mixed_precision_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy(),
                               reshard_after_forward=True, root_device=torch.device("cpu"))
    return shard_policy(model, strategy), names


def _steps(rank: int) -> dict:
    from fake_vllm import FakeLLM, FakeModel, install_vllm_stub
    from medsrl.models.char_tokenizer import build_char_tokenizer
    from medsrl.rollout.vllm import VLLMRolloutEngine

    install_vllm_stub()
    result: dict = {}
    policy, names = _policy()
    llm = FakeLLM(FakeModel(names))
    engine = VLLMRolloutEngine.around(llm, build_char_tokenizer(), sleep_mode=True, trainer_group=True,
                                      weight_dtype=torch.bfloat16)
    engine.sync_weights(policy)  # as at engine start
    prompts = ["1+1?", "2+2?"]

    def training_step() -> None:
        sync_engine(engine, policy, stale_only=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # training_step's own autocast
            engine.generate(prompts, PARAMS)
        engine.release()
        sync_engine(engine, policy)  # after the update

    training_step()
    # validation at the step's end: one sampling chunk, on rank 0 only
    sync_engine(engine, policy, stale_only=True)
    if rank == 0:
        engine.generate(prompts, PARAMS)
    engine.release()
    result["released_after_validation"] = engine.weights_released
    result["resident_after_validation"] = sorted(llm.resident())  # rank 1: synced, sampled nothing
    training_step()  # before the fix: rank 0 alone re-synced here and the ranks' collectives parted
    result["loads"] = len(llm.model.loads)
    result["calls"] = llm.calls
    result["loaded_into_sleeping_weights"] = any(c == ("load", True) for c in llm.calls)
    result["generated_under_autocast"] = any(c[0] == "generate" and c[2] for c in llm.calls)
    result["vllm_warnings"] = llm.executor.warnings  # a sleep or wake vLLM would have skipped
    with pytest.raises(RuntimeError, match="would destroy the default process group"):
        engine.close()
    result["close_refused"] = True
    # an engine parameter no policy weight maps to: the sync fails, naming it
    llm.model.names.append("model.layers.0.mlp.extra_weight")
    with pytest.raises(RuntimeError, match=r"no weight for 1 of its parameters \(model.layers.0.mlp.extra_weight\)"):
        engine.sync_weights(policy)
    result["missing_name_fails"] = True
    return result


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    from gloo_ranks import on_gloo_ranks

    return on_gloo_ranks(_steps, tmp_path_factory.mktemp("engine_sync"), timeout_s=45)


@pytest.mark.slow
def test_after_a_validation_one_rank_sampled_every_rank_sleeps_and_resyncs_together(ranks):
    a, b = ranks
    assert a["released_after_validation"] and b["released_after_validation"]
    assert a["resident_after_validation"] == b["resident_after_validation"] == []  # weights and KV cache freed
    assert a["vllm_warnings"] == b["vllm_warnings"] == []
    # start, after step 1's update, the stale resync before step 2, after step 2's update
    assert a["loads"] == b["loads"] == 4
    for r in ranks:
        assert not r["loaded_into_sleeping_weights"]  # every load after its wake
        sleeps = [c for c in r["calls"] if c[0] == "sleep"]
        assert sleeps == [["sleep", 2]] * 3  # step 1, validation, step 2: whatever was awake
    # the rank that did not sample in validation slept its awake weights all the same
    validation = b["calls"][b["calls"].index(["sleep", 2]) + 1:]
    assert validation[:3] == [["wake_up", ["weights"]], ["load", False], ["sleep", 2]]


@pytest.mark.slow
def test_generation_runs_outside_the_trainers_autocast(ranks):
    assert not any(r["generated_under_autocast"] for r in ranks)


@pytest.mark.slow
def test_closing_the_engine_is_refused_while_the_trainers_process_group_is_up(ranks):
    """vLLM's shutdown destroys the default process group: Lightning's, in a multi-rank run."""
    assert all(r["close_refused"] for r in ranks)


@pytest.mark.slow
def test_a_sync_that_leaves_an_engine_parameter_unloaded_fails(ranks):
    """vLLM only warns of such a parameter, and after a level-2 sleep it holds garbage."""
    assert all(r["missing_name_fails"] for r in ranks)
