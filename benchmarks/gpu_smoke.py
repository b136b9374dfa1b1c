"""The GPU smoke run in one call: a few MEDS steps of the shipped 1.5B experiment, random weights.

    .venv/bin/python benchmarks/gpu_smoke.py --out gpu_smoke.json           # one CUDA GPU
    make gpu-smoke                                                          # the same
    .venv/bin/python benchmarks/gpu_smoke.py --toy --out /tmp/smoke.json    # CPU, seconds (the test suite)

What runs: ``experiment=qwen2.5-math-1.5b_meds`` as a user launches it (its precision, optimiser,
DAPO + MEDS plug-ins, token-budget micro-batches, the truncated IS correction, vLLM colocated
with sleep mode when ``vllm`` is installed, else HF generate), scaled down by overrides
(``--prompts`` x ``--n`` rollouts of at most ``--max-new-tokens`` a step, ``--steps`` steps, no
validation or checkpoints), with ``model.random_init=true``: the real architecture and width
(all 28 layers unless ``--layers``) with random weights, and the Qwen2.5-Math tokenizer from
``--tokenizer`` (default ``../shared/tokenizers/qwen2.5-math``). No network, no weights.
Prompts: the built-in arithmetic problems in the Qwen-Math template (no data files).

A random model answers nothing right, so every group would have one reward and no gradient: the
grader runs as usual, then every third response of a group is marked right. That is the one
thing made up here; it makes the advantages non-zero so that the update path runs with real
gradients (what ``weights_changed_frac`` measures), not learning.

``--toy``: the same on CPU at a narrow width (2 layers, hidden 128), HF generate: what the test
suite runs so that this script does not rot.

Writes one JSON (``--out``) and prints it as the last line: per step the phase times
(``time/*``), the memory of each phase on CUDA (``memory/*_peak_gib``: PyTorch's allocator peak;
``memory/*_device_gib``: the device's use at the phase's end, a vLLM engine included),
generated tokens/s, trainer tokens/s (prompt + response tokens of the scoring forward and the
update over their time), the padding shares, the fraction of matrix weights the step's update
changed, and the engine/trainer log-prob gap (``engine/*``) with the IS weights' statistics.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("MEDSRL_ROOT", str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from medsrl.reward.grader import GradeResult, MathGrader  # noqa: E402
from medsrl.train import build_run, train  # noqa: E402

DEFAULT_TOKENIZER = ROOT.parent / "shared" / "tokenizers" / "qwen2.5-math"
TOY_SHAPE = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
             "intermediate_size": 256}
KEPT = ("time/", "memory/", "engine/", "engine_is/", "padding/", "response_length", "num_responses", "num_tokens",
        "grad_norm", "pg_loss", "entropy", "meds/penalty", "meds/memory_entries", "nonfinite", "skipped")


class WeightChange(L.Callback):
    """The fraction of matrix-weight elements each step's update changed (copies on the host)."""

    def __init__(self) -> None:
        self.before: dict[str, torch.Tensor] = {}
        self.per_step: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.before = {n: p.detach().to("cpu", copy=True) for n, p in pl_module.policy.named_parameters()
                       if p.dim() >= 2}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        changed = total = 0
        for n, p in pl_module.policy.named_parameters():
            if n in self.before:
                changed += int((p.detach().cpu() != self.before[n]).sum())
                total += p.numel()
        self.per_step.append(changed / total if total else 0.0)
        self.before = {}


def some_right(grade_batch):
    """The real grader, then every third response marked right (see the module docstring)."""

    def grade(self, responses, golds):
        real = grade_batch(self, responses, golds)
        return [GradeResult(1.0, g.extracted or "x", True) if i % 3 == 0 else g for i, g in enumerate(real)]

    return grade


