"""Peer benchmark: medsrl against TRL's ``GRPOTrainer`` on identical work (tiny preset, DAPO).

    make bench-trl [ARGS="--rounds 3 --steps 6"]          # builds .venv-trl first
    .venv-trl/bin/python benchmarks/peer_trl.py [--rounds 3] [--steps 6] [--warmup 1] [--threads N]
        [--medsrl-python PY] [--medsrl-overrides "hydra overrides for the medsrl side"] [--dry-run]

    # medsrl on its vLLM backend (in .venv-vllm) against TRL on HF generate (in .venv-trl):
    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 \\
        .venv-trl/bin/python benchmarks/peer_trl.py --medsrl-python .venv-vllm/bin/python \\
        --medsrl-overrides "rollout=vllm rollout.vllm.enforce_eager=true rollout.vllm.kv_cache_memory_bytes=1073741824"
    # the same through make (which sets the vLLM variables):
    make bench-trl ARGS="--medsrl-python .venv-vllm/bin/python --medsrl-overrides \\
        'rollout=vllm rollout.vllm.enforce_eager=true rollout.vllm.kv_cache_memory_bytes=1073741824'"

Runs in ``.venv-trl`` (``make bench-trl`` builds it: trl 1.16.0 from pyproject's ``trl`` extra,
the same torch and transformers pins as ``.venv``). Both sides do the same work, read from one
composed medsrl config (``experiment=tiny algorithm=dapo``, DAPO's dynamic sampling off, no
validation, plus ``--medsrl-overrides``):

- the tiny preset's warm-started policy, built by medsrl if missing (``ensure_warm_start``);
  TRL loads that directory with ``AutoModelForCausalLM`` / ``AutoTokenizer``, and the run stops
  if ``AutoTokenizer`` gives other ids than medsrl's tokenizer on the prompts;
- the same prompts in the same order (``prompts_for_step(0..steps-1)``, 16 a step, medsrl's
  template), 8 responses each, at most 64 new tokens, temperature 1, top-p 1, no top-k, the
  same stop tokens (medsrl's ``<|im_end|>`` and ``<|endoftext|>``), one generate call of 128;
- grading by medsrl's ``MathGrader`` (the run's ``GraderConfig``: timeout, workers, reasoning
  tag) as TRL's reward function, plus DAPO's soft overlong penalty (medsrl's ``overlong_penalty``,
  the tiny preset's buffer of 16) as a second reward function, so TRL's summed reward is
  medsrl's ``train/reward``;
- DAPO loss (token mean over the step's tokens, clip 0.2 / 0.28, no KL), micro-batches of 64
  (TRL: ``per_device_train_batch_size=64``, ``gradient_accumulation_steps=2``,
  ``steps_per_generation=2``: one generation of 16 x 8 per optimizer step), one optimizer step
  per RL step, AdamW with medsrl's settings and warm-up schedule (handed to TRL as its
  optimizer), grad clip 1.0, float32, CPU, no gradient checkpointing, no checkpoints or reports.

The forwards are the same too: with ``num_iterations=1`` and generation aligned to the optimizer
step, TRL skips the no-grad old-log-prob forward (its ratio is exactly 1), and so does medsrl
here (``RLModule.scoring_forward_needed``: one epoch, one mini-batch, no plug-in reading it).
What the two do not share: medsrl runs each prompt once for its ``n`` rows (prefill, training
forward), TRL every row whole; TRL's training forward also computes token entropies; group
std + 1e-4 (TRL) vs 1e-6 (medsrl); TRL shuffles the 128 rows before splitting them into
micro-batches. Sampling differs (two RNG streams), so responses differ, but lengths
and rewards must be in the same range (checked, with a warning past 15 % in length).

Timing: medsrl's ``train/time/step`` (its whole ``training_step``: generate, grade, scoring
forward, update) and TRL's wall time from ``on_step_begin`` to ``on_step_end`` of a
``TrainerCallback`` (generation, rewards, both micro-batches, clip, optimizer step); besides, the
wall time between consecutive step starts on each side (framework overhead, logging and data
included). The first ``--warmup`` steps of each run are dropped. Each round runs both sides, each
in a fresh subprocess of ``--steps`` steps, alternating which goes first, so the machine's drift
hits both alike; the ratio medsrl / TRL is taken per round and given as median (min-max). The
last line printed is one JSON object.

``--dry-run`` builds both sides from the composed config (the policy, the tokenizer check, the
grader and reward functions, TRL's arguments, medsrl's run) and trains nothing; it needs no trl
(``GRPOConfig`` is built only where trl is installed): the test suite runs it at toy size
(tests/test_benchmark_scripts.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("MEDSRL_ROOT", str(ROOT))

# The medsrl side: tiny preset, DAPO without dynamic sampling, nothing but the steps.
MEDSRL_OVERRIDES = [
    "experiment=tiny",
    "algorithm=dapo",
    "algorithm.plugins.dynamic_sampling=null",
    "callbacks.pass_at_k.every_n_steps=0",
    "callbacks.sample_logger.every_n_steps=0",
    "callbacks.model_checkpoint.every_n_train_steps=1000000",
    "export_policy=false",
    "logger=csv",
]
# Plug-ins the TRL side reproduces; any other one has no TRL counterpart here.
MIRRORED_PLUGINS = {"overlong"}
LENGTH_TOLERANCE = 0.15


# --------------------------------------------------------------------------- shared


def compose(out: Path, steps: int, extra: list[str]):
    """The medsrl config both sides read their settings from."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    overrides = [f"paths.output_dir={out}", f"trainer.max_steps={steps}", *MEDSRL_OVERRIDES, *extra]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return hydra_compose("train", overrides=overrides)


