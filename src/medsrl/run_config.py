"""A run's config, parsed once: the entry points (``train``, ``eval``, ``plan``, the study)
turn the composed Hydra config into one typed :class:`RunConfig` (or :class:`EvalRunConfig`)
and pass its sections on; nothing below reads a raw config key. Each section's schema lives
with its package (``algo/settings.py``, ``rollout/settings.py``, ...); this module composes them
and adds the checks that span sections. A bad config raises one ``ValueError`` listing every
problem by its Hydra key, before any model loads."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Annotated, Any, Literal

from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel, Field, PrivateAttr, ValidationError

from medsrl.algo.settings import AlgorithmConfig
from medsrl.data.settings import DataConfig, Source
from medsrl.data.template import PromptTemplate
from medsrl.evaluation.responses import SamplingSpec
from medsrl.models.settings import ModelConfig, ModelDtype
from medsrl.plugins import Plugin
from medsrl.reward.settings import GraderConfig
from medsrl.rollout.settings import BACKENDS, RolloutConfig, VLLMConfig
from medsrl.settings import (
    Flag,
    Open,
    Positive,
    PositiveInt,
    Seed,
    Settings,
    Text,
    bound_problems,
    help_of,
    lookup,
    message,
    must,
    nullable,
    one_of,
    plain,
    settings_model,
)
from medsrl.step.settings import OptimConfig

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"

# --------------------------------------------------------------------------- sections


class Hardware(Settings):
    """What an experiment is sized for (medsrl-plan checks its memory per GPU against it)."""

    name: Text = ""
    gpu_memory_gib: Positive


class TrainerSettings(Open):
    """Lightning's ``Trainer`` (Hydra instantiates it): the keys medsrl reads; the others are
    Lightning's to check. Defaults: the CPU preset's."""

    accelerator: Text = "cpu"
    """Lightning's accelerator (cpu, gpu, auto)."""
    devices: Annotated[int | str | list[int], must("an int, 'auto' or a list of device indices")] = 1
    """Devices per node: a count, auto, or a list of indices."""
    num_nodes: PositiveInt = 1
    """Machines; the devices of each."""
    strategy: Any = "auto"
    """A name, or a node with a _target_ (trainer=fsdp)."""
    precision: Annotated[str | int, must("a Lightning precision (32-true, bf16-mixed, ...)")] = "32-true"
    """Lightning precision: 32-true, or bf16-mixed over fp32 master weights (GPU presets)."""
    max_steps: Annotated[PositiveInt | Literal[-1], must("an int >= 1 or -1")] = -1
    """-1: no limit."""
    log_every_n_steps: PositiveInt = 1
    """Logging interval in RL steps."""
    enable_progress_bar: Flag = True
    """False: no progress bar at all."""


class Paths(Open):
    cache_dir: nullable(Text) = None
    output_dir: nullable(Text) = None
    data_dir: nullable(Text) = None


class AlgorithmSection(AlgorithmConfig):
    plugins: dict[str, Any] | None = {}
    """The plug-ins, in order: {name: {_target_: class, its settings}}; each checked by its class."""


# --------------------------------------------------------------------------- instantiated classes


def _class(target: Any) -> type | None:
    """The class a ``_target_`` names, or None when it cannot be imported."""
    if not isinstance(target, str) or "." not in target:
        return None
    module, name = target.rsplit(".", 1)
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def instantiated(node: dict, where: str, run: dict, base: type | None = None) -> tuple[Any, list[str]]:
    """``(the class's settings, problems)`` of a ``{_target_: class, settings}`` node: its
    settings checked against the class's annotated ``__init__`` (:func:`settings_model`);
    ``base``: the class it must be."""
    cls, kind = _class(node["_target_"]), "a medsrl Plugin" if base is Plugin else "an importable"
    if cls is None or (base is not None and not (isinstance(cls, type) and issubclass(cls, base))):
        return None, [f"{where}._target_ must be {kind} class, got {node['_target_']!r}"]
    try:
        schema = settings_model(cls)
    except Exception:  # an annotation pydantic cannot check (a library's class): Hydra builds it
        return None, []
    values = {k: v for k, v in node.items() if not k.startswith("_")}
    try:
        settings = schema.model_validate(values)
    except ValidationError as err:
        return None, [message(schema, e, where, cls.__name__) for e in err.errors()]
    return (cls, settings), bound_problems(settings, where, run)


