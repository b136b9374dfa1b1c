"""The forward passes over packed rollouts: response log-probs, and the one no-grad scoring pass,
which plug-ins read through a per-micro-batch context (MEDS's hooks) and per-token reducers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

from medsrl.algo.logprobs import HeadLogprobs, TokenReducer, head_logprobs, token_entropy
from medsrl.models.sharding import agreed_passes, idle_forward, is_sharded
from medsrl.rollout.base import PackedRollouts
from medsrl.step.micro_batches import padding_fraction, plan_micro_batches

BUILTIN_REDUCERS: dict[str, TokenReducer] = {"entropy": lambda logits, labels: token_entropy(logits)}

# what the head computes from hidden states and their labels: [b, r, H], [b, r] -> [b, r, ...]
HeadOutput = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def response_logprobs(
    model,
    packed: PackedRollouts,
    rows: slice | torch.Tensor,
    context: AbstractContextManager | None = None,
    *,
    entropy: bool = False,
    entropy_grad: bool = True,
    reducers: dict[str, TokenReducer] | None = None,
) -> HeadLogprobs:
    """Log-prob ``[b, R]`` of each response token of ``rows``, and the entropy / reducer values
    asked for. The fused head replaces the LM head's forward inside the model's own, so under FSDP
    the loss hangs off the wrapped model's output and the head weight is used only while gathered."""
    reducers = reducers or {}
    names = list(reducers)
    head = output_head(model)

    def fused(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out = head_logprobs(hidden, head.weight, head.bias, labels, entropy=entropy,
                            entropy_grad=entropy_grad, reducers=reducers)
        cols = [out.logp] + ([out.entropy] if entropy else []) + [out.stats[n] for n in names]
        return torch.stack(cols, dim=-1)

    logp, *cols = _response_forward(model, packed, rows, context, fused).unbind(-1)
    ent = cols.pop(0) if entropy else None
    return HeadLogprobs(logp, ent, dict(zip(names, cols, strict=True)))


def response_logits(
    model,
    packed: PackedRollouts,
    rows: slice | torch.Tensor,
    context: AbstractContextManager | None = None,
) -> torch.Tensor:
    """Logits ``[b, R, V]`` of the response positions (``logits[:, t]`` predicts token t), for
    tests and tools, by :func:`_response_forward`."""
    plain = output_head(model).forward
    return _response_forward(model, packed, rows, context, lambda hidden, labels: plain(hidden))


def _response_forward(
    model,
    packed: PackedRollouts,
    rows: slice | torch.Tensor,
    context: AbstractContextManager | None,
    head_output: HeadOutput,
) -> torch.Tensor:
    """``head_output`` ``[b, R, ...]`` of the hidden states predicting the response tokens of
    ``rows``; ``context`` wraps the forward over the response columns. Consecutive rows with the
    same prompt run it once, its KV cache expanded to every row, else all run in full (FSDP's
    wrapper, gradient checkpointing): the same up to float rounding. Padding columns all rows
    share are not run: on the left (exact, with explicit position ids; MEDS's hooks shift their
    positions) and past their longest response (returned as zeros)."""
    P = packed.prompt_length
    end = packed.columns_end(rows)  # the right padding all these rows share is not run
    resp_len, dropped = end - P, packed.response_length - (end - P)
    ids, mask, pos = packed.input_ids[rows, :end], packed.attention_mask[rows, :end], packed.position_ids[rows, :end]
    labels = ids[:, P:]
    lead = packed.columns_start(rows)
    first, group = _prompt_groups(ids[:, :P], mask[:, :P])
    head = output_head(model)
    if len(first) == len(ids) or resp_len == 0 or not _can_share_prompts(model):
        width = ids.shape[1] - lead
        keep = torch.arange(width - resp_len - 1, width - 1, device=ids.device)  # column t-1 predicts t
        with context or nullcontext(), _head_forward_as(head, lambda h: head_output(h, labels)):
            out = model(
                input_ids=ids[:, lead:], attention_mask=mask[:, lead:], position_ids=pos[:, lead:],
                use_cache=False, logits_to_keep=keep,
            )
        return _pad_columns(out.logits, dropped)
    # the prompt's last column predicts every row's first response token: its state, per row
    with _head_forward_as(head, lambda h: head_output(h[group], labels[:, :1])):
        prompt = model(
            input_ids=ids[first, lead:P], attention_mask=mask[first, lead:P], position_ids=pos[first, lead:P],
            use_cache=True, logits_to_keep=1,
        )
    cache = prompt.past_key_values
    cache.reorder_cache(group)  # [G, ...] -> [B, ...]: row i reads its group's prompt
    keep = torch.arange(resp_len - 1, device=ids.device)  # the last response column predicts nothing
    with context or nullcontext(), _head_forward_as(head, lambda h: head_output(h, labels[:, 1:])):
        out = model(
            input_ids=ids[:, P:], attention_mask=mask[:, lead:], position_ids=pos[:, P:],
            past_key_values=cache, use_cache=True, logits_to_keep=keep,
        )
    return _pad_columns(torch.cat([prompt.logits, out.logits], dim=1), dropped)


def _pad_columns(out: torch.Tensor, count: int) -> torch.Tensor:
    if count == 0:
        return out
    return torch.nn.functional.pad(out, (0, 0) * (out.dim() - 2) + (0, count))


def output_head(model) -> torch.nn.Module:
    """The LM head of a causal LM. A transform of the logits after it (soft-capping, scaling) is
    refused: the fused head returns log-probs, so it would apply to the wrong numbers."""
    config = getattr(model, "config", None)
    for key in ("final_logit_softcapping", "logit_scale"):
        if getattr(config, key, None) not in (None, 1, 1.0):
            raise ValueError(f"{type(model).__name__}: {key}={getattr(config, key)} is applied after the "
                             "LM head; the fused log-prob head does not support it")
    head = model.get_output_embeddings()
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise ValueError(f"{type(model).__name__} has no LM head with a weight (get_output_embeddings())")
    return head


@contextmanager
def _head_forward_as(head: torch.nn.Module, forward: Callable) -> Iterator[None]:
    """``head``'s forward is ``forward`` for the block (an instance attribute; hooks still run)."""
    missing = object()
    before = head.__dict__.get("forward", missing)
    head.forward = forward
    try:
        yield
    finally:
        if before is missing:
            del head.forward
        else:
            head.forward = before


def _prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first row of each run of rows with the same (left-padded) prompt, and each row's run."""
    new = torch.ones(prompt_ids.shape[0], dtype=torch.bool, device=prompt_ids.device)
    if prompt_ids.shape[0] > 1:
        new[1:] = (prompt_ids[1:] != prompt_ids[:-1]).any(dim=1) | (prompt_mask[1:] != prompt_mask[:-1]).any(dim=1)
    return new.nonzero().squeeze(1), new.long().cumsum(0) - 1


def _can_share_prompts(model) -> bool:
    """Not under FSDP's wrapper (one forward per unit before backward) nor in a training-mode
    forward with activation checkpointing (HF drops the cache; the scoring pass runs in eval)."""
    checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.2x
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    return not is_sharded(model) and not (checkpointing and model.training)


def scoring_pass(
    model,
    packed: PackedRollouts,
    micro_batch_size: int,
    *,
    max_tokens: int | None = None,
    reducers: dict[str, TokenReducer] | None = None,
    microbatch_context: Callable[[torch.Tensor], AbstractContextManager] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """No-grad log-probs ``[B, R]`` of the response tokens, plus each reducer's ``[B, R]``;
    ``microbatch_context(rows)`` wraps the forward of ``rows``. ``model``: the module the update
    trains (under FSDP its wrapper: the first update starts at ratio 1)."""
    reducers = reducers or {}
    B = packed.input_ids.shape[0]
    batches = scoring_micro_batches(packed, micro_batch_size, max_tokens)
    passes = agreed_passes(len(batches), is_sharded(model))
    logp: torch.Tensor | None = None
    stats: dict[str, torch.Tensor] = {}
    covered = torch.zeros(B, dtype=torch.long, device=packed.input_ids.device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for rows in batches:
                ctx = microbatch_context(rows) if microbatch_context else None
                out = response_logprobs(model, packed, rows, ctx, reducers=reducers)
                if logp is None:
                    logp = out.logp.new_zeros((B, out.logp.shape[1]))
                    stats = {name: v.new_zeros((B, v.shape[1])) for name, v in out.stats.items()}
                logp[rows] = out.logp
                for name in reducers:
                    stats[name][rows] = out.stats[name]
                covered[rows] += 1
            for _ in range(passes - len(batches)):
                idle_forward(model)
    finally:
        model.train(was_training)
    if logp is None or not bool((covered == 1).all()):
        raise RuntimeError(f"scoring_pass: micro-batches cover rows {covered.tolist()} times, not once each")
    return logp, stats


def scoring_micro_batches(packed: PackedRollouts, micro_batch_size: int, max_tokens: int | None) -> list[torch.Tensor]:
    rows = torch.arange(packed.input_ids.shape[0], device=packed.input_ids.device)
    return plan_micro_batches(rows, packed.prompt_lengths, packed.response_lengths,
                              max_rows=micro_batch_size, max_tokens=max_tokens)


def padding_metrics(packed: PackedRollouts, micro_batch_size: int, max_tokens: int | None) -> dict[str, float]:
    """The share of padding in the step's packed batch and in the scoring forward's micro-batches."""
    lengths = packed.prompt_lengths, packed.response_lengths
    planned = scoring_micro_batches(packed, micro_batch_size, max_tokens)
    packed_slots = packed.input_ids.shape[0] * (packed.prompt_length + packed.response_length)
    return {
        "padding/packed_frac": 1.0 - float(sum(t.sum() for t in lengths)) / packed_slots if packed_slots else 0.0,
        "padding/scoring_frac": padding_fraction(planned, *lengths),
    }


def scoring_forward_needed(algo, plugins, reducers: dict, engine_logprobs: bool) -> bool:
    """Whether a step must run :func:`scoring_pass`: not when on-policy (old log-probs are the
    update's own, detached, as TRL and verl) and nothing reads it (docs/BENCHMARKS.md)."""
    on_policy = algo.ppo_epochs == 1 and algo.mini_batch_prompts is None
    readers = [p for p in plugins if p.reads_scoring_forward]
    return not on_policy or bool(readers or reducers or engine_logprobs)