def policy_dir(cfg) -> Path:
    """The directory medsrl trains from: the warm-started tiny preset (built here if missing,
    by medsrl's own cache), or ``model.name_or_path``."""
    from medsrl.run_config import RunConfig

    model = RunConfig.parse(cfg).model
    if model.name_or_path:
        return Path(model.name_or_path)
    if model.warm_start is None:
        raise SystemExit("peer_trl: model.warm_start is null and no model.name_or_path: "
                         "nothing on disk for TRL to load")
    from medsrl.warmstart import warm_started

    return Path(warm_started(model, cfg.paths.cache_dir).name_or_path)


def overlong_plugin(run):
    """DAPO's overlong plug-in as the run builds it (its class's defaults for keys not set), or None."""
    built = run.algorithm.plugins.get("overlong")
    return None if built is None else built.cls(**dict(built.settings))


def settings(cfg) -> dict:
    """The work both sides do, from the medsrl config (parsed as medsrl's run parses it: a
    composed config leaves some values to the schemas, ``grader.num_workers`` null is one per
    core); refuses what TRL cannot mirror."""
    from medsrl.run_config import RunConfig

    run = RunConfig.parse(cfg)
    algo, optim, rollout, grader = run.algorithm, run.optim, run.rollout, run.grader
    plugins = sorted(run.algorithm.plugins)
    problems = []
    if set(plugins) - MIRRORED_PLUGINS:
        problems.append(f"plug-ins {sorted(set(plugins) - MIRRORED_PLUGINS)} have no TRL counterpart here")
    for key, want in [("kl_coef", 0.0), ("entropy_coef", 0.0), ("ppo_epochs", 1), ("mini_batch_prompts", None),
                      ("loss_agg_mode", "token-mean"), ("advantage", "grpo"), ("policy_loss", "vanilla")]:
        if getattr(algo, key) != want:
            problems.append(f"algorithm.{key}={getattr(algo, key)!r} (TRL side mirrors {want!r})")
    mirrored_optim = ("torch.optim.AdamW", "medsrl.step.lr_schedule.linear_warmup")
    if (optim.optimizer.target, optim.scheduler.target) != mirrored_optim:
        problems.append(f"optim.optimizer / optim.scheduler {optim.optimizer.target} / {optim.scheduler.target} "
                        "(TRL side mirrors AdamW with a linear warm-up)")
    rows = run.data.prompts_per_step * rollout.n
    if rows % algo.micro_batch_size:
        problems.append(f"{rows} responses a step do not split into micro-batches of {algo.micro_batch_size}")
    if problems:
        raise SystemExit("peer_trl: the TRL side cannot mirror this setting: " + "; ".join(problems))
    overlong = overlong_plugin(run)
    return {
        "prompts_per_step": int(run.data.prompts_per_step),
        "n": int(rollout.n),
        "max_new_tokens": int(rollout.max_new_tokens),
        "temperature": float(rollout.temperature),
        "top_p": float(rollout.top_p),
        "top_k": None,
        "rollout_backend": str(rollout.backend),
        "micro_batch_size": int(algo.micro_batch_size),
        "micro_batches": rows // int(algo.micro_batch_size),
        "clip_low": float(algo.clip_low),
        "clip_high": float(algo.clip_high),
        "kl_coef": float(algo.kl_coef),
        "lr": float(optim.optimizer.lr),
        "betas": [float(b) for b in optim.optimizer.betas or (0.9, 0.999)],  # null: AdamW's own
        "eps": float(optim.optimizer.eps or 1e-8),
        "weight_decay": float(optim.optimizer.weight_decay),
        "warmup_steps": int(optim.scheduler.warmup_steps),
        "grad_clip": float(optim.grad_clip),
        "overlong": None if overlong is None else {"buffer_length": int(overlong.buffer_length),
                                                   "penalty_factor": float(overlong.penalty_factor)},
        "grader": {"timeout_s": grader.timeout_s, "num_workers": grader.workers(),
                   "reasoning_end": grader.reasoning_end},
        "dtype": run.model.dtype,
        "seed": run.seed,
    }


