"""A run's config, parsed once by the entry points into a typed :class:`RunConfig` (or
:class:`EvalRunConfig`) whose sections they pass on. The sections' schemas live with their packages;
this module composes them and adds the checks that span sections. A bad config raises one
``ValueError`` listing every problem by its Hydra key, before any model loads."""

from __future__ import annotations

import importlib
import importlib.util
import logging
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

from omegaconf import DictConfig
from pydantic import BaseModel, BeforeValidator, Field, InstanceOf, ValidationError

from medsrl.algo.advantages import ADVANTAGE_OPTIONS
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
    lookup,
    message,
    must,
    nullable,
    one_of,
    plain,
    raise_problems,
    settings_model,
)
from medsrl.step.settings import OptimConfig

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


class Built(NamedTuple):
    """A checked ``{_target_: class, settings}`` node (settings None: a library class Hydra builds)."""

    cls: type
    settings: BaseModel | None


def target_class(target: Any) -> type | None:
    """The class a ``_target_`` names, or None when it cannot be imported."""
    if not isinstance(target, str) or "." not in target:
        return None
    module, name = target.rsplit(".", 1)
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _built(node: dict, where: str, base: type | None) -> tuple[Built | None, list[str]]:
    """``(node as Built, problems)``; ``base``: the class it must be."""
    cls, kind = target_class(node["_target_"]), "a medsrl Plugin" if base is Plugin else "an importable"
    if cls is None or (base is not None and not (isinstance(cls, type) and issubclass(cls, base))):
        return None, [f"{where}._target_ must be {kind} class, got {node['_target_']!r}"]
    try:
        schema = settings_model(cls)
    except Exception:  # an annotation pydantic cannot check (a library's class): Hydra builds it
        return Built(cls, None), []
    try:
        return Built(cls, schema.model_validate({k: v for k, v in node.items() if not k.startswith("_")})), []
    except ValidationError as err:
        return None, [message(schema, e, where, cls.__name__) for e in err.errors()]


def _nodes(section: Any, group: str) -> dict[str, dict]:
    """A group's ``_target_`` nodes; one without is not built. An experiment's settings for a shipped
    plug-in its algorithm does not use (tiny's overlong under algorithm=grpo) are expected, a
    name no preset has (a typo) is not."""
    nodes = {}
    for name, node in (section or {}).items():
        if isinstance(node, dict) and "_target_" in node:
            nodes[str(name)] = node
        elif node is not None:
            shipped = group == "algorithm.plugins" and (CONFIG_DIR / "plugins" / f"{name}.yaml").exists()
            log.log(logging.INFO if shipped else logging.WARNING,
                    "%s.%s has settings but no _target_: not built in this run, ignored", group, name)
    return nodes


def _group(group: str, base: type | None, section: Any) -> dict[str, Built]:
    if section is not None and not isinstance(section, dict):
        raise_problems([f"{group} must be a mapping {{name: {{_target_: class, settings}}}}, got {section!r}"])
    built, found = {}, []
    for name, node in _nodes(section, group).items():
        built[name], bad = _built(node, f"{group}.{name}", base)
        found += bad
    raise_problems(found)
    return built


def nodes(group: str, base: type | None = None) -> Any:
    """``{name: Built}`` from the named ``{_target_: class, settings}`` nodes of ``group``."""
    return Annotated[dict[str, InstanceOf[Built]], BeforeValidator(partial(_group, group, base))]


class Hardware(Settings):
    """What an experiment is sized for (medsrl-plan checks its memory per GPU against it)."""

    name: Text = ""
    gpu_memory_gib: Positive


class TrainerSettings(Open):
    """Lightning's ``Trainer``: the keys medsrl reads (defaults: the CPU preset's); Lightning checks the rest."""

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
    plugins: nodes("algorithm.plugins", Plugin) = {}
    """The plug-ins, in order: {name: {_target_: class, its settings}}; each checked by its class."""


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
    callbacks: nodes("callbacks") = {}
    """Lightning callbacks by name ({_target_, settings}); medsrl's own are checked by their signatures."""
    logger: dict[str, Any] | None = None
    """Lightning loggers by name (logger=tensorboard | csv | wandb | many)."""
    paths: Paths = Field(default_factory=Paths)

    @classmethod
    def parse(cls, cfg: DictConfig | dict, *checks) -> RunConfig:
        """The run's settings or one ``ValueError``; the cross-section ``checks`` run once sections parse."""
        return _parsed(cls, cfg, "training", (bound_checks, precision_problems, logger_problems, *checks))


def _parsed(cls: type[BaseModel], cfg: DictConfig | dict, what: str, checks=()) -> Any:
    """``cfg`` as ``cls`` or one ``ValueError`` listing every problem; the cross-section ``checks`` run
    once the sections parse."""
    missing: list[str] = []
    values = plain(cfg, missing) if isinstance(cfg, DictConfig) else dict(cfg)
    found = [f"{key} must be set (it is ???)" for key in missing]
    try:
        run = cls.model_validate(values)
    except ValidationError as err:
        run = None
        found += [_source_named(message(cls, e, "", ""), e["loc"], values) for e in err.errors()]
    if run is not None and not found:
        for check in checks:
            found += check(run)
    if found:
        listed = "\n  ".join(found)
        raise ValueError(f"{len(found)} bad value(s) in the {what} config:\n  {listed}")
    return run


