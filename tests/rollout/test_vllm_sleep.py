"""Sleep mode of the vLLM engine against vLLM 0.32.0's executor as ``tests/helpers/fake_vllm.py`` follows
it: first the fake's rules (each one a line of vLLM's source, quoted there), then
``VLLMRolloutEngine.release()`` on every path a rank takes in training and validation. After a
release nothing of the engine may stay on the GPU: at 7B its weights alone are 14 GiB that scoring
and the update are planned without (issue 43)."""

from __future__ import annotations

import sys

import pytest
import torch

from fake_vllm import DROPPED, HOST, SLEEP_TAGS, FakeLLM, FakeModel, vllm_stub
from medsrl.models.char_tokenizer import build_char_tokenizer
from medsrl.models.tiny import build_tiny_model
from medsrl.rollout.base import SamplingParams, sync_engine
from medsrl.rollout.vllm import VLLMRolloutEngine, _load_into_worker

PARAMS = SamplingParams(n=2, max_new_tokens=4, seed=0, logprobs=True)
PROMPTS = ["1+1?", "2+2?"]


def _loaded_llm() -> FakeLLM:
    """A fake engine, fully awake, its one weight loaded (through the engine's own worker call)."""
    llm = FakeLLM(FakeModel(["w"]))
    llm.collective_rpc(_load_into_worker, args=(iter([("w", torch.zeros(1))]),))
    return llm


def _generates(llm: FakeLLM) -> bool:
    """Whether the fake would serve a request now."""
    try:
        llm.generate([{"prompt_token_ids": [1]}], [None])
    except RuntimeError:
        return False
    return True


# --- the fake follows vLLM 0.32's executor ---------------------------------------------------


def test_a_sleep_with_only_the_kv_cache_asleep_frees_the_weights():
    """abstract.py:383: the sleep is skipped only while the *weights* sleep."""
    llm = _loaded_llm()
    llm.sleep(level=2)
    assert llm.resident() == set() and llm.executor.sleeping_tags == SLEEP_TAGS
    assert llm.wake_up(["weights"]) is False  # the KV cache still sleeps: not fully awake
    assert llm.resident() == {"weights"} and llm.executor.sleeping_tags == {"kv_cache"}
    llm.sleep(level=2)
    assert llm.resident() == set() and llm.executor.sleeping_tags == SLEEP_TAGS
    assert llm.executor.warnings == []


def test_a_sleep_with_the_weights_asleep_does_nothing_and_keeps_the_kv_cache():
    llm = _loaded_llm()
    llm.sleep(level=2)
    assert llm.wake_up(["kv_cache"]) is False
    llm.sleep(level=2)
    assert llm.resident() == {"kv_cache"}  # still mapped: the executor returned at once
    assert llm.executor.warnings == ["Executor is already sleeping."]


def test_a_wake_naming_a_tag_that_is_awake_does_nothing():
    """abstract.py:398-404: every tag asked for must sleep, or nothing wakes."""
    llm = _loaded_llm()
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    assert llm.wake_up(["weights", "kv_cache"]) is False
    assert llm.resident() == {"weights"} and llm.executor.warnings == ["Tag weights is not in sleeping tags"]
    assert llm.wake_up() is True and llm.resident() == SLEEP_TAGS  # None: everything


@pytest.mark.parametrize("level, place, garbage", [(1, HOST, False), (2, DROPPED, True)])
def test_level_1_keeps_the_weights_on_the_host_and_level_2_drops_them(level, place, garbage):
    llm = _loaded_llm()
    llm.sleep(level=level)
    assert llm.memory.place == {"weights": place, "kv_cache": DROPPED}
    assert llm.wake_up() is True
    assert _generates(llm) is not garbage  # dropped weights come back as garbage until a load


def test_requests_are_scheduled_only_once_fully_awake():
    """core.py:1016-1018: the scheduler resumes only when nothing sleeps any more."""
    llm = _loaded_llm()
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    llm.collective_rpc(_load_into_worker, args=(iter([("w", torch.zeros(1))]),))
    assert not _generates(llm)
    assert llm.wake_up(["kv_cache"]) is True and _generates(llm)
    llm.sleep(level=0)  # level 0 pauses the scheduler and frees nothing
    assert llm.resident() == SLEEP_TAGS and not _generates(llm)
    assert llm.wake_up(["scheduling"]) is True and _generates(llm)


def test_a_load_into_sleeping_weights_fails():
    llm = _loaded_llm()
    llm.sleep(level=2)
    with pytest.raises(RuntimeError, match="weights that sleep"):
        llm.collective_rpc(_load_into_worker, args=(iter([("w", torch.zeros(1))]),))


# --- VLLMRolloutEngine.release() over it -------------------------------------------------------


@pytest.fixture
def engine(monkeypatch):
    """A sleep-mode engine over the fake, synced once as at its start (fully awake), and its policy."""
    monkeypatch.setitem(sys.modules, "vllm", vllm_stub())  # this process only: no stub left behind
    policy = build_tiny_model(seed=0, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=1, intermediate_size=64)
    llm = FakeLLM(FakeModel(list(policy.state_dict())))
    engine = VLLMRolloutEngine.around(llm, build_char_tokenizer(), sleep_mode=True)
    engine.sync_weights(policy)
    return engine, policy


def _fresh(engine, policy) -> None:
    """The engine as built: weights synced, everything awake."""


def _after_a_release(engine, policy) -> None:
    engine.release()


def _a_training_step(engine, policy) -> None:
    engine.release()
    sync_engine(engine, policy, stale_only=True)
    engine.generate(PROMPTS, PARAMS)


def _synced_only(engine, policy) -> None:
    """The weights woken and loaded, the KV cache asleep: after a step's closing sync."""
    engine.release()
    sync_engine(engine, policy)


def _validation_sampling_nothing(engine, policy) -> None:
    """A rank whose share of the validation problems is empty, after the step's closing sync."""
    engine.release()
    sync_engine(engine, policy)
    sync_engine(engine, policy, stale_only=True)
    engine.generate([], PARAMS)


def _a_refused_generate(engine, policy) -> None:
    engine.release()
    with pytest.raises(RuntimeError, match="released"):
        engine.generate(PROMPTS, PARAMS)


@pytest.mark.parametrize("path", [_fresh, _after_a_release, _a_training_step, _synced_only,
                                  _validation_sampling_nothing, _a_refused_generate])
def test_after_a_release_nothing_of_the_engine_stays_on_the_gpu(engine, path):
    engine, policy = engine
    path(engine, policy)
    engine.release()
    engine.release()  # a second one changes nothing
    llm = engine.llm
    assert llm.resident() == set() and engine.weights_released
    assert llm.executor.warnings == []  # no sleep or wake that vLLM would skip
    sync_engine(engine, policy, stale_only=True)  # and the next step samples from loaded weights
    assert len(engine.generate(PROMPTS, PARAMS)) == len(PROMPTS) * PARAMS.n


def test_a_sleep_state_changed_behind_the_engine_fails_the_next_wake(engine):
    """vLLM's answer to a wake is checked: put to sleep directly after a sync, the engine would
    wake only the KV cache for sampling, and its requests would never be scheduled."""
    engine, policy = engine
    engine.release()
    engine.sync_weights(policy)
    engine.llm.sleep(level=2)
    with pytest.raises(RuntimeError, match="sleep state differs"):
        engine.generate(PROMPTS, PARAMS)
