"""Rollouts with Hugging Face ``model.generate`` on the training module itself.

The engine shares the policy module with the trainer, so ``sync_weights`` is a no-op. It
generates in eval mode under ``torch.no_grad`` with the KV cache and restores every submodule's
train/eval flag afterwards.

Our :class:`SamplingParams` are the only sampling settings used: the model's own
``generation_config`` (real Qwen checkpoints ship ``top_k``, ``repetition_penalty``, ...) is
swapped for a clean one for the duration of the call, in which ``top_k=0``, ``min_p``/``typical_p``
etc. are neutral.

Seeding: prompts are generated in chunks of whole prompts (``max_batch_size // n`` prompts, at
least one). With ``params.seed`` set, the call runs inside ``torch.random.fork_rng`` and the chunk
whose first prompt is prompt ``i`` of the call is drawn after ``torch.manual_seed(seed + i)``. So a
call is reproducible for the same prompts, params, model and ``max_batch_size`` (on GPU up to
kernel non-determinism), it leaves the global RNG stream of the caller untouched, and a caller
that splits its prompts at chunk boundaries (a rank of a distributed run taking prompts
``s..s+k-1`` with ``seed + s``) gets exactly the responses of the unsplit call. Without a seed,
sampling draws from the global RNG.

Sampling log-probs (``params.logprobs``): ``generate`` applies a caller's logits processors
*before* its own temperature / top-p warpers, and sampling happens after the last one. So when
log-probs are asked for, temperature and top-p leave the generation config and run, as the same
transformers warpers, inside :class:`_SampledTokenLogProbs`, which is then the last processor: it
sees exactly the scores that are sampled from, and reads the sampled token's log-prob at the next
call (or after ``generate`` for the last token). The samples are bit-identical either way.
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

from medsrl.models.loading import stop_token_ids as default_stop_token_ids
from medsrl.rollout.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    RolloutBatch,
    SamplingParams,
    tokenize_prompts,
)
from medsrl.utils.guard import LIKELY_CAUSES, NONFINITE_SAMPLING, RunawayError


def _model_device(model: torch.nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover - parameterless module
        return torch.device("cpu")


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode inside, each submodule's previous ``training`` flag restored after."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in flags:
            m.training = training


@contextlib.contextmanager
def _swapped_generation_config(model: torch.nn.Module, config: GenerationConfig) -> Iterator[None]:
    """Make ``config`` the model's generation config so none of its shipped defaults leak in."""
    previous = getattr(model, "generation_config", None)
    model.generation_config = config
    try:
        yield
    finally:
        model.generation_config = previous


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    if seed is None:
        yield
        return
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        rng = torch.random.fork_rng(devices=[index], device_type="cuda")
    else:
        rng = torch.random.fork_rng(devices=[])
    with rng:
        torch.manual_seed(seed)
        yield


