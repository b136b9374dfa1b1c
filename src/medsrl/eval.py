"""Evaluation entry point (``medsrl-eval``): pass@k, mean@n, maj@n and diversity on benchmarks.

Writes ``generations.jsonl`` (every graded response, appended: rerunning into the same directory
resumes), ``results.md`` / ``.csv`` / ``.json`` (a row per model and benchmark) and ``pass_at_k.png``.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import logging
import os
from pathlib import Path

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from medsrl.data.loaders import default_name
from medsrl.data.settings import Source
from medsrl.data.sources import set_data_dir_default
from medsrl.evaluation.progress import BenchmarkBar, shows_progress
from medsrl.evaluation.responses import SamplingSpec, problems_from, sample_problems, summarize_records
from medsrl.evaluation.store import GenerationStore
from medsrl.evaluation.tables import plot_pass_at_k, write_csv, write_json, write_markdown
from medsrl.export import checkpoint_policy
from medsrl.features.reader import FeatureSpec
from medsrl.methods.meds.plugin import Meds
from medsrl.models.checkpoint_files import is_checkpoint_path
from medsrl.models.loading import load_policy, load_tokenizer
from medsrl.rollout.factory import build_engine, engine_max_model_len, model_positions
from medsrl.rollout.settings import RolloutConfig
from medsrl.run_config import CONFIG_DIR, EvalRunConfig
from medsrl.settings import parse, settings_model

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("MEDSRL_ROOT", str(ROOT))  # configs/paths: root_dir
set_data_dir_default(Path(os.environ["MEDSRL_ROOT"]))  # configs/paths: data_dir on a clone without ../shared


def load_for_eval(model_path: str, tokenizer: str | None, dtype: str):
    """``(policy, tokenizer)`` from an HF dir/name or a run's checkpoint (file or sharded)."""
    if not is_checkpoint_path(model_path):
        return load_policy(model_path, dtype=dtype), load_tokenizer(tokenizer or model_path)
    policy, tok = checkpoint_policy(model_path, dtype=dtype)
    return policy, load_tokenizer(tokenizer) if tokenizer else tok


def _run_of(path: Path) -> Path | None:
    """The run directory of ``<run>/policy`` or ``<run>/checkpoints/*.ckpt``, else None."""
    if path.name == "policy":
        return path.parent
    if path.suffix == ".ckpt" and path.parent.name == "checkpoints":
        return path.parent.parent
    return None


def run_name(path: str | Path) -> str:
    """A short row label: ``<run>`` for ``<run>/policy``, ``<run>/x`` for a checkpoint ``x``."""
    p = Path(path)
    run = _run_of(p)
    if run is None:
        return p.name if p.exists() else str(path)
    return run.name if p.name == "policy" else f"{run.name}/{p.stem}"


def runs_in(runs_dir: str | Path) -> list[tuple[str, str]]:
    """``(name with its Hydra overrides, model path)`` of every run with a model under a (multi)run dir."""
    found = []
    for d in sorted(Path(runs_dir).iterdir(), key=lambda p: (len(p.name), p.name)):
        if (d / "policy" / "config.json").exists():
            path = d / "policy"
        elif (d / "checkpoints" / "last.ckpt").exists():
            path = d / "checkpoints" / "last.ckpt"
        else:
            continue
        overrides = d / ".hydra" / "overrides.yaml"
        items = [str(x) for x in OmegaConf.load(overrides)] if overrides.exists() else []
        found.append((f"{d.name}: {' '.join(items)}" if items else d.name, str(path)))
    if not found:
        raise FileNotFoundError(f"{runs_dir}: no run with a policy/ export or checkpoints/last.ckpt")
    return found


def models_to_evaluate(run: EvalRunConfig) -> list[tuple[str, str]]:
    """``(row name, model path)`` of ``model_path`` (one, a list, or ``{name: path}``) and ``runs_dir``."""
    paths = run.model_path
    if isinstance(paths, dict):
        models = [(str(name), str(path)) for name, path in paths.items()]
    else:
        paths = [] if paths is None else paths if isinstance(paths, list) else [paths]
        models = [(run_name(p), str(p)) for p in paths]
    if run.runs_dir:
        models += runs_in(run.runs_dir)
    if not models:
        raise ValueError("nothing to evaluate: set model_path=<dir|name|.ckpt> (or a list, or {name: path}) "
                         "or runs_dir=<multirun dir>")
    names = [m[0] for m in models]
    if len(set(names)) != len(names):
        models = [(f"{i}:{name}", path) for i, (name, path) in enumerate(models)]
    return models


