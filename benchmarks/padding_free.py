"""Padding-free micro-batches against the padded ones: the scoring forward and the update (CPU).

    .venv/bin/python benchmarks/padding_free.py [--rounds 5] [--rows 128] [--max-response 384]

A step's rows have a long tail of response lengths (the GPU reference run: mean about 800 of at
most 3,072 tokens). Three ways to cut the same rows into forward/backward passes of at most
``--micro-batch`` rows, every one with the same worst-case tokens per pass:

- ``padded``: row order, every pass as wide as the step's longest row (the way the step went
  before issue 25; emulated here by making ``PackedRollouts.columns_end`` return the full width);
- ``trimmed``: row order, each pass as wide as its own longest row (today's default,
  ``algorithm.max_tokens_per_microbatch=null``);
- ``budget``: rows sorted by length, cut by ``micro-batch x full width`` padded tokens
  (``algorithm.max_tokens_per_microbatch``), each as wide as its own longest row; up to
  ``--max-rows`` rows a pass.

The policy is the tiny preset's architecture (random weights); responses are random tokens with
lengths from a log-normal of mean/max about 0.26, the reference run's shape, scaled to
``--max-response``. ``scoring``: ``step.scoring.scoring_pass`` (no grad); ``update``: the same
passes with gradients, a token-mean loss over the whole batch and its backward. Each round times
every way once, in turn; ratios to ``padded`` are per round, given as median (min-max). The log-probs and
gradients of the three ways are checked equal first. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from medsrl.models.tiny import build_tiny_model
from medsrl.rollout.base import PackedRollouts, pack_rollouts
from medsrl.step.micro_batches import padding_fraction, plan_micro_batches
from medsrl.step.scoring import response_logprobs, scoring_pass

TINY = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=512, max_position_embeddings=2048)


def make_batch(rows: int, max_response: int, n: int, seed: int) -> PackedRollouts:
    gen = torch.Generator().manual_seed(seed)
    # log-normal lengths with mean / max about 0.26 (800 / 3072 in the reference run)
    raw = torch.exp(torch.randn(rows, generator=gen) * 0.6) * (0.26 * max_response / 1.2)
    lengths = raw.round().clamp(8, max_response).long()
    lengths[int(torch.randint(rows, (1,), generator=gen))] = max_response  # the step's longest
    prompts, responses = [], []
    for g in range(0, rows, n):
        p_len = int(torch.randint(20, 60, (1,), generator=gen))
        prompt = torch.randint(3, 60, (p_len,), generator=gen).tolist()
        for i in range(g, min(g + n, rows)):
            prompts.append(prompt)
            responses.append(torch.randint(3, 60, (int(lengths[i]),), generator=gen).tolist())
    return pack_rollouts(prompts, responses, pad_token_id=0)


class FullWidth:
    """The padded way: every pass runs to the step's last column (``columns_end`` patched)."""

    def __enter__(self):
        self.real = PackedRollouts.columns_end
        PackedRollouts.columns_end = lambda packed, rows: packed.input_ids.shape[1]

    def __exit__(self, *exc):
        PackedRollouts.columns_end = self.real


def ways(args, packed):
    width = packed.input_ids.shape[1]
    budget = args.micro_batch * width
    return {
        "padded": (FullWidth, args.micro_batch, None),
        "trimmed": (None, args.micro_batch, None),
        "budget": (None, args.max_rows, budget),
    }


def passes(packed, max_rows, max_tokens):
    rows = torch.arange(packed.input_ids.shape[0])
    return plan_micro_batches(rows, packed.prompt_lengths, packed.response_lengths,
                              max_rows=max_rows, max_tokens=max_tokens)


def run_scoring(model, packed, ctx, max_rows, max_tokens):
    with ctx() if ctx else _null():
        start = time.perf_counter()
        logp, _ = scoring_pass(model, packed, max_rows, max_tokens=max_tokens)
        return time.perf_counter() - start, logp


def run_update(model, packed, ctx, max_rows, max_tokens):
    model.zero_grad(set_to_none=True)
    total = float(packed.response_mask.sum())
    with ctx() if ctx else _null():
        start = time.perf_counter()
        for rows in passes(packed, max_rows, max_tokens):
            out = response_logprobs(model, packed, rows)
            (-(out.logp * packed.response_mask[rows]).sum() / total).backward()
        seconds = time.perf_counter() - start
    return seconds, {n: p.grad.clone() for n, p in model.named_parameters()}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-response", type=int, default=384)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--max-rows", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = build_tiny_model(seed=0, **TINY).train()
    packed = make_batch(args.rows, args.max_response, args.n, seed=1)
    mask = packed.response_mask.bool()
    real = int(packed.prompt_lengths.sum() + packed.response_lengths.sum())
    lengths = packed.response_lengths.float()
    table = ways(args, packed)

    # the same numbers every way
    ref_logp = ref_grads = None
    for name, (ctx, max_rows, max_tokens) in table.items():
        _, logp = run_scoring(model, packed, ctx, max_rows, max_tokens)
        _, grads = run_update(model, packed, ctx, max_rows, max_tokens)
        if ref_logp is None:
            ref_logp, ref_grads = logp, grads
            continue
        torch.testing.assert_close(logp[mask], ref_logp[mask], atol=1e-5, rtol=1e-5, msg=name)
        for k, g in ref_grads.items():
            torch.testing.assert_close(grads[k], g, atol=1e-7, rtol=1e-4, msg=f"{name} {k}")

    times = {(name, phase): [] for name in table for phase in ("scoring", "update")}
    for _ in range(args.rounds):
        for name, (ctx, max_rows, max_tokens) in table.items():
            times[(name, "scoring")].append(run_scoring(model, packed, ctx, max_rows, max_tokens)[0])
            times[(name, "update")].append(run_update(model, packed, ctx, max_rows, max_tokens)[0])

    result = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "rounds": args.rounds,
              "rows": args.rows, "real_tokens": real, "width": int(packed.input_ids.shape[1]),
              "response_mean": float(lengths.mean()), "response_max": int(lengths.max()), "ways": {}}
    for name, (ctx, max_rows, max_tokens) in table.items():
        cut = passes(packed, max_rows, max_tokens)
        width = packed.input_ids.shape[1]
        slots = sum(len(r) * width for r in cut) if ctx else None
        pad = 1 - real / slots if slots else padding_fraction(cut, packed.prompt_lengths, packed.response_lengths)
        entry = {"passes": len(cut), "padding_frac": round(pad, 4)}
        for phase in ("scoring", "update"):
            t = times[(name, phase)]
            ratio = [a / b for a, b in zip(t, times[("padded", phase)], strict=True)]
            entry[phase] = {
                "median_s": round(statistics.median(t), 4), "min_s": round(min(t), 4), "max_s": round(max(t), 4),
                "real_tokens_per_s": round(real / statistics.median(t)),
                "vs_padded": [round(statistics.median(ratio), 3), round(min(ratio), 3), round(max(ratio), 3)],
            }
        result["ways"][name] = entry
        print(f"{name:8s} passes {len(cut):3d} padding {pad:6.1%}  "
              + "  ".join(f"{ph} {entry[ph]['median_s']:.3f}s ({entry[ph]['min_s']:.3f}-{entry[ph]['max_s']:.3f}) "
                          f"x{entry[ph]['vs_padded'][0]:.2f}" for ph in ("scoring", "update")))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
