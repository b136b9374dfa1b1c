"""Rollout types shared by every generation backend, and the packing used by the policy update.

A rollout engine turns a list of prompt strings into ``n`` sampled responses per prompt
(:class:`RolloutBatch`). The training step then packs prompt and response ids into one padded
batch (:func:`pack_rollouts`) and reads the per-token log-probs of the responses from a single
forward pass (``medsrl.step.scoring.response_logits``).

Layout of a packed row (``P`` = longest prompt, ``R`` = longest response)::

    [pad pad p0 p1 p2 | r0 r1 r2 pad pad]
     <---- P ------->   <----- R ----->

Prompts are left-padded and responses right-padded, so every response starts at column ``P``.
The logits that predict response token ``t`` are at column ``P + t - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: ``n`` responses per prompt, at most ``max_new_tokens`` tokens each.

    ``temperature <= 0`` means greedy decoding (``top_p`` is then ignored). ``seed`` makes a
    ``generate`` call reproducible for the same prompts, params and engine settings.
    ``logprobs`` asks for :attr:`RolloutBatch.response_logprobs`; it never changes the samples.
    """

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
            raise ValueError(
                f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class RolloutBatch:
    """Generated responses, one entry per response.

    Responses are grouped by prompt, in prompt order: prompt 0 repeated ``n`` times, then prompt
    1 ``n`` times, and so on. ``response_ids`` holds the generated ids with the stop token kept
    (when one was produced) and no padding; ``response_text`` is decoded with special tokens
    skipped; ``finish_reason`` is ``"stop"`` when a stop token was produced, ``"length"`` when
    ``max_new_tokens`` ran out first.

    ``response_logprobs`` (only when :attr:`SamplingParams.logprobs` asked for it) holds, for
    every response token, its log-prob under the distribution it was drawn from: the policy's
    at the sampling temperature, renormalised over the top-p nucleus (plain log-softmax when
    greedy). This is vLLM's ``processed_logprobs``.
    """

    prompt_index: list[int]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    response_text: list[str]
    finish_reason: list[str]
    response_logprobs: list[list[float]] | None = None

    def __post_init__(self) -> None:
        n = len(self.prompt_index)
        lengths = {
            "prompt_ids": len(self.prompt_ids),
            "response_ids": len(self.response_ids),
            "response_text": len(self.response_text),
            "finish_reason": len(self.finish_reason),
        }
        if self.response_logprobs is not None:
            lengths["response_logprobs"] = len(self.response_logprobs)
        bad = {k: v for k, v in lengths.items() if v != n}
        if bad:
            raise ValueError(f"RolloutBatch fields disagree in length: prompt_index={n}, {bad}")
        if self.response_logprobs is not None:
            for i, (ids, lps) in enumerate(zip(self.response_ids, self.response_logprobs, strict=True)):
                if len(ids) != len(lps):
                    raise ValueError(
                        f"RolloutBatch response {i}: {len(ids)} tokens but {len(lps)} log-probs"
                    )

    @classmethod
    def empty(cls, logprobs: bool = False) -> RolloutBatch:
        return cls([], [], [], [], [], [] if logprobs else None)

    def select(self, rows: list[int]) -> RolloutBatch:
        """The responses at ``rows``, numbered as one group (``prompt_index`` all 0)."""
        lps = self.response_logprobs
        return RolloutBatch(
            prompt_index=[0] * len(rows),
            prompt_ids=[self.prompt_ids[i] for i in rows],
            response_ids=[self.response_ids[i] for i in rows],
            response_text=[self.response_text[i] for i in rows],
            finish_reason=[self.finish_reason[i] for i in rows],
            response_logprobs=None if lps is None else [lps[i] for i in rows],
        )

    @classmethod
    def concat_groups(cls, groups: list[RolloutBatch]) -> RolloutBatch:
        """Join single-group batches; group ``g`` becomes ``prompt_index`` g. Log-probs are kept
        only when every batch has them."""
        with_lps = bool(groups) and all(b.response_logprobs is not None for b in groups)
        out = cls.empty(logprobs=with_lps)
        for g, b in enumerate(groups):
            out.prompt_index += [g] * len(b)
            out.prompt_ids += b.prompt_ids
            out.response_ids += b.response_ids
            out.response_text += b.response_text
            out.finish_reason += b.finish_reason
            if with_lps:
                out.response_logprobs += b.response_logprobs
        return out

    def __len__(self) -> int:
        return len(self.prompt_index)

    @property
    def truncated(self) -> list[bool]:
        """True for responses cut off by ``max_new_tokens`` (no stop token)."""
        return [r == FINISH_LENGTH for r in self.finish_reason]

    @property
    def response_lengths(self) -> list[int]:
        return [len(r) for r in self.response_ids]


@runtime_checkable
class RolloutEngine(Protocol):
    """A generation backend (Hugging Face ``generate`` or vLLM; see ``medsrl.rollout.factory``)."""

    # True: generation runs the policy module itself (under FSDP its weights are gathered around
    # it); False: the engine holds its own copy (vLLM)
    uses_policy_weights: bool

    def generate(self, prompts: list[str], params: SamplingParams) -> RolloutBatch: ...

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push the current policy weights to the engine (no-op when it shares the module)."""
        ...

    def release(self) -> None:
        """Free what generation holds before the trainer's phases (vLLM: sleep; HF: nothing)."""
        ...

    @property
    def weights_released(self) -> bool:
        """Whether ``release`` dropped the engine's weights, so that ``sync_weights`` must come
        before the next ``generate``."""
        ...


def tokenize_prompts(tokenizer, prompts: list[str], n: int, engine: str) -> tuple[list[list[int]], list[int]]:
    """The checks and tokenization every engine's ``generate`` starts with.

    Returns each prompt's ids (the tokenizer's default special-token handling, as vLLM's) and
    the response order, ``n`` per prompt grouped by prompt (``[0]*n + [1]*n + ...``). A bare
    string or a prompt that tokenizes to nothing is refused, naming the prompt.
    """
    if isinstance(prompts, str):
        raise TypeError(f"{engine}.generate expects a list of prompt strings")
    prompt_ids = [list(ids) for ids in tokenizer(list(prompts))["input_ids"]] if prompts else []
    for i, ids in enumerate(prompt_ids):
        if not ids:
            raise ValueError(f"Prompt {i} tokenizes to no tokens")
    return prompt_ids, [i for i in range(len(prompt_ids)) for _ in range(n)]


@dataclass
class PackedRollouts:
    """A padded batch of prompt + response ids ready for one forward pass.

    ``input_ids``, ``attention_mask`` and ``position_ids`` are ``[B, P + R]`` (long);
    ``response_mask`` is ``[B, R]`` (float), 1 on real response tokens including the stop token.
    """

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
        """``[B, R]`` response ids (right padding included; use ``response_mask``)."""
        return self.input_ids[:, self.prompt_length :]

    @property
    def prompt_lengths(self) -> torch.Tensor:
        """``[B]`` real prompt tokens per row (long)."""
        return self.attention_mask[:, : self.prompt_length].sum(dim=1)

    @property
    def response_lengths(self) -> torch.Tensor:
        """``[B]`` real response tokens per row (long)."""
        return self.attention_mask[:, self.prompt_length :].sum(dim=1)

    def columns_end(self, rows: slice | torch.Tensor) -> int:
        """One past the last column any of ``rows`` attends to: the prompt width plus their
        longest response. The columns after it are right padding for all of them."""
        lengths = self.response_lengths[rows]
        return self.prompt_length + (int(lengths.max()) if lengths.numel() else 0)

    def to(self, device: torch.device | str) -> PackedRollouts:
        return PackedRollouts(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            position_ids=self.position_ids.to(device),
            response_mask=self.response_mask.to(device),
            prompt_length=self.prompt_length,
        )


def pack_rollouts(
    prompt_ids: list[list[int]], response_ids: list[list[int]], pad_token_id: int
) -> PackedRollouts:
    """Pack prompts (left-padded to the longest, ``P``) and responses (right-padded, ``R``).

    ``position_ids = cumsum(attention_mask) - 1`` clamped at 0, so every row counts positions
    from its first real token, exactly as when the sequence is run alone. The log-prob of response
    token ``t`` is read from the logits at column ``P + t - 1``.
    """
    if len(prompt_ids) != len(response_ids):
        raise ValueError(
            f"pack_rollouts: {len(prompt_ids)} prompts but {len(response_ids)} responses"
        )
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
        if response:
            end = p_len + len(response)
            input_ids[i, p_len:end] = torch.as_tensor(response, dtype=torch.long)
            attention_mask[i, p_len:end] = 1
            response_mask[i, : len(response)] = 1.0
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return PackedRollouts(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_mask=response_mask,
        prompt_length=p_len,
    )