def feature_spec_for(model_path: str | Path, default: FeatureSpec | None) -> FeatureSpec | None:
    """Its training run's MEDS feature when it has one (diversity on the feature it was shaped with),
    else ``default``; ``default=None`` (``features: null``): none."""
    if default is None:
        return None
    run = _run_of(Path(model_path))
    run_config = run / ".hydra" / "config.yaml" if run is not None else None
    meds = OmegaConf.select(OmegaConf.load(run_config), "algorithm.plugins.meds") if (
        run_config is not None and run_config.is_file()) else None
    if not isinstance(meds, DictConfig):
        log.info("features of %s: %s (eval's features)", model_path, default)
        return default
    values = {k: v for k, v in OmegaConf.to_container(meds, resolve=True).items() if k != "_target_"}
    try:
        spec = parse(settings_model(Meds), values, "algorithm.plugins.meds").features
    except ValueError as err:
        raise ValueError(f"{run_config}, the MEDS feature of {model_path}: {err}") from None
    log.info("features of %s: %s (the MEDS settings of its training run, %s)", model_path, spec, run_config)
    return spec


def benchmark_name(key: str, source: Source) -> str:
    """A benchmark's row label: its ``name``, else its file's (``/x/aime25/test.jsonl``: aime25), else its key."""
    return source.name or (default_name(source.path) if source.path else key)


def build_benchmarks(run: EvalRunConfig) -> dict[str, list]:
    """``{label: examples}`` cut to ``limit``, before any model loads: an empty benchmark fails here."""
    benchmarks: dict[str, list] = {}
    keys: dict[str, str] = {}
    for key, source in run.benchmark.items():
        name = benchmark_name(key, source)
        if name in keys:
            raise ValueError(f"benchmarks {keys[name]!r} and {key!r} are both named {name!r}; "
                             f"set benchmark.{key}.name to tell their rows apart")
        keys[name] = key
        node = source.model_dump(exclude_unset=True)
        examples = list(instantiate(node, _convert_="object"))
        if not examples:
            raise ValueError(f"benchmark {name!r} (benchmark.{key}, {node.get('_target_')}) has no problems")
        benchmarks[name] = examples[: run.limit]  # limit null: all
        log.info("benchmark %s: %d problems", name, len(benchmarks[name]))
    return benchmarks


def choose_backend(backend: str | None, device: str) -> tuple[str, str]:
    """The engine and why: ``rollout=hf|vllm``; unset, vLLM on CUDA when installed (hours, not days)."""
    if backend is not None:
        return backend, f"rollout={backend}"
    if not str(device).startswith("cuda"):
        return "hf", f"no rollout chosen, device {device}"
    if importlib.util.find_spec("vllm") is None:
        return "hf", "no rollout chosen, vllm not installed"
    return "vllm", f"no rollout chosen, device {device} and vllm installed"


def check_prompts_fit(lengths: dict[str, list[int]], engine_cfg: RolloutConfig, policy,
                      max_new_tokens: int) -> None:
    """Refuse, before sampling, a prompt with no room for ``max_new_tokens`` in the engine's length:
    eval keeps every problem, and vLLM would refuse it mid-run, HF generate past the positions."""
    if engine_cfg.backend == "vllm" and engine_cfg.vllm.max_model_len is not None:
        limit, what = engine_cfg.vllm.max_model_len, "rollout.vllm.max_model_len"
    else:
        limit, what = model_positions(policy), "the model's positions (max_position_embeddings)"
    over = [(bench, i, n) for bench, ns in lengths.items() for i, n in enumerate(ns)
            if limit is not None and n + max_new_tokens > limit]
    if not over:
        return

    def named(b: str, i: int, n: int) -> str:
        return f"benchmark {b!r} problem {i}: {n} prompt tokens"

    longest = max(over, key=lambda o: o[2])
    listed = "; ".join(named(*o) for o in over[:5]) + (f"; ... ({len(over) - 5} more)" if len(over) > 5 else "")
    room = limit - longest[2]
    fix = (f"set max_new_tokens <= {room}, which every prompt leaves room for" if room >= 1
           else "leave that benchmark out: its prompt alone fills the length")
    raise ValueError(
        f"{len(over)} benchmark prompt(s) + max_new_tokens={max_new_tokens} exceed {what}, {limit} "
        f"tokens ({engine_cfg.backend} engine): {listed}. The longest: {named(*longest)}. Every "
        f"problem is evaluated, so {fix}"
    )


def engine_fingerprint(engine_cfg: RolloutConfig, policy) -> dict:
    """What of the engine decides the samples: nothing for HF (older evaluations still resume)."""
    if engine_cfg.backend == "hf":
        return {}
    dtype = engine_cfg.vllm.dtype
    if dtype == "auto":  # the engine runs in the policy's dtype (rollout/vllm.py)
        dtype = str(next(policy.parameters()).dtype).removeprefix("torch.")
    return {"engine": {"backend": engine_cfg.backend, "dtype": dtype,
                       "per_request_seeds": engine_cfg.vllm.per_request_seeds}}