def _versions() -> dict[str, str]:
    out = {}
    for name in ("torch", "transformers", "trl", "vllm"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # not installed in this interpreter's env
            pass
    return out


def _timed(values: list[float], warmup: int) -> list[float]:
    return [round(v, 4) for v in values[warmup:]]


# --------------------------------------------------------------------------- medsrl side


def worker_medsrl(args) -> dict:
    sys.path.insert(0, str(ROOT / "tests" / "helpers"))
    import lightning as L
    import torch

    from medsrl.train import build_run, train
    from run_helpers import read_metrics

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    cfg = compose(out, args.steps, shlex.split(args.medsrl_overrides))

    class StepStarts(L.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.starts.append(time.perf_counter())

    run = build_run(cfg)
    clock = StepStarts()
    run.trainer.callbacks.append(clock)
    train(cfg, run)
    rows = [m for _, m in sorted(read_metrics(out).items()) if "train/time/step" in m]
    return {
        "side": "medsrl",
        "step_s": [m["train/time/step"] for m in rows],
        "interval_s": [b - a for a, b in zip(clock.starts, clock.starts[1:], strict=False)],
        "response_length": [m["train/response_length"] for m in rows],
        "reward": [m["train/reward"] for m in rows],
        "acc": [m["train/acc"] for m in rows],
        "phases": {k.removeprefix("train/time/"): [m.get(k, 0.0) for m in rows]
                   for k in sorted({k for m in rows for k in m if k.startswith("train/time/")})},
        "threads": torch.get_num_threads(),
        "versions": _versions(),
    }


# --------------------------------------------------------------------------- TRL side


def check_tokenizer(auto_tok, medsrl_tok, texts: list[str]) -> None:
    """``AutoTokenizer`` must give medsrl's ids on the prompts, and the same special tokens."""
    a, m = auto_tok(texts)["input_ids"], medsrl_tok(texts)["input_ids"]
    bad = [i for i, (x, y) in enumerate(zip(a, m, strict=True)) if list(x) != list(y)]
    if bad:
        raise SystemExit(
            f"peer_trl: AutoTokenizer ({type(auto_tok).__name__}) and medsrl's tokenizer "
            f"({type(medsrl_tok).__name__}) give different ids on {len(bad)} of {len(texts)} prompts, "
            f"first {texts[bad[0]]!r}:\n  auto   {list(a[bad[0]])}\n  medsrl {list(m[bad[0]])}")
    for name in ("eos_token_id", "pad_token_id"):
        if getattr(auto_tok, name) != getattr(medsrl_tok, name):
            raise SystemExit(f"peer_trl: {name} differs: AutoTokenizer {getattr(auto_tok, name)}, "
                             f"medsrl {getattr(medsrl_tok, name)}")


@dataclass
class TrlSide:
    """What the TRL side hands ``GRPOTrainer``, built without trl (``--dry-run`` builds it too)."""

    settings: dict
    policy_dir: Path
    prompts: list
    tokenizer: Any
    model: Any
    grader: Any
    reward_funcs: list
    config: dict  # GRPOConfig's arguments
    optimizers: tuple


def reward_functions(s: dict, grader) -> list:
    """TRL's reward functions: medsrl's grader, plus DAPO's overlong penalty when it is on."""
    import torch

    from medsrl.methods.overlong import overlong_penalty

    def correct(prompts, completions, answer, **kwargs) -> list[float]:
        return [g.score for g in grader.grade_batch(completions, answer)]

    def overlong(prompts, completions, completion_ids, **kwargs) -> list[float]:
        lengths = torch.tensor([len(ids) for ids in completion_ids])
        return overlong_penalty(lengths, s["max_new_tokens"], s["overlong"]["buffer_length"],
                                s["overlong"]["penalty_factor"]).tolist()

    return [correct] if s["overlong"] is None else [correct, overlong]


def grpo_arguments(s: dict, steps: int, out: Path) -> dict:
    """``trl.GRPOConfig``'s arguments: the same work as the medsrl side (module docstring)."""
    accum = s["micro_batches"]
    return dict(
        output_dir=str(out / "trl"),
        max_steps=steps,
        per_device_train_batch_size=s["micro_batch_size"],
        gradient_accumulation_steps=accum,
        steps_per_generation=accum,  # one generation of prompts_per_step x n per optimizer step
        num_generations=s["n"],
        num_iterations=1,
        shuffle_dataset=False,
        max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"],
        top_p=s["top_p"],
        top_k=0,
        use_vllm=False,
        beta=0.0,
        loss_type="dapo",
        epsilon=s["clip_low"],
        epsilon_high=s["clip_high"],
        scale_rewards="group",
        max_grad_norm=s["grad_clip"],
        learning_rate=s["lr"],
        bf16=False,
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        logging_steps=1,  # per-step reward and length (medsrl logs every step too)
        seed=s["seed"],
    )


def medsrl_optimizers(model, s: dict) -> tuple:
    """medsrl's optimiser and schedule (RLModule.configure_optimizers): AdamW, linear warm-up to
    lr over warmup_steps RL steps, then constant."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=s["lr"], betas=tuple(s["betas"]), eps=s["eps"],
                                  weight_decay=s["weight_decay"])
    warmup = max(0, s["warmup_steps"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)
    return optimizer, scheduler


def trl_side(cfg, steps: int, out: Path) -> TrlSide:
    """The TRL side's policy, prompts, tokenizer, grader (started) and arguments, from medsrl's config."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from medsrl.data.datamodule import MathDataModule
    from medsrl.models.loading import load_tokenizer, resolve_dtype, stop_token_ids
    from medsrl.reward.grader import MathGrader
    from medsrl.run_config import RunConfig

    s = settings(cfg)
    path = policy_dir(cfg)
    datamodule = MathDataModule(RunConfig.parse(cfg).data)
    prompts = [p for step in range(steps) for p in datamodule.prompts_for_step(step)]
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    medsrl_tok = load_tokenizer(str(path))
    if tokenizer.pad_token is None:  # medsrl's choice, so both pad alike
        tokenizer.pad_token = medsrl_tok.pad_token
    check_tokenizer(tokenizer, medsrl_tok, [p.text for p in prompts])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(s["dtype"]))
    # medsrl's engines stop on every one of these; TRL stops on the model's eos ids
    model.generation_config.eos_token_id = stop_token_ids(medsrl_tok)
    # the grader medsrl's run builds (RLModule): workers resolved by the schema, not the raw null
    grader = MathGrader(**s["grader"]).start()
    return TrlSide(settings=s, policy_dir=path, prompts=prompts, tokenizer=tokenizer, model=model, grader=grader,
                   reward_funcs=reward_functions(s, grader), config=grpo_arguments(s, steps, out),
                   optimizers=medsrl_optimizers(model, s))


def worker_trl(args) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    out = Path(args.out)
    cfg = compose(out / "medsrl-config", args.steps, shlex.split(args.medsrl_overrides))
    side = trl_side(cfg, args.steps, out)

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.begin = 0.0
            self.starts: list[float] = []
            self.steps: list[float] = []
            self.logs: list[dict] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin = time.perf_counter()
            self.starts.append(self.begin)

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(time.perf_counter() - self.begin)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.logs.append(dict(logs))

    clock = Clock()
    dataset = Dataset.from_list([{"prompt": p.text, "answer": p.answer} for p in side.prompts])
    trainer = trl.GRPOTrainer(model=side.model, reward_funcs=side.reward_funcs, args=trl.GRPOConfig(**side.config),
                              train_dataset=dataset, processing_class=side.tokenizer, callbacks=[clock],
                              optimizers=side.optimizers)
    try:
        trainer.train()
    finally:
        side.grader.close()
    if len(clock.steps) != args.steps or len(clock.logs) != args.steps:
        raise SystemExit(f"peer_trl: TRL ran {len(clock.steps)} steps and logged {len(clock.logs)}, "
                         f"expected {args.steps}")
    return {
        "side": "trl",
        "step_s": clock.steps,
        "interval_s": [b - a for a, b in zip(clock.starts, clock.starts[1:], strict=False)],
        "response_length": [m["completions/mean_length"] for m in clock.logs],
        "reward": [m["reward"] for m in clock.logs],
        "acc": [m["rewards/correct/mean"] for m in clock.logs],
        "trl_step_time": [m.get("step_time") for m in clock.logs],
        "threads": torch.get_num_threads(),
        "versions": _versions(),
        "policy_dir": str(side.policy_dir),
        "settings": side.settings,
    }


# --------------------------------------------------------------------------- dry run


def trl_installed() -> bool:
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


def try_rewards(side: TrlSide) -> dict[str, list[float]]:
    """Each reward function on the first prompt's gold answer, boxed, and on an empty response."""
    p = side.prompts[0]
    completions = [f"\\boxed{{{p.answer}}}", ""]
    ids = [side.tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]
    return {f.__name__: f(prompts=[p.text] * 2, completions=completions, completion_ids=ids, answer=[p.answer] * 2)
            for f in side.reward_funcs}


def dry_run(args) -> dict:
    """Both sides built from the composed config, nothing trained (module docstring)."""
    tmp = Path(tempfile.mkdtemp(prefix="medsrl-peer-trl-dry-"))
    try:
        cfg = compose(tmp / "config", args.steps, shlex.split(args.medsrl_overrides))
        side = trl_side(cfg, args.steps, tmp)
        try:
            rewards = try_rewards(side)
        finally:
            side.grader.close()
        if trl_installed():
            import trl

            trl.GRPOConfig(**side.config)
        from medsrl.train import build_run

        run = build_run(cfg)
        return {"benchmark": "peer_trl", "dry_run": True, "settings": side.settings, "policy_dir": str(side.policy_dir),
                "prompts": len(side.prompts), "rewards": rewards, "grpo_config_built": trl_installed(),
                "medsrl_module": type(run.module).__name__, "versions": _versions()}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- orchestration


def run_side(side: str, python: str, args, tmp: Path, tag: str) -> dict:
    out = tmp / tag
    out.mkdir(parents=True)
    result = out / "result.json"
    cmd = [python, str(Path(__file__).resolve()), "--worker", side, "--out", str(out), "--result", str(result),
           "--steps", str(args.steps), "--medsrl-overrides", args.medsrl_overrides]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    src = str(ROOT / "src")
    env = {**os.environ, "MEDSRL_ROOT": str(ROOT), "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
           "PYTHONPATH": os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])}
    log = out / "log.txt"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0 or not result.is_file():
        tail = log.read_text()[-6000:]
        raise SystemExit(f"peer_trl: the {side} run failed (exit {proc.returncode}), log {log}:\n{tail}")
    return json.loads(result.read_text())


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4)}