class HFRolloutEngine:
    """A :class:`~medsrl.rollout.base.RolloutEngine` backed by ``model.generate``.

    ``stop_token_ids`` defaults to the ids of ``<|im_end|>``, ``<|endoftext|>`` and the eos token
    that exist in the tokenizer. ``max_batch_size`` caps the number of sequences per ``generate``
    call (each prompt is repeated ``n`` times, so one call holds ``max_batch_size // n`` prompts;
    a single prompt with ``n > max_batch_size`` is generated in one call of ``n``).
    Prompts are tokenized with the tokenizer's default special-token handling (as vLLM does).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        *,
        stop_token_ids: list[int] | None = None,
        max_batch_size: int = 64,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        ids = default_stop_token_ids(tokenizer) if stop_token_ids is None else list(stop_token_ids)
        if not ids:
            raise ValueError("HFRolloutEngine needs at least one stop token id")
        self.stop_token_ids: list[int] = [int(i) for i in ids]
        pad = tokenizer.pad_token_id
        self.pad_token_id: int = int(pad) if pad is not None else self.stop_token_ids[0]
        self.max_batch_size = max_batch_size

    # -- RolloutEngine -------------------------------------------------------------------------

    uses_policy_weights = True  # generates with the training module
    weights_released = False  # nothing of its own to release

    def release(self) -> None:
        """No-op: the engine holds nothing between calls."""

    def sync_weights(self, model: torch.nn.Module) -> None:
        """No-op: the engine generates with the training module itself.

        If a different module object is passed, the engine switches to it.
        """
        if model is not None and model is not self.model:
            self.model = model

    def generation_config(self, params: SamplingParams) -> GenerationConfig:
        """The complete generation config used for ``params`` (nothing left to model defaults).

        With ``params.logprobs`` the temperature and top-p are left out here: they run in
        :meth:`logits_processors` instead.
        """
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
        """A fresh last processor for one ``generate`` call, with the warpers ``params`` needs."""
        warpers: list[LogitsProcessor] = []
        if not params.greedy:
            if params.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(float(params.temperature)))
            if params.top_p < 1.0:
                warpers.append(TopPLogitsWarper(top_p=float(params.top_p), min_tokens_to_keep=1))
        return _SampledTokenLogProbs(warpers)

    def generate(self, prompts: list[str], params: SamplingParams) -> RolloutBatch:
        """Sample ``params.n`` responses for each prompt (grouped by prompt, in order)."""
        prompt_ids, order = tokenize_prompts(self.tokenizer, prompts, params.n, "HFRolloutEngine")
        if not prompt_ids:
            return RolloutBatch.empty(params.logprobs)
        responses: list[list[int]] = []
        finish: list[str] = []
        logprobs: list[list[float]] | None = [] if params.logprobs else None

        model = self.model
        device = _model_device(model)
        config = self.generation_config(params)
        stop = set(self.stop_token_ids)
        with (
            torch.no_grad(),
            _eval_mode(model),
            _swapped_generation_config(model, config),
            _seeded(params.seed, device),
        ):
            per_chunk = max(1, self.max_batch_size // params.n)
            for first in range(0, len(prompts), per_chunk):
                if params.seed is not None:
                    torch.manual_seed(params.seed + first)
                rows = order[first * params.n : (first + per_chunk) * params.n]
                chunk = [prompt_ids[i] for i in rows]
                input_ids, attention_mask = self._left_pad(chunk, device)
                recorder = self.log_prob_recorder(params) if params.logprobs else None
                with _nonfinite_sampling_is_runaway():
                    out = model.generate(
                        input_ids=input_ids,
                        attention_mask=attention_mask,
                        generation_config=config,
                        logits_processor=LogitsProcessorList([recorder] if recorder else []),
                        past_key_values=_shared_prompt_cache(model, input_ids, attention_mask),
                        # the weights are whole here (FSDP: summoned by the caller), so no rank
                        # waits for another; transformers' FSDP default (True) would make a rank
                        # with fewer prompts than its peers, or none, hang the others
                        synced_gpus=False,
                    )
                new_tokens = out[:, input_ids.shape[1] :]
                row_logprobs = recorder.finish(new_tokens) if recorder else None
                for r, row in enumerate(new_tokens.tolist()):
                    ids, reason = _trim(row, stop)
                    responses.append(ids)
                    finish.append(reason)
                    if row_logprobs is not None:
                        logprobs.append(row_logprobs[r][: len(ids)])

        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        return RolloutBatch(
            prompt_index=order,
            prompt_ids=[list(prompt_ids[i]) for i in order],
            response_ids=responses,
            response_text=list(texts),
            finish_reason=finish,
            response_logprobs=logprobs,
        )

    # -- helpers -------------------------------------------------------------------------------

    def _left_pad(
        self, seqs: list[list[int]], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(s) for s in seqs)
        input_ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, seq in enumerate(seqs):
            input_ids[row, width - len(seq) :] = torch.as_tensor(seq, dtype=torch.long)
            attention_mask[row, width - len(seq) :] = 1
        return input_ids.to(device), attention_mask.to(device)


@contextlib.contextmanager
def _nonfinite_sampling_is_runaway() -> Iterator[None]:
    """``torch.multinomial``'s error on inf/nan probabilities as our :class:`RunawayError`, which
    names the cause. Caught rather than checked per token: a check would sync every token."""
    try:
        yield
    except RuntimeError as e:
        if "probability tensor contains" not in str(e):
            raise
        raise RunawayError(f"{NONFINITE_SAMPLING}. {LIKELY_CAUSES}") from e


def _shared_prompt_cache(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """The KV cache of every prompt but its last token, computed once per run of equal rows (the
    ``n`` copies of a prompt) and expanded to all rows; ``None`` when no row repeats the one
    before it. ``generate`` then runs only the last prompt token of each row before sampling:
    the prefill shrinks ``n``-fold (-27 % of a tiny-preset rollout, ``docs/BENCHMARKS.md``) and the
    samples are the same (the logits differ only in float rounding)."""
    if input_ids.shape[1] < 2 or input_ids.shape[0] < 2:
        return None
    new = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    new[1:] = (input_ids[1:] != input_ids[:-1]).any(dim=1) | (attention_mask[1:] != attention_mask[:-1]).any(dim=1)
    if bool(new.all()):
        return None
    first, group = new.nonzero().squeeze(1), new.long().cumsum(0) - 1
    positions = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    out = model(
        input_ids=input_ids[first, :-1], attention_mask=attention_mask[first, :-1],
        position_ids=positions[first, :-1], use_cache=True, logits_to_keep=1,
    )
    cache = out.past_key_values
    cache.reorder_cache(group)
    return cache


class _SampledTokenLogProbs(LogitsProcessor):
    """The last logits processor: applies ``warpers``, then records the sampled tokens' log-probs.

    At call ``t`` it keeps the log-softmax of the final scores; at call ``t + 1`` the token drawn
    from them is the last column of ``input_ids``, so only one ``[B]`` vector per step is kept,
    never ``[B, V]`` scores for the whole response.
    """

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
        """``[B, T]`` log-probs of the ``T`` generated tokens, as lists (rows not yet trimmed)."""
        if self.pending is not None:
            self._take(new_tokens[:, -1])
        if len(self.steps) != new_tokens.shape[1]:
            raise RuntimeError(
                f"recorded {len(self.steps)} log-probs for {new_tokens.shape[1]} generated tokens"
            )
        if not self.steps:
            return [[] for _ in range(new_tokens.shape[0])]
        return torch.stack(self.steps, dim=1).tolist()


def _trim(row: list[int], stop: set[int]) -> tuple[list[int], str]:
    """Cut a generated row after its first stop token (kept); no stop -> the whole row."""
    for pos, tok in enumerate(row):
        if tok in stop:
            return row[: pos + 1], FINISH_STOP
    return row, FINISH_LENGTH
