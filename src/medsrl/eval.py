"""Evaluation entry point (``medsrl-eval``): pass@k, mean@n, maj@n and diversity on benchmarks.

Models: ``model_path`` (an exported Hugging Face directory, a model name or a training run's
``.ckpt``; one, a list, or ``{row name: path}``) and/or ``runs_dir`` (a multirun directory: each
run's exported policy, else its ``last.ckpt``). Benchmarks: the ``benchmark`` config group
(``benchmark=[math500,aime24]``). MEDS features (for the diversity columns): a model from a
training run with the MEDS plug-in gets that run's feature settings, any other model eval's
``features`` (:func:`feature_spec_for`).

Writes into the output directory: ``generations.jsonl`` (every response with its grade and MEDS
feature, appended as produced; rerunning into the same directory resumes), ``results.md`` /
``.csv`` / ``.json`` (one row per run and benchmark) and ``pass_at_k.png``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("MEDSRL_ROOT", str(ROOT))
CONFIG_DIR = str(ROOT / "configs")

import hydra  # noqa: E402
import torch  # noqa: E402
from hydra.utils import instantiate  # noqa: E402
from omegaconf import DictConfig, ListConfig, OmegaConf  # noqa: E402

from medsrl.config import GraderConfig, check_eval_config  # noqa: E402
from medsrl.data.loaders import default_name  # noqa: E402
from medsrl.evaluation.responses import (  # noqa: E402
    EvalSettings,
    problems_from,
    sample_problems,
    summarize_records,
)
from medsrl.evaluation.store import GenerationStore  # noqa: E402
from medsrl.evaluation.tables import (  # noqa: E402
    plot_pass_at_k,
    write_csv,
    write_json,
    write_markdown,
)
from medsrl.methods.meds.features import FeatureSpec  # noqa: E402
from medsrl.models.loading import load_policy, load_tokenizer  # noqa: E402
from medsrl.reward.grader import MathGrader  # noqa: E402
from medsrl.rollout.hf import HFRolloutEngine  # noqa: E402

log = logging.getLogger(__name__)


def load_for_eval(model_path: str, tokenizer: str | None, dtype: str):
    """``(policy, tokenizer)`` from an HF dir/name or a training run's ``.ckpt``."""
    if str(model_path).endswith(".ckpt"):
        from medsrl.models.policy import build_policy

        ckpt = Path(model_path)
        run_cfg = ckpt.parent.parent / ".hydra" / "config.yaml"
        if not run_cfg.exists():
            raise FileNotFoundError(
                f"{ckpt}: cannot rebuild the model, {run_cfg} (the run's Hydra config) is missing; "
                "evaluate the exported policy directory instead"
            )
        cfg = OmegaConf.load(run_cfg)
        model_cfg = OmegaConf.to_container(cfg.model, resolve=False)
        policy, tok = build_policy(model_cfg)  # the architecture: the checkpoint holds every weight
        state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
        policy.load_state_dict(
            {k.removeprefix("policy."): v for k, v in state.items() if k.startswith("policy.")}
        )
        return policy, tok
    return load_policy(model_path, dtype=dtype), load_tokenizer(tokenizer or model_path)


def run_name(path: str | Path) -> str:
    """A short row label: the run directory of ``<run>/policy`` and ``<run>/checkpoints/x.ckpt``."""
    p = Path(path)
    if p.name == "policy":
        return p.parent.name
    if p.suffix == ".ckpt" and p.parent.name == "checkpoints":
        return f"{p.parent.parent.name}/{p.stem}"
    return str(path) if not p.exists() else p.name


def runs_in(runs_dir: str | Path) -> list[tuple[str, str]]:
    """``(name, model path)`` of every run under a (multi)run directory, in name order.

    A run is a directory with a ``policy/`` export or a ``checkpoints/last.ckpt``; its name
    carries the Hydra overrides that distinguish it (``0: optim.lr=1e-5``).
    """
    found = []
    for d in sorted(Path(runs_dir).iterdir(), key=lambda p: (len(p.name), p.name)):
        if (d / "policy" / "config.json").exists():
            path = d / "policy"
        elif (d / "checkpoints" / "last.ckpt").exists():
            path = d / "checkpoints" / "last.ckpt"
        else:
            continue
        overrides = d / ".hydra" / "overrides.yaml"
        label = d.name
        if overrides.exists():
            items = [str(x) for x in OmegaConf.load(overrides)]
            label += (": " + " ".join(items)) if items else ""
        found.append((label, str(path)))
    if not found:
        raise FileNotFoundError(
            f"{runs_dir}: no run with a policy/ export or checkpoints/last.ckpt"
        )
    return found


