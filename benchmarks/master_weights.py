"""Why the GPU configs keep fp32 master weights: what AdamW at lr 1e-6 does to bf16 weights.

    .venv/bin/python benchmarks/master_weights.py [--size 1000] [--steps 3] [--seeds 3]

A ``size x size`` matrix of N(0, 0.02) weights (Qwen's initialiser range) takes ``steps`` AdamW
steps (lr 1e-6, weight decay 0.1, the reference run's settings) on random N(0, 1) gradients,
held three ways:

- ``bf16``: weights and AdamW states in bf16 (``trainer.precision=bf16-true``, the old GPU
  configs): a step smaller than half a bf16 spacing of the weight rounds back to it;
- ``fp32_master``: fp32 weights and states, the gradient rounded to bf16 first (bf16 compute
  over fp32 masters: ``bf16-mixed``, the configs now);
- ``fp32``: everything fp32.

It reports the fraction of elements changed, and whether AdamW's second moment can decay in
bf16 (``bf16(v * 0.999) == v``) and its decoupled weight decay (``lr * wd * w``) survive. The
last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch


def changed_fraction(kind: str, size: int, steps: int, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(size, size, generator=gen) * 0.02
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    w = torch.nn.Parameter(w0.to(dtype))
    start = w.detach().clone()
    opt = torch.optim.AdamW([w], lr=1e-6, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)
    for _ in range(steps):
        g = torch.randn(size, size, generator=gen)
        if kind == "fp32_master":
            g = g.to(torch.bfloat16).float()  # the gradient a bf16 backward gives
        w.grad = g.to(dtype)
        opt.step()
    return float((w.detach() != start).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    out: dict = {"size": args.size, "steps": args.steps, "lr": 1e-6, "torch": torch.__version__,
                 "machine": platform.processor() or platform.machine()}
    for kind in ("bf16", "fp32_master", "fp32"):
        fr = [changed_fraction(kind, args.size, args.steps, s) for s in range(args.seeds)]
        out[f"{kind}_changed"] = {"median": statistics.median(fr), "min": min(fr), "max": max(fr)}
        print(f"{kind:12s} changed: {statistics.median(fr):.4%} (min {min(fr):.4%}, max {max(fr):.4%})")
    v = torch.tensor([1e-4, 3e-6, 0.25], dtype=torch.bfloat16)
    out["bf16_second_moment_decays"] = bool((v * 0.999 != v).any())
    w = torch.tensor([0.02, -0.013, 0.5], dtype=torch.bfloat16)
    out["bf16_weight_decay_survives"] = bool((w - 1e-6 * 0.1 * w != w).any())
    print(f"bf16: v * 0.999 != v for any of {v.tolist()}: {out['bf16_second_moment_decays']}; "
          f"w - lr*wd*w != w: {out['bf16_weight_decay_survives']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
