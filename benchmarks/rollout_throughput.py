"""Rollout throughput: vLLM vs Hugging Face ``generate``, in tokens/s, on the tiny preset.

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \\
        .venv-vllm/bin/python benchmarks/rollout_throughput.py [--repeats 3]

Needs the ``.venv-vllm`` environment (``make test-vllm`` builds it). Both engines serve the same
randomly initialised tiny-preset Qwen2 (``configs/model/tiny.yaml``'s sizes unless overridden) in
one process with the same threads, and sample the same batch as a training step: ``--prompts``
arithmetic prompts x ``--n`` responses (64 sequences by default), temperature 1, seeded.
``--full-length`` (the default) makes the stop tokens unreachable (:func:`_never_stop`), so every
response runs to ``--max-new-tokens`` and both engines do the same work; ``--no-full-length``
leaves the random model as it is (responses then end early and unevenly, as in RL). One warm-up
call per engine is not timed. The last line printed is one JSON object.

``--dry-run``: everything but the vLLM engine (the model, the prompts, the HF engine's timing;
``medsrl.rollout.vllm`` imported, not started): what the test suite runs in ``.venv``, which has
no vLLM (tests/test_benchmark_scripts.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from medsrl.data.arithmetic import generate_arithmetic
from medsrl.data.template import render_prompt
from medsrl.models.char_tokenizer import build_char_tokenizer
from medsrl.models.loading import stop_token_ids
from medsrl.models.tiny import build_tiny_model
from medsrl.rollout.base import SamplingParams
from medsrl.rollout.hf import HFRolloutEngine


def _never_stop(model: torch.nn.Module, stop_ids: list[int]) -> None:
    """Give the stop tokens a logit of about -1000 whatever the input.

    Residual channel 0 is held at +10 (its embedding column is 10 and no layer writes to it), so
    after the final norm it is positive; an untied head scores the stop tokens -1000 x channel 0.
    """
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, 0] = 10.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0].zero_()
            layer.mlp.down_proj.weight[0].zero_()
        head = torch.nn.Linear(emb.shape[1], emb.shape[0], bias=False)
        head.weight.copy_(emb)
        head.weight[stop_ids] = 0.0
        head.weight[stop_ids, 0] = -1000.0
    model.lm_head = head
    model.config.tie_word_embeddings = False


def _time(engine, prompts: list[str], params: SamplingParams, repeats: int) -> dict[str, float]:
    engine.generate(prompts, params)  # warm-up
    seconds, tokens = [], []
    for r in range(repeats):
        p = SamplingParams(**{**params.__dict__, "seed": params.seed + r})
        start = time.perf_counter()
        batch = engine.generate(prompts, p)
        seconds.append(time.perf_counter() - start)
        tokens.append(sum(batch.response_lengths))
    return {
        "tokens_per_s": round(sum(tokens) / sum(seconds), 1),
        "seconds_per_call": round(sum(seconds) / repeats, 4),
        "mean_response_length": round(sum(tokens) / (repeats * len(prompts) * params.n), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--full-length", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--intermediate-size", type=int, default=512)
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--kv-cache-gib", type=float, default=0.5)
    ap.add_argument("--dry-run", action="store_true", help="all but the vLLM engine (no vLLM needed)")
    args = ap.parse_args()

    from medsrl.rollout.vllm import VLLMRolloutEngine  # its engine needs .venv-vllm

    tok = build_char_tokenizer()
    sizes = dict(hidden_size=args.hidden_size, num_hidden_layers=args.layers)
    model = build_tiny_model(seed=0, intermediate_size=args.intermediate_size, **sizes).eval()
    if args.full_length:
        _never_stop(model, stop_token_ids(tok))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    problems = generate_arithmetic(args.prompts, level=1, seed=0, split="val")
    prompts = [render_prompt(p.problem) for p in problems]
    params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, seed=0)

    start = time.perf_counter()
    vllm_engine = None if args.dry_run else VLLMRolloutEngine(
        model,
        tok,
        enforce_eager=args.enforce_eager,
        kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30),
    )
    startup = time.perf_counter() - start
    hf_engine = HFRolloutEngine(model, tok, max_batch_size=args.prompts * args.n)
    vllm = None if args.dry_run else _time(vllm_engine, prompts, params, args.repeats)
    hf = _time(hf_engine, prompts, params, args.repeats)
    result = {
        "benchmark": "rollout_throughput",
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "device": device,
        "threads": torch.get_num_threads(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "sequences": args.prompts * args.n,
        "max_new_tokens": args.max_new_tokens,
        "full_length": args.full_length,
        "repeats": args.repeats,
        "dry_run": args.dry_run,
        "vllm_startup_s": None if args.dry_run else round(startup, 2),
        "vllm": vllm,
        "hf": hf,
        "ratio_vllm_over_hf": None if args.dry_run else round(vllm["tokens_per_s"] / hf["tokens_per_s"], 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":  # vLLM may spawn processes: keep the guard
    main()