def _source_named(message: str, loc: tuple, values: dict) -> str:
    """A data source's or benchmark's problem with its name and its loader or generator."""
    if len(loc) > 4 and loc[0] == "data" and "source" in loc:
        dataset = lookup(values, ".".join(map(str, loc[:loc.index("source")])))
        source = dataset.get("source") if isinstance(dataset, dict) else None
        target = source.get("_target_") if isinstance(source, dict) else None
        return f"{message} (dataset {dataset.get('name')!r}, {target})"
    if len(loc) > 2 and loc[0] == "benchmark":
        node = lookup(values, f"benchmark.{loc[1]}")
        target = node.get("_target_") if isinstance(node, dict) else None
        return f"{message} (benchmark {loc[1]!r}, {target})"
    return message


def bound_checks(run: RunConfig) -> list[str]:
    """The bounds (:func:`medsrl.settings.below`) of the advantage options, plug-ins and callbacks."""
    algo = run.algorithm
    options = ADVANTAGE_OPTIONS[algo.advantage].model_validate(algo.advantage_options)
    return bound_problems(options, "algorithm.advantage_options", run) + [
        problem for group, built in (("algorithm.plugins", algo.plugins), ("callbacks", run.callbacks))
        for name, (_, settings) in built.items() if settings is not None
        for problem in bound_problems(settings, f"{group}.{name}", run)]


LOW_PRECISION_WEIGHTS = ("bfloat16", "bf16", "float16", "fp16", "half", "16")
PURE_16BIT_PRECISIONS = ("bf16-true", "16-true")


def precision_problems(run: RunConfig) -> list[str]:
    """16-bit master weights only when asked for (``model.allow_16bit_weights``): AdamW's update at
    lr 1e-6 is below one bf16 step of a weight of 0.02, so pure bf16 silently leaves most weights
    unchanged (docs/GPU.md). A 16-bit frozen LoRA base loses nothing: no update reaches it."""
    if run.model.allow_16bit_weights or run.optim.optimizer.lr == 0:
        return []
    dtype = str(run.model.dtype).lower().removeprefix("torch.")
    precision = str(run.trainer.precision).lower()
    found = []
    if dtype in LOW_PRECISION_WEIGHTS:
        whose = ("the LoRA adapters (the only trained weights; the frozen base's dtype is model.lora.base_dtype)"
                 if run.model.lora.enabled else "the master weights")
        found.append(f"model.dtype={dtype} keeps {whose} and AdamW states in 16 bits: updates "
                     "smaller than one bf16 step are lost (about 98 % of weights unchanged at lr 1e-6, "
                     "docs/GPU.md); use model.dtype=float32 with trainer.precision=bf16-mixed, or set "
                     "model.allow_16bit_weights=true to train in pure 16 bits anyway")
    if precision in PURE_16BIT_PRECISIONS:
        found.append(f"trainer.precision={precision} casts the master weights to 16 bits (updates below one "
                     "bf16 step are lost, docs/GPU.md); use trainer.precision=bf16-mixed, or set "
                     "model.allow_16bit_weights=true to train in pure 16 bits anyway")
    return found


# Loggers whose package is an extra: Lightning class name -> (module, extra)
LOGGER_EXTRAS = {"WandbLogger": ("wandb", "wandb"), "MLFlowLogger": ("mlflow", "mlflow")}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules: as if absent
        return False


def logger_problems(run: RunConfig) -> list[str]:
    """Loggers whose extra is not installed: say how to install it, not fail in Lightning."""
    found = []
    for name, node in _nodes(run.logger, "logger").items():
        module, extra = LOGGER_EXTRAS.get(str(node["_target_"]).rsplit(".", 1)[-1], (None, None))
        if module and not _importable(module):
            found.append(f"logger.{name} ({node['_target_']}) needs the {module} package, which is not installed: "
                         f'make install EXTRAS={extra} (pip install -e ".[{extra}]") (or choose logger=tensorboard)')
    return found


def _eval_own(key: str) -> Any:
    """A training rollout key eval samples without: null only, the message naming eval's own."""
    return Annotated[None, must(f"null: eval samples with its own {key}")]


class EvalRollout(Settings):
    """Eval's ``rollout``: the engine and its options; training's sampling keys stay null."""

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
    """The evaluation config (configs/eval.yaml): the sampling, the models and the benchmarks."""

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
    quiet: Flag = False
    """No progress bar (there is none without a terminal either): the per-benchmark lines alone."""

    @classmethod
    def parse(cls, cfg: DictConfig | dict) -> EvalRunConfig:
        return _parsed(cls, cfg, "evaluation")
