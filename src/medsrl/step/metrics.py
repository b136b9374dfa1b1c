"""What a step logs about itself: phase times, rollout statistics, the mean over ranks."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Iterable
from contextlib import contextmanager

import torch

from medsrl.algo import advantage_change_fraction, compute_advantages
from medsrl.step.rollouts import Group, StepRollouts
from medsrl.utils.distributed import all_reduce_sum


class PhaseTimer:
    """Wall time per phase of a step (summed over its runs); on CUDA also the allocator's peak and
    the device's use at its end (vLLM's included), the largest over its runs. Phases may nest."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.times: dict[str, float] = {}
        self.peak_bytes: dict[str, int] = {}
        self.device_bytes: dict[str, int] = {}
        self._cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self._running: list[int] = []  # per open phase: the allocator peak before an inner phase reset it

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        if self._cuda:
            if self._running:
                self._running[-1] = max(self._running[-1], torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
            self._running.append(0)
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start
            if self._cuda:
                peak = max(self._running.pop(), torch.cuda.max_memory_allocated())
                free, total = torch.cuda.mem_get_info()
                self.peak_bytes[name] = max(self.peak_bytes.get(name, 0), peak)
                self.device_bytes[name] = max(self.device_bytes.get(name, 0), total - free)
                if self._running:
                    self._running[-1] = max(self._running[-1], peak)

    def as_metrics(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self.times.items()}
        out["time/step"] = time.perf_counter() - self.t0
        out.update({f"memory/{k}_peak_gib": v / 2**30 for k, v in self.peak_bytes.items()})
        out.update({f"memory/{k}_device_gib": v / 2**30 for k, v in self.device_bytes.items()})
        return out


class PromptVisits:
    """How many times each prompt key was sampled; every rank counts the whole step's prompts."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._step: set[str] = set()

    def begin_step(self) -> None:
        self._step = set()

    def add(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        self.counts.update(keys)
        self._step.update(keys)

    def metrics(self) -> dict[str, float]:
        """The mean visits so far of the step's prompts (this step included), and distinct prompts."""
        mean = sum(self.counts[k] for k in self._step) / len(self._step) if self._step else 0.0
        return {"data/visits_mean": float(mean), "data/prompts_seen": float(len(self.counts))}

    def state_dict(self) -> dict[str, int]:
        return dict(self.counts)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.counts = Counter(state)


def shaping_metrics(algo, inputs, rollouts: StepRollouts, advantages: torch.Tensor) -> dict[str, float]:
    """``shaping/adv_change_frac``: the share of the policy-gradient signal that shaping rewrote."""
    unshaped = dataclasses.replace(inputs, scores=rollouts.reward, terms=rollouts.unshaped_terms())
    base = compute_advantages(algo.advantage, unshaped, **algo.advantage_options)
    return {"shaping/adv_change_frac": advantage_change_fraction(advantages, base, rollouts.packed.response_mask)}


def zero_spread_group_frac(groups: list[Group]) -> float:
    """The share of the step's groups (all ranks) whose rows all have the same accuracy."""
    zero = sum(not g.has_spread for g in groups)
    return all_reduce_sum(float(zero)) / max(all_reduce_sum(float(len(groups))), 1.0)


def mean_over_ranks(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Each metric averaged over the ranks that report it (shards are near-equal in size)."""
    keys = dict.fromkeys(k for m in per_rank for k in m)
    out = {}
    for k in keys:
        vals = [m[k] for m in per_rank if m.get(k) is not None]
        out[k] = sum(vals) / len(vals) if vals else None
    return out


def rollout_metrics(r: StepRollouts, grader_stats: dict) -> dict[str, float]:
    """Reward, accuracy, lengths and grader counts of the rows trained on."""
    lengths = r.packed.response_mask.sum(-1).float()
    truncated = torch.tensor([f == "length" for f in r.finish_reason], dtype=torch.float32)
    no_box = torch.tensor([not g.has_box for g in r.grades], dtype=torch.float32)
    return {
        "reward": float(r.reward.mean()),
        "acc": float(r.acc.mean()),
        "score": float(r.scores.mean()),
        "response_length": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        "truncation_rate": float(truncated.mean()),
        "no_box_rate": float(no_box.mean()),
        "num_responses": float(len(r)),
        "num_tokens": float(r.packed.prompt_lengths.sum() + lengths.sum()),  # real prompt + response tokens
        "num_groups": float(len(r.prompts)),
        "grader/timeouts_step": float(sum(g.timed_out for g in r.grades)),
        "grader/errors_step": float(sum(g.error is not None for g in r.grades)),
        "grader/timeouts_total": float(grader_stats.get("timeouts", 0)),
        # grader.reasoning_end set: responses that never closed their reasoning (no answer, 0)
        "grader/unclosed_reasoning_rate": float(sum(g.unclosed_reasoning for g in r.grades)) / max(1, len(r)),
    }