def _mean(values: list[float]) -> float:
    return round(statistics.fmean(values), 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6, help="steps per run, warm-up included")
    ap.add_argument("--warmup", type=int, default=1, help="steps dropped at the start of each run")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on both sides (0: torch's default)")
    ap.add_argument("--medsrl-python", default=sys.executable, help="interpreter of the medsrl side")
    ap.add_argument("--medsrl-overrides", default="", help="extra Hydra overrides of the medsrl side, one string")
    ap.add_argument("--dry-run", action="store_true", help="build both sides, train nothing, print one JSON line")
    ap.add_argument("--worker", choices=["medsrl", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        result = (worker_medsrl if args.worker == "medsrl" else worker_trl)(args)
        Path(args.result).write_text(json.dumps(result))
        return
    if args.steps <= args.warmup:
        raise SystemExit("--steps must be larger than --warmup")
    if args.dry_run:
        print(json.dumps(dry_run(args)))
        return
    if not trl_installed():
        raise SystemExit("peer_trl: trl is not installed here; run it in .venv-trl (make bench-trl)")

    tmp = Path(tempfile.mkdtemp(prefix="medsrl-peer-trl-"))
    cfg = compose(tmp / "config", args.steps, shlex.split(args.medsrl_overrides))
    work = settings(cfg)
    path = policy_dir(cfg)  # build the warm start now, outside every timed run
    print(f"[peer_trl] policy {path}; runs under {tmp}", file=sys.stderr)

    sides = ["medsrl", "trl"]
    # absolute but not resolved: a venv's python is a symlink, and resolving it leaves the venv
    pythons = {"medsrl": os.path.abspath(args.medsrl_python) if os.sep in args.medsrl_python else args.medsrl_python,
               "trl": sys.executable}
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            res = run_side(side, pythons[side], args, tmp, f"round{r}_{side}")
            runs[side].append(res)
            timed = _timed(res["step_s"], args.warmup)
            print(f"[peer_trl] round {r} {side}: median {statistics.median(timed):.3f} s/step "
                  f"({', '.join(f'{t:.2f}' for t in timed)}), response length "
                  f"{_mean(res['response_length'][args.warmup:]):.1f}, reward {_mean(res['reward'][args.warmup:]):.3f}",
                  file=sys.stderr)

    med = {side: [statistics.median(_timed(x["step_s"], args.warmup)) for x in runs[side]] for side in sides}
    ratios = [a / b for a, b in zip(med["medsrl"], med["trl"], strict=True)]
    pooled = {side: [t for x in runs[side] for t in _timed(x["step_s"], args.warmup)] for side in sides}
    intervals = {side: [t for x in runs[side] for t in _timed(x["interval_s"], args.warmup)] for side in sides}
    per_side = {}
    for side in sides:
        per_side[side] = {
            key: _mean([v for run in runs[side] for v in run[key][args.warmup:]])
            for key in ("response_length", "reward", "acc")
        }
    lengths = per_side["medsrl"]["response_length"], per_side["trl"]["response_length"]
    length_gap = abs(lengths[0] - lengths[1]) / max(min(lengths), 1e-9)
    threads = {side: sorted({x["threads"] for x in runs[side]}) for side in sides}

    print("\nround  medsrl s/step  TRL s/step  medsrl/TRL")
    for r in range(args.rounds):
        print(f"{r:>5}  {med['medsrl'][r]:>13.3f}  {med['trl'][r]:>10.3f}  {ratios[r]:>10.3f}")
    print(f"median step: medsrl {statistics.median(pooled['medsrl']):.3f} s, "
          f"TRL {statistics.median(pooled['trl']):.3f} s; "
          f"ratio medsrl/TRL {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
    if intervals["medsrl"] and intervals["trl"]:
        print("between step starts (framework overhead included): "
              f"medsrl {statistics.median(intervals['medsrl']):.3f} s, "
              f"TRL {statistics.median(intervals['trl']):.3f} s")
    for side in sides:
        p = per_side[side]
        print(f"{side:>6}: mean response length {p['response_length']:.2f} tokens, mean reward {p['reward']:.4f}, "
              f"accuracy {p['acc']:.4f}, torch threads {threads[side]}")
    if length_gap > LENGTH_TOLERANCE:
        print(f"WARNING: mean response lengths differ by {100 * length_gap:.0f} % (> {100 * LENGTH_TOLERANCE:.0f} %): "
              "the two sides may not be doing the same work", file=sys.stderr)
    if threads["medsrl"] != threads["trl"]:
        print(f"WARNING: torch threads differ: medsrl {threads['medsrl']}, TRL {threads['trl']}", file=sys.stderr)

    medsrl_phases = {
        k: round(statistics.median([v for run in runs["medsrl"] for v in run["phases"][k][args.warmup:]]), 4)
        for k in runs["medsrl"][0]["phases"]
    }
    print(json.dumps({
        "benchmark": "peer_trl",
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "rounds": args.rounds,
        "steps_per_run": args.steps,
        "warmup_steps_dropped": args.warmup,
        "threads": threads,
        "versions": {side: runs[side][0]["versions"] for side in sides},
        "medsrl_python": pythons["medsrl"],
        "medsrl_overrides": shlex.split(args.medsrl_overrides),
        "settings": work,
        "policy_dir": str(path),
        "seconds_per_step_per_round": {side: [round(v, 4) for v in med[side]] for side in sides},
        "seconds_per_step": {side: _spread(pooled[side]) for side in sides},
        "seconds_between_step_starts": {side: _spread(v) for side, v in intervals.items() if v},
        "ratio_medsrl_over_trl_per_round": [round(x, 4) for x in ratios],
        "ratio_medsrl_over_trl": _spread(ratios),
        "medsrl_phase_seconds_median": medsrl_phases,
        "trl_own_step_time_median": round(statistics.median(
            [t for run in runs["trl"] for t in run["trl_step_time"][args.warmup:] if t is not None]
            or [float("nan")]), 4),
        "mean_response_length": {side: p["response_length"] for side, p in per_side.items()},
        "mean_reward": {side: p["reward"] for side, p in per_side.items()},
        "mean_accuracy": {side: p["acc"] for side, p in per_side.items()},
        "response_length_gap": round(length_gap, 4),
    }))


if __name__ == "__main__":
    main()