def models_to_evaluate(cfg: DictConfig) -> list[tuple[str, str]]:
    """``(row name, model path)`` pairs: ``model_path`` (one, a list, or ``{name: path}``) and the
    runs of ``runs_dir``."""
    paths = cfg.model_path
    if isinstance(paths, DictConfig):
        models = [(str(name), str(path)) for name, path in paths.items()]
    else:
        paths = [] if paths is None else list(paths) if isinstance(paths, ListConfig) else [paths]
        models = [(run_name(p), str(p)) for p in paths]
    if cfg.runs_dir:
        models += runs_in(cfg.runs_dir)
    if not models:
        raise ValueError(
            "nothing to evaluate: set model_path=<dir|name|.ckpt> (or a list, or {name: path}) "
            "or runs_dir=<multirun dir>"
        )
    names = [m[0] for m in models]
    if len(set(names)) != len(names):
        models = [(f"{i}:{name}", path) for i, (name, path) in enumerate(models)]
    return models


def feature_spec_from(features: DictConfig | dict | None) -> FeatureSpec | None:
    """eval.yaml's ``features`` mapping as a :class:`FeatureSpec`; null: no features."""
    if features is None:
        return None
    if isinstance(features, DictConfig):
        given = OmegaConf.to_container(features, resolve=True)
    else:
        given = dict(features)
    valid = [f.name for f in dataclasses.fields(FeatureSpec)]
    unknown = sorted(set(given) - set(valid))
    if unknown:
        raise ValueError(f"features: unknown keys {unknown}; valid: {', '.join(valid)}")
    return FeatureSpec(**given)


def training_run_dir(model_path: str | Path) -> Path | None:
    """The run a model comes from (``<run>/policy`` or ``<run>/checkpoints/*.ckpt``) when that
    run kept its Hydra config (``<run>/.hydra/config.yaml``); ``None`` otherwise."""
    p = Path(model_path)
    if p.name == "policy":
        run = p.parent
    elif p.suffix == ".ckpt" and p.parent.name == "checkpoints":
        run = p.parent.parent
    else:
        return None
    return run if (run / ".hydra" / "config.yaml").is_file() else None


# Where a training config keeps the MEDS settings: the plug-in, then the layout before plug-ins.
_MEDS_KEYS = ("algorithm.plugins.meds", "algorithm.meds")


def _meds_settings(run_config: Path) -> DictConfig | None:
    """The MEDS node of a training run's config, ``None`` when the run had no MEDS."""
    cfg = OmegaConf.load(run_config)
    for key in _MEDS_KEYS:
        node = OmegaConf.select(cfg, key)
        if isinstance(node, DictConfig):
            return node
    return None


def feature_spec_for(model_path: str | Path, default: FeatureSpec | None) -> FeatureSpec | None:
    """The features to compute for a model: its training run's MEDS settings when it has them
    (so its diversity is measured on the feature it was shaped with), else ``default``.

    ``default=None`` (eval's ``features: null``) turns features off for every model. Keys the
    run's config leaves out take the plug-in's defaults (those of :class:`FeatureSpec`).
    """
    if default is None:
        return None
    run = training_run_dir(model_path)
    meds = _meds_settings(run / ".hydra" / "config.yaml") if run is not None else None
    if meds is None:
        log.info("features of %s: %s (eval's features)", model_path, default)
        return default
    plugin = FeatureSpec()
    spec = FeatureSpec(
        layers=_plain(meds.get("layers", plugin.layers)),
        diff=meds.get("diff", plugin.diff),
        final_norm=meds.get("final_norm", plugin.final_norm),
        dtype=meds.get("feature_dtype", plugin.dtype),
    )
    log.info(
        "features of %s: %s (the MEDS settings of its training run, %s)",
        model_path,
        spec,
        run / ".hydra" / "config.yaml",
    )
    return spec


def _plain(value):
    """A config value as plain Python (a ListConfig of layers becomes a list)."""
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, ListConfig) else value


