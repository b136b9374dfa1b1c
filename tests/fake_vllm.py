"""A recording fake of the ``vllm.LLM`` API that ``VLLMRolloutEngine`` uses, for tests where vLLM
cannot run (no GPU, several gloo ranks): the engine's own code (sleep state, weight sync,
generate) runs against it and every call is recorded.

It keeps vLLM's contracts that matter here: ``collective_rpc`` runs the function in process on
the worker; the worker's ``reload_weights`` feeds the iterator to the model's ``load_weights``,
which returns the names it loaded; ``sleep`` / ``wake_up`` with the tags the executor tracks
(a sleep while already asleep does nothing, as vLLM's executor warns and returns).
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch


def install_vllm_stub() -> None:
    """A ``vllm`` module with only ``SamplingParams`` (what ``VLLMRolloutEngine.generate`` imports)."""
    if "vllm" in sys.modules:
        return
    stub = types.ModuleType("vllm")
    stub.SamplingParams = lambda **kwargs: SimpleNamespace(**kwargs)
    sys.modules["vllm"] = stub


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


@dataclass
class FakeLLM:
    model: FakeModel
    stop_id: int = 2
    calls: list[tuple] = field(default_factory=list)
    asleep: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        model = self.model
        self.worker = SimpleNamespace(
            model_runner=SimpleNamespace(get_model=lambda: model),
            reload_weights=lambda weights_iterator: model.load_weights(weights_iterator),
        )

    def collective_rpc(self, fn, args: tuple = ()) -> list[Any]:
        if getattr(fn, "__name__", "") == "_load_into_worker":
            self.calls.append(("load", "weights" in self.asleep))
        return [fn(self.worker, *args)]

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))
        if "weights" not in self.asleep:
            self.asleep |= {"weights", "kv_cache"}

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append(("wake_up", tuple(tags)))
        self.asleep -= set(tags)

    def reset_prefix_cache(self) -> bool:
        return True

    def generate(self, requests, sampling, use_tqdm: bool = False):
        """One stop token per request; records whether the trainer's autocast was on."""
        if self.asleep:
            raise RuntimeError(f"generate while {sorted(self.asleep)} asleep")
        self.calls.append(("generate", len(requests), torch.is_autocast_enabled("cpu")))
        step = {self.stop_id: SimpleNamespace(logprob=-0.5)}
        done = SimpleNamespace(token_ids=[self.stop_id], logprobs=[step], finish_reason="stop")
        return [SimpleNamespace(outputs=[done]) for _ in requests]