def _nodes(section: Any, group: str) -> dict[str, dict]:
    """The entries of a group of named ``_target_`` nodes. A null entry is not built, nor one
    without ``_target_``: settings an experiment gives a plug-in this run does not choose."""
    nodes = {}
    for name, node in (section or {}).items() if isinstance(section, dict) else ():
        if isinstance(node, dict) and "_target_" in node:
            nodes[str(name)] = node
        elif node is not None:
            log.warning("%s.%s has settings but no _target_: not built in this run, ignored", group, name)
    return nodes


# --------------------------------------------------------------------------- the training run


class RunConfig(Open):
    """The training config (configs/train.yaml and its groups)."""

    seed: Seed = 42
    """The run's seed: sampling, data order, plug-ins and the model's initialisation."""
    resume_mode: one_of(("full", "weights")) = "full"
    """full: weights, optimiser, step, data position and plug-in state; weights: the policy
    weights (and plug-in state) only, with a fresh optimiser at step 0 (stage B from stage A)."""
    ckpt_path: nullable(Text) = None
    """A Lightning checkpoint to start from (how: resume_mode); null: a fresh start."""
    export_policy: Flag = True
    """save_pretrained the final policy to <run>/policy."""
    skip_if_done: Flag = False
    """Re-running into the same dirs: a finished run is skipped, an interrupted one continues."""
    optimized_metric: nullable(Text) = "val/accuracy"
    """The summary.json key main() returns to a sweeper that optimises (Optuna)."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    hardware: Hardware | None = None
    optim: OptimConfig = Field(default_factory=OptimConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    data: DataConfig
    trainer: TrainerSettings = Field(default_factory=TrainerSettings)
    grader: GraderConfig = Field(default_factory=GraderConfig)
    callbacks: dict[str, Any] | None = None
    """Lightning callbacks by name ({_target_, settings}); medsrl's own are checked by their signatures."""
    logger: dict[str, Any] | None = None
    """Lightning loggers by name (logger=tensorboard | csv | wandb | many)."""
    paths: Paths = Field(default_factory=Paths)

    _plugins: dict[str, tuple[type, BaseModel]] = PrivateAttr(default_factory=dict)
    _callbacks: dict[str, tuple[type, BaseModel]] = PrivateAttr(default_factory=dict)

    @property
    def plugins(self) -> dict[str, tuple[type, BaseModel]]:
        """``{name: (plug-in class, its settings)}`` of ``algorithm.plugins``, in order."""
        return self._plugins

    @property
    def callback_settings(self) -> dict[str, tuple[type, BaseModel]]:
        """``{name: (callback class, its settings)}`` of ``callbacks``."""
        return self._callbacks

    @classmethod
    def parse(cls, cfg: DictConfig | dict, *checks) -> RunConfig:
        """The run's settings, or one ``ValueError`` naming every problem (``checks``: more
        checks of the typed run, e.g. ``train.lora_target_problems``)."""
        missing: list[str] = []
        values = plain(cfg, missing) if isinstance(cfg, DictConfig) else dict(cfg)
        found = [f"{key} must be set (it is ???)" for key in missing]
        typed = {}
        for group, base, into in (("algorithm.plugins", Plugin, "_plugins"), ("callbacks", None, "_callbacks")):
            typed[into] = {}
            for name, node in _nodes(lookup(values, group), group).items():
                built, bad = instantiated(node, f"{group}.{name}", values, base)
                found += bad
                if built is not None:
                    typed[into][name] = built
        found += precision_problems(values) + logger_problems(values)
        run = None
        try:
            run = cls.model_validate(values)
        except ValidationError as err:
            found += [_dataset_named(message(cls, e, "", ""), e["loc"], values) for e in err.errors()]
        if run is not None and not found:
            for check in checks:
                found += check(run)
        _raise(found, "training")
        for into, built in typed.items():
            setattr(run, into, built)
        return run


def _dataset_named(message: str, loc: tuple, values: dict) -> str:
    """A data source's problem with its dataset's name and its loader or generator."""
    if len(loc) > 4 and loc[0] == "data" and "source" in loc:
        at = loc.index("source")
        dataset = lookup(values, ".".join(map(str, loc[:at])))
        source = dataset.get("source") if isinstance(dataset, dict) else None
        target = source.get("_target_") if isinstance(source, dict) else None
        return f"{message} (dataset {dataset.get('name')!r}, {target})"
    return message


def _raise(found: list[str], what: str) -> None:
    if found:
        listed = "\n  ".join(found)
        raise ValueError(f"{len(found)} bad value(s) in the {what} config:\n  {listed}")