class EngineOnDemand:
    """A model's engine, built at the first chunk to sample: a fully stored resume starts no vLLM."""

    def __init__(self, build) -> None:
        self.build, self.engine = build, None

    def generate(self, prompts, params):
        if self.engine is None:
            self.engine = self.build()
        return self.engine.generate(prompts, params)

    def close(self) -> None:
        if self.engine is not None and hasattr(self.engine, "close"):
            self.engine.close()
        self.engine = None


def evaluate_model(cfg: EvalRunConfig, run: str, path: str, benchmarks: dict[str, list], backend: str,
                   device: str, store: GenerationStore, grader) -> list[dict]:
    """One model's rows, every benchmark through one engine closed at the end (vLLM's state is global)."""
    policy, tok = load_for_eval(path, cfg.tokenizer, cfg.dtype)
    problems = {bench: problems_from(ex, cfg.template, tok) for bench, ex in benchmarks.items()}
    lengths = {bench: [len(ids) for ids in tok([p.text for p in ps])["input_ids"]] if ps else []
               for bench, ps in problems.items()}
    engine_cfg = RolloutConfig(backend=backend, max_new_tokens=cfg.max_new_tokens, max_batch_size=cfg.batch_size,
                               max_prompt_tokens=max(max(ns, default=1) for ns in lengths.values()),
                               vllm=cfg.rollout.vllm)
    check_prompts_fit(lengths, engine_cfg, policy, cfg.max_new_tokens)
    sampling: SamplingSpec = cfg.model_copy(update={"features": feature_spec_for(path, cfg.features)})
    # on the device for HF generate or the features' forward; vLLM alone reads it from host memory
    policy.to(device if backend == "hf" or sampling.features is not None else "cpu").eval()
    extra = {"template": cfg.template.model_dump(), "limit": cfg.limit, **engine_fingerprint(engine_cfg, policy)}
    if backend == "vllm":
        log.info("vLLM for %s: max_model_len %s (longest prompt %d + max_new_tokens %d, at most the "
                 "model's positions, or rollout.vllm.max_model_len)", run, engine_max_model_len(engine_cfg, policy),
                 engine_cfg.max_prompt_tokens, cfg.max_new_tokens)
    engine = EngineOnDemand(functools.partial(build_engine, engine_cfg, policy, tok, seed=cfg.seed))
    rows = []
    try:
        for bench, ps in problems.items():
            bar = BenchmarkBar(f"{run} / {bench}", len(ps), cfg.n, shows_progress(cfg.quiet))
            try:
                records = sample_problems(policy, tok, engine, grader, ps, sampling, run=run, benchmark=bench,
                                          store=store, fingerprint=sampling.fingerprint(path, bench, **extra), bar=bar)
            finally:
                bar.close()
            row = summarize_records(run, bench, records)
            rows.append(row)
            log.info("%s / %s: pass@1 %.4f, pass@%d %.4f", run, bench, row["pass@1"], cfg.n, row[f"pass@{cfg.n}"])
    finally:
        engine.close()
    return rows


def evaluate(cfg: DictConfig) -> list[dict]:
    """Every model on every benchmark; all that needs no model is checked first: a mistake loads none."""
    parsed = EvalRunConfig.parse(cfg)
    out_dir = Path(parsed.paths.output_dir)
    benchmarks = build_benchmarks(parsed)
    models = models_to_evaluate(parsed)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = parsed.device if parsed.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    backend, why = choose_backend(parsed.rollout.backend, device)
    log.info("engine: %s (%s)", backend, why)
    rows = []
    with (
        GenerationStore(out_dir / "generations.jsonl") as store,
        parsed.grader.grader(parsed.grader.workers()) as grader,
    ):
        for run, path in models:
            rows += evaluate_model(parsed, run, path, benchmarks, backend, device, store, grader)
            gc.collect()  # the model's and its engine's memory, before the next model loads
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    write_markdown(rows, out_dir / "results.md")
    write_csv(rows, out_dir / "results.csv")
    write_json(rows, out_dir / "results.json")
    plot_pass_at_k(rows, out_dir / "pass_at_k.png")
    print((out_dir / "results.md").read_text())
    print(f"[medsrl] results in {out_dir} (results.md / .csv / .json, pass_at_k.png, generations.jsonl)")
    return rows


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="eval")
def main(cfg: DictConfig) -> float:
    rows = evaluate(cfg)
    return float(sum(r["pass@1"] for r in rows) / len(rows))


if __name__ == "__main__":
    main()

