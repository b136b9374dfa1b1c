"""Rollouts with Hugging Face ``model.generate`` on the training module itself.

Only our :class:`SamplingParams` sample: the model's own ``generation_config`` (real Qwen
checkpoints ship ``top_k``, ``repetition_penalty``, ...) is swapped for a complete one meanwhile.
With ``params.seed`` the chunk (``max_batch_size // n`` whole prompts) starting at prompt ``i``
draws after ``torch.manual_seed(seed + i)`` in a forked RNG: a rank taking prompts ``s..`` with
``seed + s`` (split at chunk boundaries) gets the responses of the unsplit call. ``generate`` runs a
caller's logits processors *before* its own warpers, so with ``params.logprobs`` temperature and
top-p run in :class:`_SampledTokenLogProbs`, the last processor, which sees the scores sampled from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedTokenizerBase,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from medsrl.rollout.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    PackedRollouts,
    RolloutBatch,
    SamplingParams,
    pack_rollouts,
    resolve_stop_ids,
    tokenize_prompts,
)
from medsrl.utils.guard import LIKELY_CAUSES, NONFINITE_SAMPLING, RunawayError


@contextlib.contextmanager
def _generating(model: torch.nn.Module, config: GenerationConfig) -> Iterator[None]:
    """Eval mode and ``config`` (none of the model's shipped defaults leak in), restored after."""
    flags = [(m, m.training) for m in model.modules()]
    previous = getattr(model, "generation_config", None)
    model.eval()
    model.generation_config = config
    try:
        yield
    finally:
        model.generation_config = previous
        for m, training in flags:
            m.training = training


class HFRolloutEngine:
    """``max_batch_size`` caps the sequences per call (a prompt with ``n`` above it takes one call)."""

    def __init__(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, *,
                 stop_token_ids: list[int] | None = None, max_batch_size: int = 64) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.stop_token_ids = resolve_stop_ids(tokenizer, stop_token_ids, "HFRolloutEngine")
        pad = tokenizer.pad_token_id
        self.pad_token_id: int = int(pad) if pad is not None else self.stop_token_ids[0]
        self.max_batch_size = max_batch_size

    uses_policy_weights = True  # generates with the training module
    weights_released = False  # nothing of its own to release

    def release(self) -> None:
        """Nothing is held between calls."""

    def sync_weights(self, model: torch.nn.Module) -> None:
        if model is not None:
            self.model = model

    def generation_config(self, params: SamplingParams) -> GenerationConfig:
        """Nothing left to model defaults; with ``params.logprobs`` the warpers run in :meth:`log_prob_recorder`."""
        common = dict(
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=0,
            num_beams=1,
            num_return_sequences=1,
            use_cache=True,
            eos_token_id=list(self.stop_token_ids),
            pad_token_id=self.pad_token_id,
            bos_token_id=None,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            length_penalty=1.0,
            return_dict_in_generate=False,
            output_scores=False,
            output_logits=False,
        )
        if params.greedy:
            return GenerationConfig(do_sample=False, **common)
        warp_here = not params.logprobs
        return GenerationConfig(
            do_sample=True,
            temperature=float(params.temperature) if warp_here else 1.0,
            top_p=float(params.top_p) if warp_here else 1.0,
            top_k=0,
            min_p=0.0,
            typical_p=1.0,
            epsilon_cutoff=0.0,
            eta_cutoff=0.0,
            **common,
        )

    def log_prob_recorder(self, params: SamplingParams) -> _SampledTokenLogProbs:
        warpers: list[LogitsProcessor] = []
        if not params.greedy:
            if params.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(float(params.temperature)))
            if params.top_p < 1.0:
                warpers.append(TopPLogitsWarper(top_p=float(params.top_p), min_tokens_to_keep=1))
        return _SampledTokenLogProbs(warpers)

    def generate(self, prompts: list[str], params: SamplingParams) -> RolloutBatch:
        prompt_ids, order = tokenize_prompts(self.tokenizer, prompts, params.n, "HFRolloutEngine")
        if not prompt_ids:
            return RolloutBatch.empty(params.logprobs)
        responses: list[list[int]] = []
        finish: list[str] = []
        logprobs: list[list[float]] | None = [] if params.logprobs else None

        model = self.model
        device = next(model.parameters()).device
        rng_devices = [device.index] if device.type == "cuda" else []
        config = self.generation_config(params)
        stop = set(self.stop_token_ids)
        with (
            torch.no_grad(),
            _generating(model, config),
            torch.random.fork_rng(devices=rng_devices, enabled=params.seed is not None),
        ):
            per_chunk = max(1, self.max_batch_size // params.n)
            for first in range(0, len(prompts), per_chunk):
                if params.seed is not None:
                    torch.manual_seed(params.seed + first)
                rows = order[first * params.n : (first + per_chunk) * params.n]
                chunk = [prompt_ids[i] for i in rows]
                packed = pack_rollouts(chunk, [[] for _ in chunk], self.pad_token_id).to(device)
                recorder = self.log_prob_recorder(params) if params.logprobs else None
                with _nonfinite_sampling_is_runaway():
                    out = model.generate(
                        input_ids=packed.input_ids,
                        attention_mask=packed.attention_mask,
                        generation_config=config,
                        logits_processor=LogitsProcessorList([recorder] if recorder else []),
                        past_key_values=_shared_prompt_cache(model, packed),
                        # whole weights here (FSDP: summoned by the caller): transformers' FSDP
                        # default would make a rank with fewer prompts than its peers hang them
                        synced_gpus=False,
                    )
                new_tokens = out[:, packed.prompt_length :]
                row_logprobs = recorder.finish(new_tokens) if recorder else None
                for r, row in enumerate(new_tokens.tolist()):
                    ids, reason = _trim(row, stop)
                    responses.append(ids)
                    finish.append(reason)
                    if row_logprobs is not None:
                        logprobs.append(row_logprobs[r][: len(ids)])
        return RolloutBatch.decoded(self.tokenizer, prompt_ids, order, responses, finish, logprobs)


@contextlib.contextmanager
def _nonfinite_sampling_is_runaway() -> Iterator[None]:
    """``torch.multinomial``'s error on inf/nan probabilities, caught rather than checked per token
    (a check would sync every token)."""
    try:
        yield
    except RuntimeError as e:
        if "probability tensor contains" not in str(e):
            raise
        raise RunawayError(f"{NONFINITE_SAMPLING}. {LIKELY_CAUSES}") from e


def _shared_prompt_cache(model: torch.nn.Module, prompts: PackedRollouts):
    """The prompts' KV cache (but the last token) computed once per run of equal rows and expanded:
    the prefill shrinks ``n``-fold (``docs/BENCHMARKS.md``). None when no row repeats."""
    input_ids, attention_mask = prompts.input_ids, prompts.attention_mask
    if input_ids.shape[1] < 2 or input_ids.shape[0] < 2:
        return None
    new = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    new[1:] = (input_ids[1:] != input_ids[:-1]).any(dim=1) | (attention_mask[1:] != attention_mask[:-1]).any(dim=1)
    if bool(new.all()):
        return None
    first, group = new.nonzero().squeeze(1), new.long().cumsum(0) - 1
    out = model(
        input_ids=input_ids[first, :-1], attention_mask=attention_mask[first, :-1],
        position_ids=prompts.position_ids[first, :-1], use_cache=True, logits_to_keep=1,
    )
    cache = out.past_key_values
    cache.reorder_cache(group)
    return cache


class _SampledTokenLogProbs(LogitsProcessor):
    """The last logits processor: applies ``warpers``, then keeps call ``t``'s log-softmax until call
    ``t + 1`` shows the token drawn (one ``[B]`` vector a step is stored, never ``[B, V]``)."""

    def __init__(self, warpers: list[LogitsProcessor]) -> None:
        self.warpers = warpers
        self.pending: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        if self.pending is not None:
            self._take(input_ids[:, -1])
        self.pending = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        self.steps.append(self.pending.gather(1, tokens[:, None].long()).squeeze(1))
        self.pending = None

    def finish(self, new_tokens: torch.Tensor) -> list[list[float]]:
        if self.pending is not None:
            self._take(new_tokens[:, -1])
        if len(self.steps) != new_tokens.shape[1]:
            raise RuntimeError(f"recorded {len(self.steps)} log-probs for {new_tokens.shape[1]} generated tokens")
        return torch.stack(self.steps, dim=1).tolist()


def _trim(row: list[int], stop: set[int]) -> tuple[list[int], str]:
    for pos, tok in enumerate(row):
        if tok in stop:
            return row[: pos + 1], FINISH_STOP
    return row, FINISH_LENGTH
