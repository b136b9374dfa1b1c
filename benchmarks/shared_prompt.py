"""The shared-prompt forward and prefill against running every row whole (tiny preset, CPU).

    .venv/bin/python benchmarks/shared_prompt.py [--rounds 5] [--prompts 16] [--n 8] [hydra overrides ...]

A step's rows are ``n`` responses to each prompt. ``step.scoring.response_logits`` runs a prompt
once for its rows (its KV cache expanded, the responses on top) and the HF engine prefills each
prompt once (``rollout/hf.py``); this measures both against the whole-row way, on the tiny
preset's warm-started policy and its real prompts, with random responses of 10..64 tokens:

- ``scoring``: the no-grad forward over the batch in micro-batches of 64;
- ``update``: the same with gradients and a backward (the policy update's forward/backward);
- ``generate``: one HF rollout of ``prompts x n`` at 64 new tokens, seeded (the samples are
  the same both ways: checked).

Each round times every variant once, in turn; the ratio shared / whole is taken per round and
given as median (min-max). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("MEDSRL_ROOT", str(ROOT))

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

import medsrl.rollout.hf as hf  # noqa: E402
import medsrl.step.scoring as scoring  # noqa: E402
from medsrl.algo import token_logprobs  # noqa: E402
from medsrl.rollout.base import SamplingParams, pack_rollouts  # noqa: E402
from medsrl.train import build_run  # noqa: E402


def _whole_rows(model, packed, rows, context=None):
    """``response_logits`` with every row run whole (what it does when no row shares a prompt)."""
    real = scoring._can_share_prompts
    scoring._can_share_prompts = lambda model: False
    try:
        return scoring.response_logits(model, packed, rows, context)
    finally:
        scoring._can_share_prompts = real


def _forward(fn, model, packed, grad: bool, mb: int = 64) -> float:
    start = time.perf_counter()
    with torch.set_grad_enabled(grad):
        for s in range(0, packed.input_ids.shape[0], mb):
            rows = slice(s, s + mb)
            logp = token_logprobs(fn(model, packed, rows), packed.input_ids[rows, packed.prompt_length :])
            if grad:
                (logp * packed.response_mask[rows]).sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _generate(engine, prompts, n: int, shared: bool) -> tuple[float, list]:
    real = hf._shared_prompt_cache
    if not shared:
        hf._shared_prompt_cache = lambda *args: None
    try:
        start = time.perf_counter()
        out = engine.generate(prompts, SamplingParams(n=n, max_new_tokens=64, seed=0))
        return time.perf_counter() - start, out.response_ids
    finally:
        hf._shared_prompt_cache = real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. debug=fast (the test suite's micro model)")
    args = ap.parse_args()

    base = ["logger=csv", f"paths.output_dir={ROOT / 'logs' / 'bench'}"]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=base + args.overrides)
    run = build_run(cfg)
    model, tok = run.module.policy, run.module.tokenizer
    prompts = [p.text for p in run.datamodule.prompts_for_step(0)[: args.prompts]]
    g = torch.Generator().manual_seed(0)
    prompt_ids = [tok(p)["input_ids"] for p in prompts for _ in range(args.n)]
    responses = [torch.randint(3, len(tok), (int(torch.randint(10, 65, (), generator=g)),), generator=g).tolist()
                 for _ in prompt_ids]
    packed = pack_rollouts(prompt_ids, responses, tok.pad_token_id)
    engine = hf.HFRolloutEngine(model, tok, max_batch_size=args.prompts * args.n)

    model.train()
    _forward(scoring.response_logits, model, packed, True)  # warm-up
    times: dict[str, list[float]] = {}
    same_samples = True
    for _ in range(args.rounds):
        for shared in (True, False):
            name = "shared" if shared else "whole"
            fn = scoring.response_logits if shared else _whole_rows
            model.eval()
            times.setdefault(f"scoring_{name}", []).append(_forward(fn, model, packed, False))
            model.train()
            times.setdefault(f"update_{name}", []).append(_forward(fn, model, packed, True))
            seconds, ids = _generate(engine, prompts, args.n, shared)
            times.setdefault(f"generate_{name}", []).append(seconds)
            if shared:
                first_ids = ids
            else:
                same_samples &= ids == first_ids

    def spread(xs):
        return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4)}

    result = {
        "benchmark": "shared_prompt",
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "threads": torch.get_num_threads(),
        "rows": len(prompt_ids),
        "prompt_tokens_mean": round(sum(map(len, prompt_ids)) / len(prompt_ids), 1),
        "response_tokens_mean": round(sum(map(len, responses)) / len(responses), 1),
        "rounds": args.rounds,
        "seconds": {k: spread(v) for k, v in sorted(times.items())},
        "ratio_shared_over_whole": {
            part: spread([a / b for a, b in zip(times[f"{part}_shared"], times[f"{part}_whole"], strict=True)])
            for part in ("scoring", "update", "generate")
        },
        "generate_same_samples": same_samples,
    }
    for part, r in result["ratio_shared_over_whole"].items():
        print(f"{part:9s} shared / whole: {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