def overrides(args, out_dir: Path) -> list[str]:
    tok = Path(args.tokenizer)
    if not (tok / "tokenizer.json").exists() and not (tok / "tokenizer_config.json").exists():
        sys.exit(f"gpu_smoke: no tokenizer at {tok}: pass --tokenizer (the Qwen2.5-Math tokenizer folder)")
    cuda = torch.cuda.is_available() and not args.toy
    if not args.toy and not cuda:
        sys.exit("gpu_smoke: no CUDA GPU here; --toy runs the CPU version")
    backend = args.backend or ("vllm" if cuda and _has_vllm() else "hf")
    o = [
        "experiment=qwen2.5-math-1.5b_meds",
        f"paths.output_dir={out_dir}", f"paths.cache_dir={out_dir / 'cache'}",
        "data=arithmetic", "data.val_size=null", "data.val=null",
        f"data.prompts_per_step={args.prompts}", f"rollout.n={args.n}",
        f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.backend={backend}",
        f"algorithm.mini_batch_prompts={max(args.prompts // 2, 1)}",
        f"algorithm.plugins.overlong.buffer_length={max(args.max_new_tokens // 8, 1)}",
        "algorithm.plugins.dynamic_sampling.max_rounds=1",
        f"trainer.max_steps={args.steps}", "trainer.devices=1",
        "model.random_init=true", f"model.tokenizer={tok}", "model.name_or_path=null",
        "optim.scheduler.warmup_steps=0",
        "callbacks.pass_at_k=null", "callbacks.model_checkpoint=null", "callbacks.sample_logger=null",
        "callbacks.milestones=null", "logger=csv", "export_policy=false",
    ]
    if args.layers is not None or args.toy:
        o.append(f"model.shape.num_hidden_layers={args.layers or 2}")
    if args.toy:
        o += ["trainer.accelerator=cpu"] + [f"model.shape.{k}={v}" for k, v in TOY_SHAPE.items()]
        o += ["algorithm.max_tokens_per_microbatch=256", "model.gradient_checkpointing=false"]
    return o + list(args.override)


def _has_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def step_records(csv_dir: Path, weights_changed: list[float]) -> list[dict]:
    import csv

    rows: dict[int, dict] = {}
    with open(csv_dir / "metrics.csv") as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                if k.startswith("train/") and v not in ("", None) and any(t in k for t in KEPT):
                    rows.setdefault(int(row["step"]), {})[k.removeprefix("train/")] = float(v)
    out = []
    for i, step in enumerate(sorted(rows)):
        m = rows[step]
        generated = m.get("num_responses", 0) * m.get("response_length", 0)
        record = {"step": step, **m}
        if m.get("time/generate"):
            record["generated_tokens_per_s"] = generated / m["time/generate"]
        trainer_s = m.get("time/logprob", 0.0) + m.get("time/update", 0.0)
        if trainer_s and "num_tokens" in m:
            record["trainer_tokens_per_s"] = m["num_tokens"] / trainer_s
        if i < len(weights_changed):
            record["weights_changed_frac"] = weights_changed[i]
        out.append(record)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_smoke.json")
    ap.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's 28)")
    ap.add_argument("--backend", choices=["vllm", "hf"], default=None, help="default: vllm where installed")
    ap.add_argument("--toy", action="store_true", help="CPU, narrow width: the test suite's version")
    ap.add_argument("--override", action="append", default=[], help="one more Hydra override (repeatable)")
    args = ap.parse_args(argv)
    if args.toy:
        args.steps, args.prompts, args.n, args.max_new_tokens = min(args.steps, 2), min(args.prompts, 2), 4, 12

    with tempfile.TemporaryDirectory(prefix="medsrl-smoke-") as tmp:
        out_dir = Path(tmp)
        o = overrides(args, out_dir)
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
            cfg = compose("train", overrides=o)
        real_grade = MathGrader.grade_batch
        MathGrader.grade_batch = some_right(real_grade)
        try:
            start = time.perf_counter()
            run = build_run(cfg)
            changes = WeightChange()
            run.trainer.callbacks.append(changes)
            build_s = time.perf_counter() - start
            summary = train(cfg, run)
            wall = time.perf_counter() - start
        finally:
            MathGrader.grade_batch = real_grade
        steps = step_records(out_dir / "csv", changes.per_step)
        module = run.module

    on_gpu = torch.cuda.is_available() and not args.toy
    device = torch.cuda.get_device_name(0) if on_gpu else platform.processor() or "cpu"
    result = {
        "what": "benchmarks/gpu_smoke.py: MEDS steps of experiment=qwen2.5-math-1.5b_meds, random weights, "
                "every third response graded right",
        "device": device,
        "torch": torch.__version__,
        "backend": cfg.rollout.backend,
        "params": sum(p.numel() for p in module.policy.parameters()),
        "layers": int(cfg.model.shape.num_hidden_layers),
        "precision": str(cfg.trainer.precision),
        "prompts_per_step": args.prompts, "n": args.n, "max_new_tokens": args.max_new_tokens,
        "max_tokens_per_microbatch": cfg.algorithm.max_tokens_per_microbatch,
        "engine_is_cap": cfg.algorithm.engine_is_cap,
        "overrides": o,
        "build_s": build_s,
        "wall_s": wall,
        "steps_done": summary.get("steps"),
        "steps": steps,
    }
    if torch.cuda.is_available() and not args.toy:
        result["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