def settings_from(cfg: DictConfig) -> EvalSettings:
    return EvalSettings(
        n=cfg.n,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_new_tokens=cfg.max_new_tokens,
        seed=cfg.seed,
        batch_size=cfg.batch_size,
        features=feature_spec_from(cfg.features),
        extra={"template": OmegaConf.to_container(cfg.template, resolve=True), "limit": cfg.limit},
    )


def benchmark_name(key: str, source: DictConfig | dict) -> str:
    """The label of a benchmark's rows: its ``name`` key when set; for a file without one, the
    file's name as the loader names it (``/x/aime25.jsonl`` and ``/x/aime25/test.jsonl`` ->
    ``aime25``), so ``benchmark=file`` rows say which file; else its config key."""
    name = source.get("name")
    if name:
        return str(name)
    path = source.get("path")
    return default_name(path) if path else str(key)


def build_benchmarks(cfg: DictConfig) -> dict[str, list]:
    """``{label: examples}`` of every benchmark, cut to ``limit``. Built before any model loads:
    a benchmark without problems fails here (a file names its path), not in the report."""
    benchmarks: dict[str, list] = {}
    keys: dict[str, str] = {}
    for key, source in cfg.benchmark.items():
        name = benchmark_name(str(key), source)
        if name in keys:
            raise ValueError(
                f"benchmarks {keys[name]!r} and {key!r} are both named {name!r}; "
                f"set benchmark.{key}.name to tell their rows apart"
            )
        keys[name] = str(key)
        examples = list(instantiate(source))
        if not examples:
            raise ValueError(f"benchmark {name!r} (benchmark.{key}, {source.get('_target_')}) has no problems")
        benchmarks[name] = examples if cfg.limit is None else examples[: cfg.limit]
        log.info("benchmark %s: %d problems", name, len(benchmarks[name]))
    return benchmarks


def evaluate(cfg: DictConfig) -> list[dict]:
    """Evaluate every model on every benchmark; write the generations, tables and plot.

    Everything that can be checked without a model is checked first (the config's values, the
    benchmarks' problems, the models' paths), so a mistake costs no model load."""
    check_eval_config(cfg)
    out_dir = Path(cfg.paths.output_dir)
    settings = settings_from(cfg)
    template = settings.extra["template"]
    benchmarks = build_benchmarks(cfg)
    models = models_to_evaluate(cfg)
    grader_cfg = GraderConfig.model_validate(OmegaConf.to_container(cfg.grader, resolve=True))
    out_dir.mkdir(parents=True, exist_ok=True)
    device = cfg.device if cfg.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    with (
        GenerationStore(out_dir / "generations.jsonl") as store,
        MathGrader(timeout_s=grader_cfg.timeout_s, num_workers=grader_cfg.workers(),
                   reasoning_end=grader_cfg.reasoning_end).start() as grader,
    ):
        for run, path in models:
            policy, tok = load_for_eval(path, cfg.tokenizer, cfg.dtype)
            policy.to(device).eval()
            engine = HFRolloutEngine(policy, tok, max_batch_size=cfg.batch_size)
            # Per model: its run's MEDS feature when it has one (part of the fingerprint).
            model_settings = dataclasses.replace(
                settings, features=feature_spec_for(path, settings.features)
            )
            for bench, examples in benchmarks.items():
                records = sample_problems(
                    policy,
                    tok,
                    engine,
                    grader,
                    problems_from(examples, template, tok),
                    model_settings,
                    run=run,
                    benchmark=bench,
                    store=store,
                    fingerprint=model_settings.fingerprint(path, bench),
                )
                row = summarize_records(run, bench, records)
                rows.append(row)
                log.info(
                    "%s / %s: pass@1 %.4f, pass@%d %.4f",
                    run,
                    bench,
                    row["pass@1"],
                    cfg.n,
                    row[f"pass@{cfg.n}"],
                )
            del policy, engine
    write_markdown(rows, out_dir / "results.md")
    write_csv(rows, out_dir / "results.csv")
    write_json(rows, out_dir / "results.json")
    plot_pass_at_k(rows, out_dir / "pass_at_k.png")
    print((out_dir / "results.md").read_text())
    print(
        f"[medsrl] results in {out_dir} "
        "(results.md / .csv / .json, pass_at_k.png, generations.jsonl)"
    )
    return rows


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="eval")
def main(cfg: DictConfig) -> float:
    rows = evaluate(cfg)
    return float(sum(r["pass@1"] for r in rows) / len(rows))


if __name__ == "__main__":
    main()

