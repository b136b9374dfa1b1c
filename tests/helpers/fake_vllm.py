"""A recording fake of the ``vllm.LLM`` API that ``VLLMRolloutEngine`` uses, for tests where vLLM
cannot run (no GPU, several gloo ranks): the engine's own code (sleep state, weight sync,
generate) runs against it and every call is recorded.

It keeps vLLM's contracts that matter here: ``collective_rpc`` runs the function in process on
the worker; the worker's ``reload_weights`` feeds the iterator to the model's ``load_weights``,
which returns the names it loaded. Sleep mode follows vLLM 0.32.0 step for step (file:line in
that release; the same lines at tag v0.32.0), and the fake records where each tagged part of the
memory is (:meth:`FakeLLM.resident`):

- ``LLM.sleep(level)`` (``vllm/entrypoints/llm.py:836-859``) -> ``EngineCore.sleep``
  (``vllm/v1/engine/core.py:959-995``): the scheduler is paused, requests aborted; level 0 stops
  there, level >= 1 goes on to ``Executor.sleep(level)``.
- ``Executor.sleep`` (``vllm/v1/executor/abstract.py:382-392``) returns at once, doing nothing,
  while ``"weights"`` is among its ``sleeping_tags`` (383-385), not while the KV cache alone sleeps;
  else every worker sleeps and ``sleeping_tags`` becomes ``{weights, kv_cache}`` (389). So after
  ``wake_up(["weights"])`` a sleep frees the weights; after ``wake_up(["kv_cache"])`` it keeps the
  KV cache. ``is_sleeping`` is ``bool(sleeping_tags)`` (378-380).
- The worker (``vllm/v1/worker/gpu_worker.py:294``, ``vllm/device_allocator/sleep_mode_backend.py:127-137``,
  ``vllm/device_allocator/cumem.py:233-298``) unmaps every allocation still mapped: the weights
  copied to the host at level 1, dropped at level 2; the KV cache dropped. One already asleep keeps
  its state (cumem.py:256-262).
- ``Executor.wake_up(tags)`` (abstract.py:394-417) does nothing when nothing sleeps (395-397) or
  when any tag asked for is not asleep (398-404); else the asked tags (all for ``None``) are mapped
  again (cumem.py:331-364: from the host copy, else with garbage) and leave ``sleeping_tags``.
- ``EngineCore.wake_up`` (core.py:997-1019) drops ``"scheduling"`` from the tags, returns whether
  nothing sleeps any more, and only then resumes the scheduler: until then a request is never
  scheduled (``LLM.generate`` would wait for ever; here it raises).
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

SLEEP_TAGS = frozenset(("weights", "kv_cache"))  # vllm/v1/executor/abstract.py:37
GPU, HOST, DROPPED = "gpu", "host", "dropped"  # where a tag's memory is: mapped, copied to the host, freed


def vllm_stub() -> types.ModuleType:
    """A ``vllm`` module with only ``SamplingParams`` (what ``VLLMRolloutEngine.generate`` imports)."""
    stub = types.ModuleType("vllm")
    stub.SamplingParams = lambda **kwargs: SimpleNamespace(**kwargs)
    return stub


def install_vllm_stub() -> None:
    """:func:`vllm_stub` as ``vllm`` for the rest of the process (a spawned rank's own)."""
    if "vllm" not in sys.modules:
        sys.modules["vllm"] = vllm_stub()


class FakeModel:
    """The engine's model: the parameter names it expects, and what each load brought."""

    def __init__(self, names: list[str], on_tensor=None) -> None:
        self.names = list(names)
        self.on_tensor = on_tensor  # called with (name, tensor) as each arrives
        self.loads: list[dict[str, torch.Tensor]] = []

    def named_parameters(self):
        return [(n, None) for n in self.names]

    def load_weights(self, weights) -> set[str]:
        got = {}
        for name, t in weights:
            if self.on_tensor is not None:
                self.on_tensor(name, t)
            got[name] = t
        self.loads.append(got)
        return set(got)


class FakeMemory:
    """The worker's sleep-mode allocator (cumem.py), one allocation per tag: where each is, and
    which hold garbage (mapped again after being dropped, or never loaded)."""

    def __init__(self) -> None:
        self.place = {tag: GPU for tag in sorted(SLEEP_TAGS)}
        self.garbage = {"weights"}  # load_format="dummy": random until the first sync

    def sleep(self, level: int) -> None:
        """Every mapped tag off the GPU: weights to the host at level 1; already asleep: unchanged."""
        offload = {"weights"} if level == 1 else set()  # sleep_mode_backend.py:134-137
        for tag, where in self.place.items():
            if where == GPU:
                self.place[tag] = HOST if tag in offload else DROPPED

    def wake_up(self, tags: list[str] | None) -> None:
        """Map the asked tags again (all for None); a dropped one comes back as garbage."""
        for tag, where in self.place.items():
            if where != GPU and (tags is None or tag in tags):
                if where == DROPPED:
                    self.garbage.add(tag)
                self.place[tag] = GPU


class FakeExecutor:
    """vLLM 0.32's ``Executor`` sleep state (abstract.py:378-417) over one worker's memory."""

    def __init__(self, memory: FakeMemory) -> None:
        self.memory = memory
        self.sleeping_tags: set[str] = set()
        self.warnings: list[str] = []  # what vLLM logs where it returns without acting

    @property
    def is_sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    def sleep(self, level: int) -> None:
        """Nothing while the weights sleep, whatever else is awake (abstract.py:383-385)."""
        if "weights" in self.sleeping_tags:
            self.warnings.append("Executor is already sleeping.")
            return
        self.memory.sleep(level)
        self.sleeping_tags |= SLEEP_TAGS

    def wake_up(self, tags: list[str] | None) -> None:
        """Nothing unless every tag asked for sleeps (abstract.py:395-404)."""
        if not self.is_sleeping:
            self.warnings.append("Executor is not sleeping.")
            return
        awake = [t for t in tags or [] if t not in self.sleeping_tags]
        if awake:
            self.warnings.append(f"Tag {awake[0]} is not in sleeping tags")
            return
        self.memory.wake_up(tags)
        self.sleeping_tags = self.sleeping_tags - set(tags) if tags else set()


@dataclass
class FakeLLM:
    model: FakeModel
    stop_id: int = 2
    calls: list[tuple] = field(default_factory=list)

    def __post_init__(self) -> None:
        model = self.model
        self.memory = FakeMemory()
        self.executor = FakeExecutor(self.memory)
        self.paused = False  # the engine core's scheduler
        self.worker = SimpleNamespace(
            model_runner=SimpleNamespace(get_model=lambda: model),
            reload_weights=lambda weights_iterator: model.load_weights(weights_iterator),
        )

    def resident(self) -> set[str]:
        """The tags whose memory is on the GPU now."""
        return {tag for tag, where in self.memory.place.items() if where == GPU}

    def collective_rpc(self, fn, args: tuple = ()) -> list[Any]:
        """A weight load needs the weights mapped (else the copy hits unmapped memory)."""
        if getattr(fn, "__name__", "") != "_load_into_worker":
            return [fn(self.worker, *args)]
        self.calls.append(("load", "weights" not in self.resident()))
        if "weights" not in self.resident():
            raise RuntimeError("loading into weights that sleep: unmapped GPU memory")
        out = [fn(self.worker, *args)]
        self.memory.garbage.discard("weights")
        return out

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """EngineCore.sleep: pause the scheduler; level >= 1 on to the executor (core.py:972-981)."""
        self.calls.append(("sleep", level))
        self.paused = True
        if level >= 1:
            self.executor.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """EngineCore.wake_up (core.py:997-1019): whether the engine is fully awake again."""
        self.calls.append(("wake_up", None if tags is None else tuple(tags)))
        if tags is not None:
            tags = [t for t in tags if t != "scheduling"]
        if tags is None or tags:
            self.executor.wake_up(tags)
        if not self.executor.is_sleeping:
            self.paused = False
        return not self.executor.is_sleeping

    def reset_prefix_cache(self) -> bool:
        return True

    def generate(self, requests, sampling, use_tqdm: bool = False):
        """One stop token per request; records whether the trainer's autocast was on. Refused
        where vLLM would never schedule the requests, or would sample from garbage weights."""
        if self.paused:
            raise RuntimeError(f"generate while paused ({sorted(self.executor.sleeping_tags)} asleep): "
                               "vLLM would never schedule the requests")
        if "weights" in self.memory.garbage:
            raise RuntimeError("generate from garbage weights (dropped or dummy, not loaded since)")
        self.calls.append(("generate", len(requests), torch.is_autocast_enabled("cpu")))
        step = {self.stop_id: SimpleNamespace(logprob=-0.5)}
        done = SimpleNamespace(token_ids=[self.stop_id], logprobs=[step], finish_reason="stop")
        return [SimpleNamespace(outputs=[done]) for _ in requests]
