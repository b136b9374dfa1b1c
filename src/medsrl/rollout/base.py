"""Rollout types shared by every generation backend, and the packing used by the policy update.

A packed row (:func:`pack_rollouts`; ``P`` = longest prompt, ``R`` = longest response)::

    [pad pad p0 p1 p2 | r0 r1 r2 pad pad]
     <---- P ------->   <----- R ----->

Every response starts at column ``P``; the logits that predict response token ``t`` are at
column ``P + t - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from medsrl.models.loading import stop_token_ids
from medsrl.utils.distributed import any_rank

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass(frozen=True)
class SamplingParams:
    """``temperature <= 0`` is greedy (``top_p`` ignored); ``logprobs`` never changes the samples."""

    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int | None = None
    logprobs: bool = False

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class RolloutBatch:
    """Generated responses, grouped by prompt in prompt order; ``response_ids`` keep the stop token.
    ``response_logprobs``: each token's log-prob after temperature and top-p, as it was drawn."""

    prompt_index: list[int]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    response_text: list[str]
    finish_reason: list[str]
    response_logprobs: list[list[float]] | None = None

    def __post_init__(self) -> None:
        n = len(self.prompt_index)
        bad = {k: len(getattr(self, k)) for k in self._row_fields() if len(getattr(self, k)) != n}
        if bad:
            raise ValueError(f"RolloutBatch fields disagree in length: prompt_index={n}, {bad}")
        if self.response_logprobs is not None:
            for i, (ids, lps) in enumerate(zip(self.response_ids, self.response_logprobs, strict=True)):
                if len(ids) != len(lps):
                    raise ValueError(f"RolloutBatch response {i}: {len(ids)} tokens but {len(lps)} log-probs")

    def _row_fields(self) -> list[str]:
        names = ["prompt_ids", "response_ids", "response_text", "finish_reason"]
        return names + ["response_logprobs"] if self.response_logprobs is not None else names

    @classmethod
    def empty(cls, logprobs: bool = False) -> RolloutBatch:
        return cls([], [], [], [], [], [] if logprobs else None)

    @classmethod
    def decoded(cls, tokenizer, prompt_ids: list[list[int]], order: list[int], responses: list[list[int]],
                finish: list[str], logprobs: list[list[float]] | None) -> RolloutBatch:
        """Every engine's responses in ``order``, decoded by our tokenizer (special tokens skipped)."""
        return cls(order, [list(prompt_ids[i]) for i in order], responses,
                   list(tokenizer.batch_decode(responses, skip_special_tokens=True)), finish, logprobs)

    def select(self, rows: list[int]) -> RolloutBatch:
        """The responses at ``rows``, numbered as one group (``prompt_index`` all 0)."""
        picked = {k: [getattr(self, k)[i] for i in rows] for k in self._row_fields()}
        return RolloutBatch(prompt_index=[0] * len(rows), **picked)

    @classmethod
    def concat_groups(cls, groups: list[RolloutBatch]) -> RolloutBatch:
        """Join single-group batches; log-probs are kept only when every batch has them."""
        with_lps = bool(groups) and all(b.response_logprobs is not None for b in groups)
        out = cls.empty(logprobs=with_lps)
        for g, b in enumerate(groups):
            out.prompt_index += [g] * len(b)
            for k in out._row_fields():
                getattr(out, k).extend(getattr(b, k))
        return out

    def __len__(self) -> int:
        return len(self.prompt_index)

    @property
    def truncated(self) -> list[bool]:
        return [r == FINISH_LENGTH for r in self.finish_reason]

    @property
    def response_lengths(self) -> list[int]:
        return [len(r) for r in self.response_ids]


@runtime_checkable
class RolloutEngine(Protocol):
    """A generation backend (``medsrl.rollout.factory``)."""

    uses_policy_weights: bool  # False: the engine holds its own copy (no FSDP gather around it)

    def generate(self, prompts: list[str], params: SamplingParams) -> RolloutBatch: ...

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push the current policy weights to the engine (no-op when it shares the module)."""

    def release(self) -> None:
        """Free what generation holds before the trainer's phases (vLLM: sleep; HF: nothing)."""

    @property
    def weights_released(self) -> bool:
        """Whether ``release`` dropped the weights: ``sync_weights`` must precede ``generate``."""


