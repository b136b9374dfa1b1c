"""Peak memory and time of one micro-batch's log-probs at Qwen's 151,936-token vocabulary (CPU).

    .venv/bin/python benchmarks/logprob_memory.py [--tokens 4096] [--hidden 256] [--rounds 3]

Two ways to the per-token log-probs (and the entropy) of ``tokens`` response positions from
their hidden states, forward and backward (gradients of the hidden states and the head):

- ``logits``: the head, then the chunked log-softmax on the whole ``[N, V]`` logits
  (``token_logprobs`` / ``token_entropy``; what the step did before);
- ``fused``: ``algo.logprobs.head_logprobs``, the head and the log-softmax over chunks of
  ``CHUNK_TOKENS`` tokens, recomputed in the backward.

Each in fp32 and under bf16 autocast over fp32 weights (bf16-mixed). Measured per way: the peak
bytes above what the block leaves (allocator events, ``utils/memory_tracking.py``), the largest
vocabulary-wide tensor, and the time, over ``rounds`` interleaved rounds (median, min-max); and
the largest difference of the log-probs and gradients between the two. Then, computed, the same
buffers at the GPU reference micro-batch (8 x 3072 tokens). The last line printed is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from medsrl.algo import token_entropy, token_logprobs
from medsrl.algo.logprobs import CHUNK_TOKENS, head_logprobs
from medsrl.utils.memory_tracking import track_memory

V = 151_936
GIB = 2**30


def run(way: str, h, w, y, scale, autocast: bool, measure: bool):
    """One forward + backward; returns (memory report or None, seconds, log-probs, grads)."""
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    cast = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False) if autocast else nullcontext()
    tracker = track_memory(vocab_size=V) if measure else nullcontext()
    start = time.perf_counter()
    with tracker as mem, cast:
        if way == "logits":
            logits = F.linear(h, w).unsqueeze(0)
            logp, ent = token_logprobs(logits, y.unsqueeze(0))[0], token_entropy(logits)[0]
            del logits
        else:
            out = head_logprobs(h, w, None, y, entropy=True)
            logp, ent = out.logp, out.entropy
        ((logp + 0.01 * ent) * scale).sum().backward()
    seconds = time.perf_counter() - start
    return mem, seconds, logp.detach(), (h.grad, w.grad)


def computed_gpu(tokens: int = 8 * 3072, chunk: int = CHUNK_TOKENS) -> dict[str, float]:
    """GiB of the vocabulary-wide buffers at the GPU reference micro-batch (bf16 compute)."""
    old = 3 * tokens * V * 2  # the logits, the backward's empty_like, the [:, :-1] slice's zeros
    fused_fwd = chunk * V * (2 + 4 + 4)  # a chunk's bf16 logits and two fp32 buffers
    fused_bwd = chunk * V * (2 + 4 + 4 + 2)  # and the bf16 gradient at the logits
    return {"tokens": tokens, "old_gib": old / GIB, "fused_forward_gib": fused_fwd / GIB,
            "fused_backward_gib": fused_bwd / GIB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256,
                    help="the memory is the vocabulary's: 1536 (Qwen2.5-Math-1.5B) only slows it")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    h = torch.randn(args.tokens, args.hidden, generator=g)
    w = 0.02 * torch.randn(V, args.hidden, generator=g)
    y = torch.randint(0, V, (args.tokens,), generator=g)
    scale = torch.linspace(0.5, 1.5, args.tokens)
    result: dict = {"tokens": args.tokens, "hidden": args.hidden, "vocab": V, "chunk": CHUNK_TOKENS,
                    "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine()}
    print(f"{args.tokens} tokens x hidden {args.hidden} -> V {V}, chunk {CHUNK_TOKENS}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'precision':<10} {'way':<7} {'peak MiB':>9} {'largest [.., V]':>18} {'s (median, min-max)':>24}")
    for autocast in (False, True):
        precision = "bf16-mix" if autocast else "fp32"
        mems, outs = {}, {}
        for way in ("logits", "fused"):  # memory: one measured run each (the profiler slows it)
            mems[way], _, logp, grads = run(way, h, w, y, scale, autocast, measure=True)
            outs[way] = (logp, grads)
        times: dict[str, list[float]] = {"logits": [], "fused": []}
        for _ in range(args.rounds):  # time: interleaved rounds, no profiler
            for way in times:
                times[way].append(run(way, h, w, y, scale, autocast, measure=False)[1])
        diff_logp = float((outs["fused"][0] - outs["logits"][0]).abs().max())
        rel_grads = [float((a - b).norm() / b.norm()) for a, b in zip(outs["fused"][1], outs["logits"][1], strict=True)]
        for way in ("logits", "fused"):
            mem, t = mems[way], times[way]
            peak = mem.peak_bytes - mem.net_bytes
            print(f"{precision:<10} {way:<7} {peak / 2**20:>9.0f} {str(mem.largest_vocab_shape):>18} "
                  f"{statistics.median(t):>9.3f} ({min(t):.3f}-{max(t):.3f})")
            result[f"{precision}/{way}"] = {
                "peak_bytes": peak, "largest_vocab_shape": list(mem.largest_vocab_shape),
                "seconds_median": statistics.median(t), "seconds_min": min(t), "seconds_max": max(t)}
        ratio = [a / b for a, b in zip(times["fused"], times["logits"], strict=True)]
        print(f"{precision:<10} fused/logits time {statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f}); "
              f"peak {result[f'{precision}/fused']['peak_bytes'] / result[f'{precision}/logits']['peak_bytes']:.3f}; "
              f"max |d logp| {diff_logp:.2e}, grads rel. diff (h, W) {rel_grads[0]:.1e}, {rel_grads[1]:.1e}")
        result[f"{precision}/fused_over_logits_time"] = statistics.median(ratio)
        result[f"{precision}/max_abs_logp_diff"] = diff_logp
        result[f"{precision}/grad_rel_diff"] = rel_grads
    gpu = computed_gpu()
    print(f"computed, 8 x 3072 tokens at V {V} in bf16: logits path {gpu['old_gib']:.1f} GiB of logit buffers; "
          f"fused {gpu['fused_forward_gib']:.2f} GiB forward, {gpu['fused_backward_gib']:.2f} GiB backward")
    result["computed_gpu_microbatch"] = gpu
    print(json.dumps(result))


if __name__ == "__main__":
    main()