LOW_PRECISION_WEIGHTS = ("bfloat16", "bf16", "float16", "fp16", "half", "16")
PURE_16BIT_PRECISIONS = ("bf16-true", "16-true")


def precision_problems(run: dict) -> list[str]:
    """16-bit master weights train only when asked for by name (``model.allow_16bit_weights``).

    AdamW's update at lr 1e-6 is far below one bf16 step of a weight of size 0.02, so pure bf16
    leaves most weights unchanged and nothing fails (docs/GPU.md): fp32 masters with
    ``trainer.precision=bf16-mixed`` compute in bf16 and keep every update. With LoRA the masters
    are the adapters (``model.dtype``); a 16-bit frozen base (``model.lora.base_dtype``, bf16 by
    default under bf16-mixed) loses nothing, no update reaching it."""
    if lookup(run, "model.allow_16bit_weights") is True or lookup(run, "optim.optimizer.lr") == 0:
        return []
    dtype = str(lookup(run, "model.dtype")).lower().removeprefix("torch.")
    precision = str(lookup(run, "trainer.precision")).lower()
    lora = lookup(run, "model.lora.r") not in (None, 0)
    found = []
    if dtype in LOW_PRECISION_WEIGHTS:
        whose = ("the LoRA adapters (the only trained weights; the frozen base's dtype is model.lora.base_dtype)"
                 if lora else "the master weights")
        found.append(f"model.dtype={dtype} keeps {whose} and AdamW states in 16 bits: updates "
                     "smaller than one bf16 step are lost (about 98 % of weights unchanged at lr 1e-6, "
                     "docs/GPU.md); use model.dtype=float32 with trainer.precision=bf16-mixed, or set "
                     "model.allow_16bit_weights=true to train in pure 16 bits anyway")
    if precision in PURE_16BIT_PRECISIONS:
        found.append(f"trainer.precision={precision} casts the master weights to 16 bits (updates below one "
                     "bf16 step are lost, docs/GPU.md); use trainer.precision=bf16-mixed, or set "
                     "model.allow_16bit_weights=true to train in pure 16 bits anyway")
    return found


def logger_problems(run: dict) -> list[str]:
    """A logger whose package is not installed: W&B (``logger=wandb`` / ``many``) is the
    ``wandb`` extra, so say how to install it rather than fail in Lightning's constructor."""
    from medsrl.utils.wandb_log import INSTALL_HINT, is_wandb_target, wandb_installed

    return [f"logger.{name} ({node['_target_']}) needs the wandb package, which is not installed: "
            f"{INSTALL_HINT} (or choose logger=tensorboard)"
            for name, node in _nodes(run.get("logger"), "logger").items()
            if is_wandb_target(node["_target_"]) and not wandb_installed()]


# --------------------------------------------------------------------------- evaluation


def _eval_own(key: str) -> Any:
    """A training rollout key eval samples without: null only, the message naming eval's own."""
    return Annotated[None, must(f"null: eval samples with its own {key}")]


class EvalRollout(Settings):
    """Eval's ``rollout``: the engine (``rollout=hf|vllm``; no ``backend``: vLLM on a CUDA GPU
    when installed, else HF) and its options. Training's sampling keys stay null there."""

    backend: nullable(one_of(BACKENDS)) = None
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    n: _eval_own("n") = None
    temperature: _eval_own("temperature") = None
    top_p: _eval_own("top_p") = None
    max_new_tokens: _eval_own("max_new_tokens") = None
    max_batch_size: _eval_own("batch_size") = None
    max_prompt_tokens: Annotated[None, must("null: eval sizes the engine from its longest prompt "
                                            "(rollout.vllm.max_model_len to set it)")] = None
    logprobs: Annotated[None, must("null: eval reads no engine log-probs")] = None