def sync_engine(engine: RolloutEngine, policy: torch.nn.Module, *, stale_only: bool = False) -> None:
    """Copy ``policy``'s weights into an engine that holds its own. ``stale_only``: only when some
    rank's engine dropped them: under FSDP the sync is a collective, so all ranks decide together."""
    if engine.uses_policy_weights:
        return
    if stale_only and not any_rank(engine.weights_released):
        return
    engine.sync_weights(policy)


def tokenize_prompts(tokenizer, prompts: list[str], n: int, engine: str) -> tuple[list[list[int]], list[int]]:
    """Each prompt's ids (special tokens as vLLM handles them) and the response order ``[0]*n + [1]*n ...``."""
    if isinstance(prompts, str):
        raise TypeError(f"{engine}.generate expects a list of prompt strings")
    prompt_ids = [list(ids) for ids in tokenizer(list(prompts))["input_ids"]] if prompts else []
    for i, ids in enumerate(prompt_ids):
        if not ids:
            raise ValueError(f"Prompt {i} tokenizes to no tokens")
    return prompt_ids, [i for i in range(len(prompt_ids)) for _ in range(n)]


def resolve_stop_ids(tokenizer, ids: list[int] | None, engine: str) -> list[int]:
    ids = stop_token_ids(tokenizer) if ids is None else ids
    if not ids:
        raise ValueError(f"{engine} needs at least one stop token id")
    return [int(i) for i in ids]


@dataclass
class PackedRollouts:
    """``input_ids``, ``attention_mask`` and ``position_ids`` ``[B, P + R]``; ``response_mask`` ``[B, R]``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    prompt_length: int

    @property
    def response_length(self) -> int:
        return self.response_mask.shape[1]

    @property
    def response_ids(self) -> torch.Tensor:
        """Right padding included: use ``response_mask``."""
        return self.input_ids[:, self.prompt_length :]

    @property
    def prompt_lengths(self) -> torch.Tensor:
        return self.attention_mask[:, : self.prompt_length].sum(dim=1)

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.attention_mask[:, self.prompt_length :].sum(dim=1)

    def columns_end(self, rows: slice | torch.Tensor) -> int:
        """One past the last column any of ``rows`` attends to (the rest is their right padding)."""
        lengths = self.response_lengths[rows]
        return self.prompt_length + (int(lengths.max()) if lengths.numel() else 0)

    def columns_start(self, rows: slice | torch.Tensor) -> int:
        """The first column any of ``rows`` attends to (with explicit position ids, a forward without
        the left padding before it is exact)."""
        mask = self.attention_mask[rows, : self.prompt_length]
        return int((mask.cumsum(dim=1) == 0).sum(dim=1).min()) if mask.numel() else 0

    def to(self, device: torch.device | str) -> PackedRollouts:
        tensors = (self.input_ids, self.attention_mask, self.position_ids, self.response_mask)
        return PackedRollouts(*(t.to(device) for t in tensors), self.prompt_length)


def pack_rollouts(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_token_id: int) -> PackedRollouts:
    """Every row counts positions from its first real token, exactly as when the sequence is run alone."""
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"pack_rollouts: {len(prompt_ids)} prompts but {len(response_ids)} responses")
    if not prompt_ids:
        raise ValueError("pack_rollouts: empty batch")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("pack_rollouts: every prompt needs at least one token")
    batch = len(prompt_ids)
    p_len = max(len(p) for p in prompt_ids)
    r_len = max(len(r) for r in response_ids)
    input_ids = torch.full((batch, p_len + r_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, p_len + r_len), dtype=torch.long)
    response_mask = torch.zeros((batch, r_len), dtype=torch.float32)
    for i, (prompt, response) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        start = p_len - len(prompt)
        input_ids[i, start:p_len] = torch.as_tensor(prompt, dtype=torch.long)
        attention_mask[i, start:p_len] = 1
        end = p_len + len(response)
        input_ids[i, p_len:end] = torch.as_tensor(response, dtype=torch.long)
        attention_mask[i, p_len:end] = 1
        response_mask[i, : len(response)] = 1.0
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return PackedRollouts(input_ids, attention_mask, position_ids, response_mask, p_len)
