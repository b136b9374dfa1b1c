"""One command for a lent GPU: the GPU paths of the 1.5B experiment, random weights, one process per case.

    make gpu-check                                                        # one CUDA GPU, no network
    .venv/bin/python benchmarks/gpu_check.py --cases one-device lora      # some of the cases
    .venv/bin/python benchmarks/gpu_check.py --toy --out /tmp/check.json  # CPU (the test suite)

The cases, each a fresh ``python benchmarks/gpu_check.py --run-case <case> ...`` (several fits in one
process would carry FSDP1's flat parameters from one fit to the next):

- ``one-device``: ``experiment=qwen2.5-math-1.5b_meds`` as a user launches it on one GPU;
- ``fsdp``: the same under ``trainer=fsdp`` at world size 1 (the one lent GPU; one CPU rank with
  ``--toy``), validation (sampling, then the MEDS feature pass) after the last step, a full checkpoint
  and a bf16 milestone there;
- ``resume``: a fresh process that resumes ``fsdp``'s checkpoint and trains one step more;
- ``lora``: one device, ``model.lora.r=16``.

Every case runs the experiment's precision, optimiser, DAPO + MEDS plug-ins, token-budget
micro-batches and truncated IS correction, vLLM colocated with sleep mode where ``vllm`` is
installed (else HF generate), scaled down by overrides (``--prompts`` x ``--n`` rollouts of at most
``--max-new-tokens``, ``--steps`` steps), with ``model.random_init=true``: the real architecture and
width (all 28 layers unless ``--layers``) with random weights and the Qwen2.5-Math tokenizer from
``--tokenizer`` (default ``../shared/tokenizers/qwen2.5-math``). Prompts: the built-in arithmetic
problems in the Qwen-Math template. No network, no weights.

A random model answers nothing right, so every group would have one reward and no gradient: the
grader runs as usual, then every third response of a group is marked right. That is the one thing
made up here; it gives the update real gradients (``weights_changed_frac``), not learning.

Measured per case: per step the phase times (``time/*``) and, on CUDA, PyTorch's allocator peak of
each phase (``memory/*_peak_gib``, the module's own; ``*_device_gib``: the device's use at the
phase's end, vLLM included); outside the steps (:class:`OutsideSteps`) the same for the restore of a
checkpoint (``resume``), the first weight sync, validation sampling and features, the checkpoint and
the milestone. Beside them every phase of ``medsrl-plan``'s plan of the case's config, read by name
(a phase the plan gains shows up, measured where a phase of that name is). On a CPU the peaks are
null; the plan's figures are still there.

``--toy``: the same on CPU at a narrow width (2 layers, hidden 128, fp32), HF generate, 2 steps:
what the test suite runs so that this script does not rot. Writes one JSON (``--out``; default
``docs/gpu/check_<device>_<date>.json``) and prints it as the last line.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("MEDSRL_ROOT", str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402

DEFAULT_TOKENIZER = ROOT.parent / "shared" / "tokenizers" / "qwen2.5-math"
CASES = ("one-device", "fsdp", "resume", "lora")
TOY_SHAPE = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
             "intermediate_size": 256}
KEPT = ("time/", "memory/", "engine/", "engine_is/", "padding/", "response_length", "num_responses", "num_tokens",
        "grad_norm", "pg_loss", "entropy", "meds/penalty", "meds/memory_entries", "nonfinite", "skipped")
# A plan phase is compared with the measured phase of its own name, or of this one: the module
# times a step's phases under its own names (module.py ``timer(...)``); the optimizer step runs
# inside its "update", and its "sync" is the weight sync after the update.
MEASURED_AS = {"generation": "generate", "scoring": "logprob", "optimizer step": "update", "weight sync": "sync"}
LORA_RANK = 16
# --toy's fsdp case: 1 CPU rank, the world size of the one lent GPU (2 ranks work too, measured 121 s
# against 75 s for the fsdp and resume cases on 2 busy cores; tests/e2e/test_distributed.py covers 2 ranks)
TOY_FSDP_RANKS = 1


# ---------------------------------------------------------------- one case, in its own process


class StepProbe(L.Callback):
    """Per step: the fraction of trained matrix weights the update changed (host copies of this
    rank's shard), and the longest prompt, which the plan of the case is computed for."""

    def __init__(self) -> None:
        self.before: dict[str, torch.Tensor] = {}
        self.weights_changed: list[float] = []
        self.prompt_tokens = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.before = {n: _local(p).to("cpu", copy=True) for n, p in _trained_matrices(pl_module)}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        changed = total = 0
        for n, p in _trained_matrices(pl_module):
            if n in self.before:
                changed += int((_local(p).cpu() != self.before[n]).sum())
                total += self.before[n].numel()
        self.weights_changed.append(changed / total if total else 0.0)
        self.before = {}
        rollouts = getattr(pl_module, "last_rollouts", None)
        if rollouts is not None:
            self.prompt_tokens = max(self.prompt_tokens, int(rollouts.packed.prompt_lengths.max()))


def _trained_matrices(pl_module):
    """The policy's trained weight matrices (with LoRA: the adapters)."""
    return [(n, p) for n, p in pl_module.policy.named_parameters() if p.requires_grad and p.dim() >= 2]


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (a DTensor's local shard; else the tensor), detached."""
    return (p.to_local() if hasattr(p, "to_local") else p).detach()


class OutsideSteps(L.Callback):
    """Time and allocator peak of what runs outside the module's steps, which the module does not
    time: the restore of a checkpoint (``resume``: from ``on_fit_start`` to ``on_train_start``),
    the first weight sync (from there to the first step: the module's ``on_train_start``),
    validation's sampling and feature pass, the checkpoint and the milestone. Named as
    ``medsrl-plan``'s phases where it has them. Insert it first among the callbacks."""

    def __init__(self, resuming: bool) -> None:
        from medsrl.step.metrics import PhaseTimer

        self.resuming = resuming
        self.timer = PhaseTimer()  # replaced at fit start, once CUDA is up (PhaseTimer checks at init)
        self._window = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        from medsrl.callbacks import pass_at_k

        trainer.save_checkpoint = self._timed("checkpoint", trainer.save_checkpoint)
        # the milestone callback saves through the module's export (export_policy=false: nothing else does)
        pl_module.export_policy = self._timed("milestone", pl_module.export_policy)
        pass_at_k.sample_chunk = self._timed("validation sampling", pass_at_k.sample_chunk)
        pass_at_k.response_features = self._timed("validation features", pass_at_k.response_features)

    def _timed(self, name: str, fn):
        """``fn`` inside the phase ``name`` (the timer looked up at call time)."""

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with self.timer(name):
                return fn(*args, **kwargs)

        return timed

    def _open(self, name: str | None) -> None:
        """Close the window phase open between two hooks, if any, and open ``name``."""
        if self._window is not None:
            self._window.__exit__(None, None, None)
            self._window = None
        if name is not None:
            self._window = self.timer(name)
            self._window.__enter__()

    def on_fit_start(self, trainer, pl_module) -> None:
        from medsrl.step.metrics import PhaseTimer

        self.timer = PhaseTimer()
        self._open("resume" if self.resuming else None)

    def on_train_start(self, trainer, pl_module) -> None:
        self._open("first weight sync")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._open(None)


def some_right(grade_batch):
    """The real grader, then every third response marked right (see the module docstring)."""
    from medsrl.reward.grader import GradeResult

    def grade(self, responses, golds):
        real = grade_batch(self, responses, golds)
        return [GradeResult(1.0, g.extracted or "x", True) if i % 3 == 0 else g for i, g in enumerate(real)]

    return grade


def step_records(csv_dir: Path, weights_changed: list[float]) -> list[dict]:
    """Per step the kept metrics of the CSV logger, with throughputs and the weights changed."""
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
        record = {"step": step, **m}
        if m.get("time/generate"):
            record["generated_tokens_per_s"] = m.get("num_responses", 0) * m.get("response_length", 0) / m[
                "time/generate"]
        trainer_s = m.get("time/logprob", 0.0) + m.get("time/update", 0.0)
        if trainer_s and "num_tokens" in m:
            record["trainer_tokens_per_s"] = m["num_tokens"] / trainer_s
        if i < len(weights_changed):
            record["weights_changed_frac"] = weights_changed[i]
        out.append(record)
    return out


def measured_peaks(steps: list[dict], outside) -> tuple[dict[str, float], dict[str, float]]:
    """Allocator peak and device use per measured phase, GiB, the largest over the steps: the
    module's step phases and :class:`OutsideSteps`' (both empty on a CPU)."""
    peaks, device = {}, {}
    for record in steps:
        for key, value in record.items():
            for suffix, into in (("_peak_gib", peaks), ("_device_gib", device)):
                if key.startswith("memory/") and key.endswith(suffix):
                    name = key.removeprefix("memory/").removesuffix(suffix)
                    into[name] = max(into.get(name, 0.0), value)
    peaks.update({k: v / 2**30 for k, v in outside.timer.peak_bytes.items()})
    device.update({k: v / 2**30 for k, v in outside.timer.device_bytes.items()})
    return peaks, device


def run_case(case: str, out: Path, overrides: list[str]) -> None:
    """Train one case and write its measurements (rank 0). Every rank of a multi-process run
    re-runs this same command (Lightning's launcher)."""
    from hydra import compose, initialize_config_dir

    from medsrl.reward.grader import MathGrader
    from medsrl.train import build_run, train

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    MathGrader.grade_batch = some_right(MathGrader.grade_batch)  # this process only
    start = time.perf_counter()
    run = build_run(cfg)
    probe, outside = StepProbe(), OutsideSteps(resuming=bool(cfg.get("ckpt_path")))
    run.trainer.callbacks.insert(0, outside)
    run.trainer.callbacks.append(probe)
    build_s = time.perf_counter() - start
    summary = train(cfg, run)
    if not run.trainer.is_global_zero:
        return
    steps = step_records(Path(cfg.paths.output_dir) / "csv", probe.weights_changed)
    peaks, device = measured_peaks(steps, outside)
    on_gpu = run.trainer.strategy.root_device.type == "cuda"
    result = {
        "case": case, "ok": True,
        "device": torch.cuda.get_device_name(0) if on_gpu else platform.processor() or "cpu",
        "device_total_gib": torch.cuda.mem_get_info()[1] / 2**30 if on_gpu else None,
        "world_size": run.trainer.world_size,
        "backend": cfg.rollout.backend,
        "precision": str(cfg.trainer.precision),
        "params": sum(p.numel() for p in run.module.policy.parameters()),
        "trained_params": sum(p.numel() for p in run.module.policy.parameters() if p.requires_grad),
        "prompt_tokens_max": probe.prompt_tokens,
        "build_s": build_s,
        "wall_s": time.perf_counter() - start,
        "steps_done": summary.get("steps"),
        "step_s": [s.get("time/step") for s in steps],
        "outside_steps_s": dict(outside.timer.times),
        "peaks_gib": peaks,
        "device_gib": device,
        "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
        "steps": steps,
    }
    out.write_text(json.dumps(result, indent=1))


# ---------------------------------------------------------------- the cases, from the parent


def base_overrides(args, run_dir: Path) -> list[str]:
    """The 1.5B experiment scaled down, random weights (each case adds its own)."""
    o = [
        "experiment=qwen2.5-math-1.5b_meds",
        f"paths.output_dir={run_dir}", f"paths.cache_dir={run_dir.parent / 'cache'}",
        "data=arithmetic", f"data.prompts_per_step={args.prompts}", f"rollout.n={args.n}",
        f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.backend={args.backend}",
        f"algorithm.mini_batch_prompts={max(args.prompts // 2, 1)}",
        f"algorithm.plugins.overlong.buffer_length={max(args.max_new_tokens // 8, 1)}",
        "algorithm.plugins.dynamic_sampling.max_rounds=1",
        f"trainer.max_steps={args.steps}", "trainer.devices=1",
        "model.random_init=true", f"model.tokenizer={args.tokenizer}", "model.name_or_path=null",
        "optim.scheduler.warmup_steps=0", "callbacks.sample_logger=null", "logger=csv", "export_policy=false",
    ]
    if args.layers is not None or args.toy:
        o.append(f"model.shape.num_hidden_layers={args.layers or 2}")
    if args.toy:
        o += ["trainer.accelerator=cpu", "trainer.precision=32-true", "algorithm.max_tokens_per_microbatch=256",
              "model.gradient_checkpointing=false"]
        o += [f"model.shape.{k}={v}" for k, v in TOY_SHAPE.items()]
    return o


def fsdp_overrides(args) -> list[str]:
    """``trainer=fsdp``, and at the last step validation (its features on), a full checkpoint and a milestone."""
    val = 2 if args.toy else 16
    return [
        "trainer=fsdp", f"trainer.devices={TOY_FSDP_RANKS if args.toy else 1}", f"data.val_size={val}",
        f"callbacks.pass_at_k.every_n_steps={args.steps}", "callbacks.pass_at_k.at_start=false",
        "callbacks.pass_at_k.n=2", f"callbacks.pass_at_k.num_problems={val}",
        f"callbacks.pass_at_k.batch_size={2 if args.toy else 32}",
        f"callbacks.model_checkpoint.every_n_train_steps={args.steps}", "callbacks.model_checkpoint.save_top_k=1",
        f"callbacks.milestones.every_n_steps={args.steps}",
    ]


# (without a checkpoint callback Lightning adds its own, which would write 18 GB at 1.5B)
NOTHING_SAVED = ["callbacks.pass_at_k=null", "callbacks.model_checkpoint=null", "callbacks.milestones=null",
                 "trainer.enable_checkpointing=false"]


def case_overrides(case: str, args, work: Path) -> list[str]:
    """The Hydra overrides of ``case`` (the user's ``--override`` last)."""
    o = base_overrides(args, work / case)
    o += fsdp_overrides(args) if case in ("fsdp", "resume") else NOTHING_SAVED
    if case == "resume":
        o += [f"ckpt_path={checkpoint_of(work)}", f"trainer.max_steps={args.steps + 1}"]
    if case == "lora":
        o.append(f"model.lora.r={LORA_RANK}")
    return o + list(args.override)


def checkpoint_of(work: Path) -> Path:
    """The fsdp case's last checkpoint, which the resume case resumes."""
    return work / "fsdp" / "checkpoints" / "last.ckpt"


def case_plan(overrides: list[str], record: dict) -> dict:
    """``medsrl-plan``'s plan of the case's config, at the longest prompt the case had (else the
    rollout's prompt limit) and the memory of the GPU it ran on: every phase by name, its figure
    beside the measured peak of that phase (None where nothing of that name was measured)."""
    from medsrl.plan.cli import compose_train_config, plan_for

    extra = []
    if record.get("device_total_gib"):
        extra = [f"hardware.gpu_memory_gib={record['device_total_gib']:.1f}",
                 f"hardware.name='1x {record['device']}'"]
    cfg = compose_train_config([*overrides, *extra])
    prompt_tokens = record.get("prompt_tokens_max") or int(cfg.rollout.max_prompt_tokens)
    plan = plan_for(cfg, prompt_tokens)
    peaks, device = record.get("peaks_gib", {}), record.get("device_gib", {})
    phases = []
    for phase in plan.phases:
        measured = MEASURED_AS.get(phase.name, phase.name)
        phases.append({"phase": phase.name, "plan_gib": phase.total / 2**30, "peak_gib": peaks.get(measured),
                       "device_gib": device.get(measured), "measured_as": measured if measured in peaks else None})
    return {"plan_prompt_tokens": prompt_tokens, "plan_fits": plan.fits, "phases": phases}


def run_in_process(case: str, overrides: list[str], work: Path, timeout_s: int) -> dict:
    """``--run-case`` in a fresh process (its own session, so a hung rank is killed with it); its
    record, or what failed: the exit status and the end of its output."""
    out, log = work / f"{case}.json", work / f"{case}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run-case", case, "--case-out", str(out), "--",
           *overrides]
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        code: int | str | None = None
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = f"timed out after {timeout_s} s"
        finally:  # also when this process is stopped (SIGTERM: see main): no rank left behind
            if proc.poll() is None or code != 0:
                _kill_group(proc)
    wall = time.perf_counter() - start
    if code == 0 and out.exists():
        return {**json.loads(out.read_text()), "process_s": wall}
    tail = log.read_text(errors="replace")[-4000:]
    return {"case": case, "ok": False, "error": f"exit {code}: ...{tail}", "process_s": wall}


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the case's process group (its ranks and workers), if any of it is left."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def check(args) -> dict:
    """Every case of ``args.cases`` in order, each in its own process, with its plan."""
    with tempfile.TemporaryDirectory(prefix="medsrl-gpu-check-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        cases = {}
        for case in args.cases:
            overrides = case_overrides(case, args, work)
            if case == "resume" and not checkpoint_of(work).exists():
                record = {"case": case, "ok": False, "error": f"not run: no checkpoint at {checkpoint_of(work)} "
                                                              "(the fsdp case runs first and writes it)"}
            else:
                record = run_in_process(case, overrides, work, args.case_timeout)
            record["overrides"] = overrides
            try:
                record.update(case_plan(overrides, record))
            except Exception as err:  # noqa: BLE001 - the plan's failure is a finding, not a crash
                record["ok"], record["plan_error"] = False, f"{type(err).__name__}: {err}"
            cases[case] = record
            print_case(record)
    devices = [r["device"] for r in cases.values() if r.get("device")]
    return {
        "what": "benchmarks/gpu_check.py: experiment=qwen2.5-math-1.5b_meds, random weights, every third "
                "response graded right; each case in its own process",
        "device": devices[0] if devices else None,
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "vllm_installed": importlib.util.find_spec("vllm") is not None,
        "backend": args.backend, "toy": args.toy, "steps": args.steps, "prompts_per_step": args.prompts,
        "n": args.n, "max_new_tokens": args.max_new_tokens,
        "ok": all(r["ok"] for r in cases.values()),
        "cases": cases,
    }


def print_case(record: dict) -> None:
    """Per phase the plan's figure beside the allocator peak, then the step times."""
    status = "ok" if record["ok"] else "FAILED"
    print(f"\n{record['case']}: {status}" + (f" ({record.get('device')})" if record.get("device") else ""))
    if not record["ok"]:
        print("  " + (record.get("error") or record.get("plan_error") or "")[-1500:].replace("\n", "\n  "))
    for p in record.get("phases", []):
        print(f"  {p['phase']:<22} plan {p['plan_gib']:8.2f} GiB   {_measured(p['peak_gib'], p['device_gib'])}")
    compared = {p["measured_as"] for p in record.get("phases", [])}
    for name, peak in record.get("peaks_gib", {}).items():
        if name not in compared:
            print(f"  {name:<22} (no plan phase)      {_measured(peak, record['device_gib'].get(name))}")
    if record.get("step_s"):
        print("  step time: " + ", ".join(f"{s:.2f} s" for s in record["step_s"] if s is not None))


def _measured(peak: float | None, device: float | None) -> str:
    """The allocator peak, and the device's use at the phase's end (a vLLM engine included)."""
    if peak is None:
        return "peak -"
    return f"peak {peak:.2f} GiB" + ("" if device is None else f" (device {device:.2f} GiB)")


def default_out(device: str | None) -> Path:
    """``docs/gpu/check_<device>_<date>.json``, e.g. ``check_nvidia-h200_2026-11-27.json``."""
    slug = re.sub(r"[^a-z0-9]+", "-", (device or "cpu").lower()).strip("-")
    return ROOT / "docs" / "gpu" / f"check_{slug}_{datetime.date.today().isoformat()}.json"


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="the JSON (default: docs/gpu/check_<device>_<date>.json)")
    ap.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    ap.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's 28)")
    ap.add_argument("--backend", choices=["vllm", "hf"], default=None, help="default: vllm where installed")
    ap.add_argument("--case-timeout", type=int, default=900, help="seconds per case")
    ap.add_argument("--work-dir", default=None, help="the cases' run dirs and logs (default: a temporary dir)")
    ap.add_argument("--toy", action="store_true", help="CPU, narrow width: the test suite's version")
    ap.add_argument("--override", action="append", default=[], help="one more Hydra override for every case")
    ap.add_argument("--run-case", choices=CASES, help=argparse.SUPPRESS)  # internal: one case, this process
    ap.add_argument("--case-out", help=argparse.SUPPRESS)
    ap.add_argument("case_overrides", nargs="*", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.run_case:
        run_case(args.run_case, Path(args.case_out), args.case_overrides)
        return None
    tok = Path(args.tokenizer)
    if not (tok / "tokenizer.json").exists() and not (tok / "tokenizer_config.json").exists():
        sys.exit(f"gpu_check: no tokenizer at {tok}: pass --tokenizer (the Qwen2.5-Math tokenizer folder)")
    args.tokenizer = str(tok.resolve())
    if not args.toy and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA GPU here; --toy runs the CPU version")
    if args.toy:
        args.steps, args.prompts, args.n, args.max_new_tokens = min(args.steps, 2), min(args.prompts, 2), 4, 12
    args.backend = args.backend or ("vllm" if not args.toy and importlib.util.find_spec("vllm") else "hf")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the running case's group is killed
    result = check(args)
    out = Path(args.out) if args.out else default_out(result["device"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\n[gpu_check] {'every case ok' if result['ok'] else 'FAILED'}; written to {out}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    done = main()
    sys.exit(0 if done is None or done["ok"] else 1)