class EvalRunConfig(SamplingSpec, Open):
    """The evaluation config (configs/eval.yaml): the sampling (``SamplingSpec``), the models and
    the benchmarks."""

    model_path: Annotated[
        str | list | dict | None, must("a path, a list of paths, a {name: path} mapping or null")
    ] = None
    """The model(s) to evaluate: an HF directory or name, a .ckpt of a run, a list, or {row name: path}."""
    runs_dir: nullable(Text) = None
    """A (multi)run directory: every run in it with a policy/ export or checkpoints/last.ckpt."""
    tokenizer: nullable(Text) = None
    """The tokenizer; null: the model's own."""
    dtype: ModelDtype = "float32"
    """The weights' dtype for evaluation (bfloat16 for real models on a GPU); auto: the checkpoint's."""
    device: Text = "auto"
    """cpu, cuda, cuda:N or auto (a GPU when there is one)."""
    template: PromptTemplate = Field(default_factory=PromptTemplate)
    limit: nullable(PositiveInt) = None
    """The first N problems of each benchmark; null: all."""
    grader: GraderConfig = Field(default_factory=GraderConfig)
    rollout: EvalRollout = Field(default_factory=EvalRollout)
    benchmark: dict[str, Source] = {}
    """The benchmarks by name (benchmark=paper | arithmetic | file ...), each a data source."""
    paths: Paths = Field(default_factory=Paths)

    @classmethod
    def parse(cls, cfg: DictConfig | dict) -> EvalRunConfig:
        missing: list[str] = []
        values = plain(cfg, missing) if isinstance(cfg, DictConfig) else dict(cfg)
        found = [f"{key} must be set (it is ???)" for key in missing]
        run = None
        try:
            run = cls.model_validate(values)
        except ValidationError as err:
            found += [_benchmark_named(message(cls, e, "", ""), e["loc"], values) for e in err.errors()]
        _raise(found, "evaluation")
        return run


def _benchmark_named(message: str, loc: tuple, values: dict) -> str:
    if len(loc) > 2 and loc[0] == "benchmark":
        node = lookup(values, f"benchmark.{loc[1]}")
        target = node.get("_target_") if isinstance(node, dict) else None
        return f"{message} (benchmark {loc[1]!r}, {target})"
    return message


# --------------------------------------------------------------------------- generated files

# Written from the schemas, never by hand (tests/test_run_config.py fails when one is stale):
# - configs/<group>/_defaults.yaml: a section's defaults, which its presets extend (`- _defaults`),
#   so a preset lists only what it changes and every setting still overrides without `+`. Files,
#   not ConfigStore nodes registered on import: Hydra's compose API (a notebook, a benchmark)
#   composes what the CLI does without importing medsrl first.
# - configs/plugins/<name>.yaml: a plug-in's `_target_` and its constructor's defaults.
# - docs/SETTINGS.md: every setting with its default and help.
DEFAULTS_SCHEMAS = {"algorithm": AlgorithmSection, "optim": OptimConfig, "rollout": RolloutConfig, "model": ModelConfig,
                    "eval": EvalRunConfig}  # configs/eval.yaml extends configs/eval/_defaults.yaml
WRITE = "python -m medsrl.run_config --write"
REFERENCE = CONFIG_DIR.parent / "docs" / "SETTINGS.md"
_NOTICE = "GENERATED from {what}, where each setting is described: do not edit.\n# Regenerate: {write}"


def defaults_path(group: str, config_dir: Path = CONFIG_DIR) -> Path:
    return Path(config_dir) / group / "_defaults.yaml"


def defaults_yaml(group: str) -> str:
    """The text of ``configs/<group>/_defaults.yaml``: what it is, then the schema's defaults."""
    schema = DEFAULTS_SCHEMAS[group]
    what = f"the defaults of {schema.__name__} ({schema.__module__})"
    return (f"# {_NOTICE.format(what=what, write=WRITE)}\n# Not a preset: the base the {group} presets extend "
            f"(`- _defaults` in their defaults list).\n"
            + OmegaConf.to_yaml(schema().model_dump(mode="json", by_alias=True)))


def plugin_yaml(target: str) -> str:
    """The text of ``configs/plugins/<name>.yaml``: the plug-in's class and its defaults."""
    cls = _class(target)
    what = f"the signature of {cls.__name__} ({cls.__module__})"
    values = {"_target_": target, **settings_model(cls)().model_dump(mode="json")}
    return f"# {_NOTICE.format(what=what, write=WRITE)}\n" + OmegaConf.to_yaml(values)


def reference_md(config_dir: Path = CONFIG_DIR) -> str:
    """docs/SETTINGS.md: each section's settings, their defaults and help."""
    from medsrl.algo.advantages import ADVANTAGE_ESTIMATORS, ADVANTAGE_OPTIONS
    from medsrl.algo.policy_loss import POLICY_LOSS_OPTIONS, POLICY_LOSSES

    what = "the schemas (src/medsrl/**/settings.py, plug-in and callback signatures)"
    notice = _NOTICE.format(what=what, write=WRITE).replace("\n# ", " ")
    out = ["# Settings", "", f"<!-- {notice} -->", "",
           "Every setting of `medsrl-train` (configs/train.yaml) and `medsrl-eval` (configs/eval.yaml), with its "
           "default and what it does. Override any on the command line: `medsrl-train rollout.n=16`.", ""]
    top = {k: f for k, f in RunConfig.model_fields.items() if not _nested(f.annotation)}
    out += _table("Run", "", RunConfig, top)
    for name in ("model", "data", "rollout", "algorithm", "optim", "grader", "trainer"):
        schema = _nested(RunConfig.model_fields[name].annotation)
        out += _table(name, name, schema)
    for kind, models, names in (("advantage", ADVANTAGE_OPTIONS, ADVANTAGE_ESTIMATORS),
                                ("policy_loss", POLICY_LOSS_OPTIONS, POLICY_LOSSES)):
        for name, model in sorted((n, models[n]) for n in names):
            if model.model_fields:
                out += _table(f"algorithm.{kind}={name}", f"algorithm.{kind}_options", model)
    for path in sorted((Path(config_dir) / "plugins").glob("*.yaml")):
        cls = _class(OmegaConf.load(path)["_target_"])
        out += _table(f"plugins={path.stem} ({cls.__name__})", f"algorithm.plugins.{path.stem}", settings_model(cls))
    callbacks = OmegaConf.load(Path(config_dir) / "callbacks" / "default.yaml")
    for name, node in callbacks.items():
        cls = _class(node["_target_"])
        if cls.__module__.startswith("medsrl."):
            out += _table(f"callbacks.{name} ({cls.__name__})", f"callbacks.{name}", settings_model(cls))
    out += _table("Evaluation (configs/eval.yaml)", "", EvalRunConfig,
                  {k: f for k, f in EvalRunConfig.model_fields.items() if k not in ("rollout", "paths")})
    out += _table("Data sources (`source:` of a dataset, each benchmark)", "", Source)
    return "\n".join(out).rstrip() + "\n"


def _nested(hint: Any) -> type | None:
    """The settings model inside an annotation (``X | None``, ``Annotated[...]``), if any."""
    return _inner(hint)[0]


def _inner(hint: Any) -> tuple[type | None, str]:
    """``(the model inside hint, how it is held: "" one, "[]" a list, ".<name>" a mapping)``."""
    from typing import get_args, get_origin

    if isinstance(hint, type) and issubclass(hint, BaseModel):
        return hint, ""
    origin = get_origin(hint)
    for arg in get_args(hint):
        model, held = _inner(arg)
        if model is not None:
            return model, "[]" if origin is list else ".<name>" if origin is dict else held
    return None, ""


def _table(title: str, prefix: str, schema: type, fields: dict | None = None) -> list[str]:
    return [f"## {title}", "", "| setting | default | |", "|---|---|---|", *_rows(prefix, schema, fields), ""]


def _rows(prefix: str, schema: type, fields: dict | None = None) -> list[str]:
    import json

    rows = []
    for name, field in (fields if fields is not None else schema.model_fields).items():
        key = f"{prefix}.{name}" if prefix else name
        sub, held = _inner(field.annotation)
        if sub is Source:
            rows.append(f"| `{key + held}` | | a data source: its `_target_` and arguments (Data sources, below) |")
            continue
        if sub is not None and sub is not schema and issubclass(sub, Settings):
            rows += _rows(key + held, sub)
            continue
        default = "(required)" if field.is_required() else json.dumps(
            field.get_default(call_default_factory=True), default=str)
        help_ = help_of(field).replace("|", "\\|")  # a table cell
        rows.append(f"| `{key}` | `{default}` | {help_} |")
    return rows


def generated_files(config_dir: Path = CONFIG_DIR) -> dict[Path, str]:
    """Every generated file and its text."""
    files = {defaults_path(group, config_dir): defaults_yaml(group) for group in DEFAULTS_SCHEMAS}
    for path in sorted((Path(config_dir) / "plugins").glob("*.yaml")):
        files[path] = plugin_yaml(OmegaConf.load(path)["_target_"])
    files[REFERENCE] = reference_md(config_dir)
    return files


def write_generated(config_dir: Path = CONFIG_DIR) -> list[Path]:
    """Write every generated file; returns those whose text changed."""
    changed = []
    for path, text in generated_files(config_dir).items():
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            changed.append(path)
    return changed


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="The run config's generated files.")
    ap.add_argument("--write", action="store_true", help="regenerate the _defaults, plug-in and reference files")
    if not ap.parse_args().write:
        ap.error("nothing to do: pass --write")
    from medsrl import run_config  # the schemas as medsrl names them, not as __main__'s

    for path in run_config.write_generated():
        print(f"wrote {path}")
