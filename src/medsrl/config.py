"""The settings of a run, one home each: strict pydantic schemas with their defaults and ranges,
checked once at start, before any model loads, so that a bad value (``optim.lr=abc``,
``rollout.n=0``) does not fail late and far from its key. :func:`check_train_config` /
:func:`check_eval_config` raise one ``ValueError`` listing every problem as ``<hydra key> must be
<what>, got <value>`` (:func:`must`). Strings are never numbers here, nor bools ints.

Sections the code owns (algorithm, rollout, optim, grader, model.lora) refuse unknown keys;
sections Hydra instantiates (trainer, callbacks, data sources) are checked on the keys named here
only; plug-ins by their annotated ``__init__`` signature (:func:`plugin_problems`).
"""

import importlib
import inspect
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    WrapValidator,
    create_model,
)
from pydantic_core import PydanticCustomError
from typing_extensions import TypedDict, is_typeddict

SEED_MAX = 2**32 - 1  # numpy's (and Lightning's seed_everything's) bound
STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

# --------------------------------------------------------------------------- types


def must(what: str | Callable[[], str]) -> WrapValidator:
    """Any failure of the value's own checks becomes one error, ``must be <what>`` (a callable
    ``what`` is read when the error is raised: registries may grow)."""

    def check(value: Any, handler: Callable[[Any], Any]) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("must", "must be {what}", {"what": check.what()}) from None

    check.what = what if callable(what) else lambda: what
    return WrapValidator(check)


def nullable(alias: Any) -> Any:
    """``alias`` (a type made with :func:`must`) or null."""
    return Annotated[alias | None, must(lambda: f"{alias.__metadata__[-1].func.what()} or null")]


def one_of(options: Iterable[str] | Callable[[], Iterable[str]]) -> Any:
    """One of the names; a callable is read at check time (a registry plug-ins may add to)."""
    listed = options if callable(options) else lambda: tuple(options)

    def known(value: str) -> str:
        if value not in listed():
            raise ValueError(value)
        return value

    return Annotated[str, AfterValidator(known), must(lambda: "one of " + ", ".join(map(repr, listed())))]


def at_least(low: int) -> Any:
    """An int (not a bool, not a float such as 2.0) >= ``low``."""
    return Annotated[int, Field(ge=low), must(f"an int >= {low}")]


def _as_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value  # YAML gives lists


def listed(item: Any) -> Any:
    """A non-empty list of ``item``, kept as a tuple (hashable, and equal from YAML or Python)."""
    return Annotated[tuple[item, ...], BeforeValidator(_as_tuple), Field(min_length=1)]


@dataclass(frozen=True)
class Bound:
    other: str
    or_equal: bool


def below(alias: Any, other: str, or_equal: bool = False) -> Any:
    """``alias``, bounded above by another value: a sibling setting, or a dotted key of the run
    config; checked once each value has passed its own type (:func:`bound_problems`)."""
    return Annotated[alias, Bound(other, or_equal)]


Finite = Annotated[float, Field(allow_inf_nan=False)]
Number = Annotated[Finite, must("a number")]
NonNegative = Annotated[Finite, Field(ge=0), must("a number >= 0")]
Positive = Annotated[Finite, Field(gt=0), must("a positive number")]
Fraction = Annotated[Finite, Field(gt=0, le=1), must("a number in (0, 1]")]
PositiveInt = at_least(1)
Count = at_least(0)
Seed = Annotated[int, Field(ge=0, le=SEED_MAX), must(f"an int in [0, {SEED_MAX}]")]
Flag = Annotated[bool, must("true or false")]
Text = Annotated[str, must("a string")]
NonEmpty = Annotated[str, Field(pattern=r"\S")]
Beta = Annotated[Finite, Field(ge=0, lt=1)]
Layer = Annotated[int, Field(ge=1)]  # 1-based
# What select_layers takes: the last N layers, "half", "all", or a list of 1-based layers.
Layers = Annotated[
    Layer | Annotated[str, Field(pattern=r"(?i)^\s*(half|all|\d+)\s*$")] | listed(Layer),
    must("an int >= 1, 'half', 'all' or a list of 1-based layers"),
]


def imported(path: str, sort: bool = False) -> Callable[[], tuple[str, ...]]:
    """The names at ``module.attr``, imported when a value is checked: config.py stays light, and
    a registry then includes what plug-ins registered."""
    module, attr = path.rsplit(".", 1)
    return lambda: tuple((sorted if sort else list)(getattr(importlib.import_module(module), attr)))


# The names a dtype setting takes, by torch dtype (models/loading.py maps them)
DTYPE_NAMES = {
    "float32": ("float32", "fp32", "float", "32"),
    "bfloat16": ("bfloat16", "bf16", "bf16-mixed", "bf16-true"),
    "float16": ("float16", "fp16", "half", "16", "16-mixed", "16-true"),
}
ModelDtype = one_of(("auto", *sorted(n for names in DTYPE_NAMES.values() for n in names)))
FEATURE_DTYPES = ("auto", "float32", "bfloat16")  # MEDS features (methods/meds/features.py)
FEATURE_LOGITS = ("answer", "digits")  # which logits a MEDS feature keeps (methods/meds/features.py)
FeatureDtype = one_of(FEATURE_DTYPES)

# --------------------------------------------------------------------------- sections the code owns


class Settings(BaseModel):
    """A section the code owns: strict types, finite numbers, no unknown key."""

    model_config = STRICT


class AlgorithmConfig(Settings):
    """The RL loss: an advantage estimator and a policy loss from the registries (by name),
    their settings, and the update's batching. GRPO, DAPO, Dr.GRPO and MEDS are presets of these
    plus the plug-ins of ``algorithm.plugins`` (built by ``train.py``, not here)."""

    name: Text = "dapo"
    advantage: one_of(imported("medsrl.algo.ADVANTAGE_ESTIMATORS", sort=True)) = "grpo"
    advantage_options: dict[str, Any] = {}  # e.g. gdpo {weights: {...}}
    policy_loss: one_of(imported("medsrl.algo.POLICY_LOSSES", sort=True)) = "vanilla"
    policy_loss_options: dict[str, Any] = {}
    clip_low: NonNegative = 0.2
    clip_high: NonNegative = 0.28
    dual_clip: nullable(Annotated[Finite, Field(gt=1), must("a number > 1")]) = 10.0
    loss_agg_mode: one_of(imported("medsrl.algo.LOSS_AGG_MODES")) = "token-mean"
    kl_coef: NonNegative = 0.0  # > 0 adds a KL loss against a frozen reference model
    kl_kind: one_of(imported("medsrl.algo.kl._KL_ALIASES")) = "k3"
    entropy_coef: NonNegative = 0.0  # the update only adds a term when > 0
    ppo_epochs: PositiveInt = 1
    mini_batch_prompts: nullable(PositiveInt) = None  # prompts per optimiser update; None = the whole step
    micro_batch_size: PositiveInt = 32  # sequences per forward/backward (at most)
    # padded tokens per forward/backward: rows sorted by length, cut by this budget
    # (step/micro_batches.py); None: cut by micro_batch_size alone, in row order
    max_tokens_per_microbatch: nullable(PositiveInt) = None
    # truncated importance sampling of the engine's sampling mismatch: each token's policy-gradient
    # term times min(pi_old / pi_engine, cap) (algo/engine_correction.py); needs rollout.logprobs
    engine_is_cap: nullable(Positive) = None
    # what the cap does, per token or per response (the ratio of the response's probabilities):
    # token_truncate (min(ratio, cap)), token_mask (0 above the cap), sequence_truncate,
    # sequence_mask (TRL's default); read only when engine_is_cap is set
    engine_is_mode: one_of(imported("medsrl.algo.engine_correction.ENGINE_IS_MODES")) = "token_truncate"


class VLLMConfig(Settings):
    """Engine settings of the vLLM backend (``rollout.backend=vllm``); the HF backend ignores them.
    On the CPU build ``gpu_memory_utilization`` is a fraction of host memory: size the KV cache with
    ``kv_cache_memory_bytes`` there instead."""

    gpu_memory_utilization: Fraction = 0.5  # colocated: the trainer needs the rest
    kv_cache_memory_bytes: nullable(PositiveInt) = None  # overrides gpu_memory_utilization when set
    tensor_parallel_size: PositiveInt = 1
    enforce_eager: Flag = False  # True: no CUDA graphs / torch.compile (faster start)
    enable_sleep_mode: Flag = False  # free weights + KV cache between rollouts (GPU builds)
    dtype: Text = "auto"  # auto: the policy's dtype
    max_model_len: nullable(PositiveInt) = None  # None: rollout.max_prompt_tokens + max_new_tokens, at most the model's positions
    per_request_seeds: Flag = False  # True: a seed per response (reproducible per shard; slower)


class RolloutConfig(Settings):
    """Sampling settings for training rollouts (validation has its own: callbacks.pass_at_k)."""

    backend: one_of(("hf", "vllm")) = "hf"
    n: PositiveInt = 8
    temperature: Positive = 1.0
    top_p: Fraction = 1.0
    max_new_tokens: PositiveInt = 256
    max_batch_size: PositiveInt = 64  # sequences per generate call
    # with max_new_tokens, the engine's max_model_len (at most the model's positions); data prompts
    # longer than max_model_len - max_new_tokens are dropped at load, for both backends
    max_prompt_tokens: PositiveInt = 2048
    logprobs: Flag = False  # engine sampling log-probs, logged against the trainer's (train/engine/*)
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)


class OptimConfig(Settings):
    """AdamW with linear warm-up then constant lr, stepped once per RL step."""

    lr: NonNegative = 1e-6  # 0 on purpose: a weights-only start that must keep the weights
    weight_decay: NonNegative = 0.1
    betas: Annotated[tuple[Beta, Beta], BeforeValidator(_as_tuple),
                     must("a pair of numbers each in [0, 1)")] = (0.9, 0.999)
    eps: Positive = 1e-8
    warmup_steps: Count = 10
    grad_clip: Annotated[Finite, Field(ge=0), must("a number >= 0 (0: no clipping)")] = 1.0
    # runaway guard (utils/guard.py): stop when the weights' norm exceeds this many times its
    # value at the fit's first update; 0 leaves only the non-finite check
    max_param_norm_growth: Annotated[
        Annotated[Finite, Field(ge=0, le=0)] | Annotated[Finite, Field(gt=1)], must("0 (off) or a number > 1")
    ] = 100.0


MAX_GRADER_WORKERS = 16


class GraderConfig(Settings):
    """Math grading: hard per-answer timeout, in worker processes."""

    timeout_s: Positive = 5.0
    # None: grader_workers(), one per core of this process; 0: in-process, no timeout (debugging)
    num_workers: nullable(Count) = None
    # Reasoning models (R1-Distill, Qwen3 thinking): grade only the text after the last
    # occurrence of this tag; a response that never writes it scores 0 (counted). None: all of it.
    reasoning_end: Annotated[NonEmpty | None, must("a non-empty tag such as '</think>', or null")] = None

    def workers(self, processes_per_node: int = 1) -> int:
        """The worker count: the configured one, else :func:`grader_workers`."""
        return self.num_workers if self.num_workers is not None else grader_workers(processes_per_node)


def grader_workers(processes_per_node: int = 1) -> int:
    """One grader worker per core this process may use, the node's cores split between its
    training processes, at most ``MAX_GRADER_WORKERS``: math-verify is CPU-bound, and grading
    runs between generation and the update, when the cores are otherwise idle."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_GRADER_WORKERS, cores // max(1, processes_per_node)))


# The attention and MLP projections of Qwen2 / Qwen3 / Llama: every linear map of a decoder layer.
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSettings(Settings):
    """``model.lora`` (models/lora.py): ``r`` 0 is off (full fine-tune). ``dropout`` 0 by default:
    a dropout mask is drawn from the global generator, which a resumed run does not continue, so
    only without it does a resume give exactly the uninterrupted run."""

    model_config = ConfigDict(frozen=True)

    r: Count = 0
    alpha: Positive = 16.0
    dropout: Annotated[Finite, Field(ge=0, lt=1), must("a number in [0, 1)")] = 0.0
    # module names (checked against the model: lora_problems), or PEFT's every linear layer
    target_modules: Annotated[Literal["all-linear"] | listed(NonEmpty),
                              must("a non-empty list of module names (q_proj, ...) or 'all-linear'")] = DEFAULT_TARGETS
    merge_on_export: Flag = True

    @property
    def enabled(self) -> bool:
        return self.r > 0

    @property
    def scale(self) -> float:
        """What ``B @ A`` is multiplied by in the forward (PEFT's ``scaling``)."""
        return self.alpha / self.r


def parse_section(cls: type[BaseModel], values: Any, section: str) -> Any:
    """``values`` (a mapping, an instance or None) as ``cls``; bad values raise one ``ValueError``
    naming each by its key under ``section``."""
    try:
        if isinstance(values, DictConfig):  # strict: OmegaConf's lists are not lists
            values = OmegaConf.to_container(values, resolve=True)
        return cls.model_validate(values if isinstance(values, cls) else dict(values or {}))
    except ValidationError as err:
        raise ValueError("; ".join(_message(cls, e, section, "") for e in err.errors())) from None


# --------------------------------------------------------------------------- sections checked only


class Template(TypedDict, total=False):
    """The prompt format (``data.template`` / eval's ``template``; data/template.py)."""

    kind: one_of(imported("medsrl.data.template.TEMPLATE_KINDS"))
    system_prompt: nullable(Text)
    instruction: nullable(Text)
    extra_empty_assistant_turn: Flag
    enable_thinking: nullable(Flag)


class Source(TypedDict, total=False):
    """A file, hub data set or generator source (load_math_file, load_math_hub,
    generate_arithmetic, ...)."""

    path: nullable(Text)
    hub: nullable(Text)  # a hub data set (or "parquet" / "json" with data_files) instead of a path
    subset: nullable(Text)
    revision: nullable(Text)
    name: nullable(Text)
    num: PositiveInt
    limit: nullable(PositiveInt)
    on_bad_row: one_of(("skip", "raise"))
    problem_field: nullable(Text)
    answer_field: nullable(Text)
    split: Text


class Dataset(TypedDict, total=False):
    name: Text
    weight: Positive  # its source: Source, checked with the dataset's name (source_problems)


class Stage(TypedDict, total=False):
    name: Text
    start_step: Count
    datasets: list[Dataset]


class Data(TypedDict, total=False):
    prompts_per_step: PositiveInt
    val_size: nullable(PositiveInt)
    seed: Seed
    stages: list[Stage]
    val: list[Dataset] | None
    template: Template
    # the largest share of a dataset dropped as longer than the engine takes before the run
    # refuses to start (MathDataModule.limit_prompt_tokens); 0: none may be dropped
    max_dropped_prompt_share: Annotated[Finite, Field(ge=0, le=1), must("a number in [0, 1]")]


class Model(TypedDict, total=False):
    dtype: ModelDtype
    gradient_checkpointing: Flag
    random_init: Flag
    allow_16bit_weights: Flag  # pure 16-bit training, asked for by name (precision_problems)
    lora: LoraSettings


class Hardware(TypedDict, total=False):
    """What an experiment is sized for (medsrl-plan checks it)."""

    name: Text
    gpu_memory_gib: Positive


class Trainer(TypedDict, total=False):
    """Lightning's Trainer: its other keys are Lightning's to check."""

    max_steps: Annotated[PositiveInt | Literal[-1], must("an int >= 1 or -1")]  # -1: no limit
    log_every_n_steps: PositiveInt
    enable_progress_bar: Flag


class PassAtK(TypedDict, total=False):
    n: PositiveInt
    every_n_steps: Count  # 0: off
    num_problems: nullable(PositiveInt)
    at_start: Flag
    batch_size: PositiveInt
    temperature: NonNegative  # 0: greedy
    top_p: Fraction
    max_new_tokens: nullable(PositiveInt)
    seed: Seed


class SampleLogger(TypedDict, total=False):
    every_n_steps: Count  # 0: off
    num_samples: Count


class ProgressBar(TypedDict, total=False):
    refresh_rate: Count  # 0: no bar
    window: PositiveInt


class Checkpoints(TypedDict, total=False):
    every_n_train_steps: nullable(Count)


class Milestones(TypedDict, total=False):
    every_n_steps: Count  # 0: off
    dtype: ModelDtype


class Callbacks(TypedDict, total=False):
    pass_at_k: PassAtK | None
    sample_logger: SampleLogger | None
    progress_bar: ProgressBar | None
    model_checkpoint: Checkpoints | None
    milestones: Milestones | None


class AlgorithmSection(AlgorithmConfig):
    plugins: dict[str, Any] | None = {}  # each checked by its class (plugin_problems)


class TrainConfig(TypedDict, total=False):
    """The training config (configs/train.yaml and its groups): the keys checked."""

    seed: Seed
    resume_mode: one_of(("full", "weights"))
    ckpt_path: nullable(Text)
    export_policy: Flag
    skip_if_done: Flag
    optimized_metric: nullable(Text)
    model: Model
    hardware: Hardware | None
    optim: OptimConfig
    rollout: RolloutConfig
    algorithm: AlgorithmSection
    data: Data
    trainer: Trainer
    grader: GraderConfig
    callbacks: Callbacks | None


class Features(TypedDict, total=False):
    layers: Layers
    diff: Flag
    final_norm: Flag
    dtype: FeatureDtype


def _eval_own(key: str) -> Any:
    """A training rollout key eval samples without: null only, the message naming eval's own."""
    return Annotated[None, must(f"null: eval samples with its own {key}")]


class EvalRollout(TypedDict, total=False):
    """Eval's ``rollout``: the engine (``rollout=hf|vllm``; no ``backend``: vLLM on a CUDA GPU
    when installed, else HF) and its options. Training's sampling keys stay null there."""

    backend: one_of(("hf", "vllm"))
    vllm: VLLMConfig
    n: _eval_own("n")
    temperature: _eval_own("temperature")
    top_p: _eval_own("top_p")
    max_new_tokens: _eval_own("max_new_tokens")
    max_batch_size: _eval_own("batch_size")
    max_prompt_tokens: Annotated[None, must("null: eval sizes the engine from its longest prompt "
                                            "(rollout.vllm.max_model_len to set it)")]
    logprobs: Annotated[None, must("null: eval reads no engine log-probs")]


class EvalConfig(TypedDict, total=False):
    """The evaluation config (configs/eval.yaml), benchmarks aside (source_problems)."""

    model_path: Annotated[str | list | dict | None, must("a path, a list of paths, a {name: path} mapping or null")]
    runs_dir: nullable(Text)
    tokenizer: nullable(Text)
    dtype: ModelDtype
    device: Text
    template: Template
    n: PositiveInt
    temperature: NonNegative  # 0: greedy
    top_p: Fraction
    max_new_tokens: PositiveInt
    seed: Seed
    batch_size: PositiveInt
    limit: nullable(PositiveInt)
    features: Features | None
    grader: GraderConfig
    rollout: EvalRollout


# --------------------------------------------------------------------------- messages


def _dotted(*parts: Any) -> str:
    return ".".join(str(p) for p in parts if p != "")


def _fields(schema: Any) -> dict[str, Any]:
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        return {name: f.annotation for name, f in schema.model_fields.items()}
    return get_type_hints(schema)


def _section(hint: Any) -> Any:
    """The model or TypedDict inside an annotation (``Optional[...]``, ``list[...]``)."""
    if get_origin(hint) is None and isinstance(hint, type) and (issubclass(hint, BaseModel) or is_typeddict(hint)):
        return hint
    return next((s for arg in get_args(hint) if (s := _section(arg)) is not None), None)


def _known(schema: Any, path: tuple) -> list[str]:
    """The settings of the section at ``path`` under ``schema``."""
    for part in path:
        if not isinstance(part, int):
            schema = _section(_fields(schema)[part])
    return sorted(_fields(schema))


def _message(schema: Any, error: dict, prefix: str, owner: str) -> str:
    key, loc = _dotted(prefix, *error["loc"]), error["loc"]
    if error["type"] == "must":
        return f"{key} {error['msg']}, got {error['input']!r}"
    if error["type"] == "extra_forbidden":
        known = ", ".join(_known(schema, loc[:-1]))
        return f"{key} is not a setting of {_dotted(owner or prefix, *loc[:-1])} (known: {known})"
    if error["type"] == "missing":
        return f"{key} must be set"
    return f"{key}: {error['msg']}, got {error['input']!r}"


def problems(schema: Any, values: Any, prefix: str = "", owner: str = "") -> list[str]:
    """Every value of ``values`` that ``schema`` refuses, named by its dotted key under
    ``prefix``; an unknown key is named a setting of ``owner`` (default: its section's key)."""
    try:
        TypeAdapter(schema).validate_python(values, strict=True)
    except ValidationError as err:
        return [_message(schema, e, prefix, owner) for e in err.errors()]
    return []


# --------------------------------------------------------------------------- reading the config


def plain(node: Any, missing: list[str], key: str = "") -> Any:
    """``node`` as plain dicts and lists, interpolations resolved. A ``???`` value is left out and
    its key added to ``missing``; so is one only Hydra's run resolves (``${hydra:...}``)."""
    if not isinstance(node, (DictConfig, ListConfig)):
        return node
    is_dict = isinstance(node, DictConfig)
    out = {}
    for part in node.keys() if is_dict else range(len(node)):
        where = _dotted(key, part)
        if OmegaConf.is_missing(node, part):
            missing.append(where)
            continue
        try:
            out[part] = plain(node[part], missing, where)
        except OmegaConfBaseException:  # not resolvable outside the run: not a value checked here
            continue
    return out if is_dict else list(out.values())


def lookup(values: Any, key: str) -> Any:
    """The value at a dotted key of plain ``values``, or None."""
    for part in key.split("."):
        values = values.get(part) if isinstance(values, dict) else None
    return values


# --------------------------------------------------------------------------- plug-ins


def settings_model(cls: type) -> type[BaseModel]:
    """The settings ``cls.__init__`` takes, as a model: its annotations (these types) and defaults."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    try:
        hints = get_type_hints(cls.__init__, include_extras=True)
    except NameError:  # an annotation only a type checker resolves: those settings go unchecked
        hints = {}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    fields = {p.name: (hints.get(p.name, Any), ... if p.default is p.empty else p.default)
              for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    config = ConfigDict(STRICT, extra="allow" if takes_any else "forbid")
    return create_model(cls.__name__, __config__=config, **fields)


def bound_problems(settings: BaseModel, prefix: str, run: dict) -> list[str]:
    """The bounds (:func:`below`) one setting takes from another value."""
    found = []
    for name, field in type(settings).model_fields.items():
        for bound in (m for m in field.metadata if isinstance(m, Bound)):
            sibling = "." not in bound.other
            limit = getattr(settings, bound.other) if sibling else lookup(run, bound.other)
            value, other = getattr(settings, name), _dotted(prefix if sibling else "", bound.other)
            if isinstance(limit, (int, float)) and (value > limit or (value == limit and not bound.or_equal)):
                found.append(f"{prefix}.{name} must be {'<=' if bound.or_equal else 'less than'} "
                             f"{other} ({limit!r}), got {value!r}")
    return found


def _plugin_class(target: Any) -> type | None:
    """The class a ``_target_`` names, or None when it cannot be imported."""
    from hydra.utils import get_class

    try:
        return get_class(target) if isinstance(target, str) else None
    except Exception:  # hydra raises ImportError or ValueError: reported by the caller
        return None


def plugin_problems(run: dict) -> list[str]:
    """``algorithm.plugins.<name>``: an importable ``_target_`` whose ``__init__`` takes the
    settings given. Entries without ``_target_`` are ignored by the trainer, so here too."""
    found, plugins = [], lookup(run, "algorithm.plugins")
    for name, node in (plugins if isinstance(plugins, dict) else {}).items():
        if not isinstance(node, dict) or "_target_" not in node:
            continue
        where, cls = f"algorithm.plugins.{name}", _plugin_class(node["_target_"])
        if cls is None:
            found.append(f"{where}._target_ must be an importable plug-in class, got {node['_target_']!r}")
            continue
        schema, values = settings_model(cls), {k: v for k, v in node.items() if not k.startswith("_")}
        bad = problems(schema, values, where, owner=cls.__name__)
        found += bad or bound_problems(schema.model_validate(values), where, run)
    return found


# --------------------------------------------------------------------------- other checks


def source_problems(owners: Iterable[tuple[str, Any, str]]) -> list[str]:
    """The settings of file and generator sources, each message naming the dataset or benchmark
    (``label``) and the loader or generator."""
    found = []
    for key, node, label in owners:
        if isinstance(node, dict) and "_target_" in node:
            found += [f"{p} ({label}, {node['_target_']})" for p in problems(Source, node, key)]
    return found


def _train_sources(run: dict) -> Iterable[tuple[str, Any, str]]:
    """``(source key, source, "dataset 'name'")`` of every training and validation dataset."""
    data = run.get("data") if isinstance(run.get("data"), dict) else {}
    datasets = []
    for i, stage in enumerate(data.get("stages") or []):
        if isinstance(stage, dict):
            datasets += [(f"data.stages.{i}.datasets.{j}", d) for j, d in enumerate(stage.get("datasets") or [])]
    datasets += [(f"data.val.{i}", d) for i, d in enumerate(data.get("val") or [])]
    for key, dataset in datasets:
        if isinstance(dataset, dict):
            name = dataset.get("name")
            yield f"{key}.source", dataset.get("source"), f"dataset {name!r}" if isinstance(name, str) else f"dataset {key}"


LOW_PRECISION_WEIGHTS = ("bfloat16", "bf16", "float16", "fp16", "half", "16")
PURE_16BIT_PRECISIONS = ("bf16-true", "16-true")


def precision_problems(run: dict) -> list[str]:
    """16-bit master weights train only when asked for by name (``model.allow_16bit_weights``).

    AdamW's update at lr 1e-6 is far below one bf16 step of a weight of size 0.02, so pure bf16
    leaves most weights unchanged and nothing fails (docs/GPU.md): fp32 masters with
    ``trainer.precision=bf16-mixed`` compute in bf16 and keep every update."""
    if lookup(run, "model.allow_16bit_weights") is True or lookup(run, "optim.lr") == 0:
        return []
    dtype = str(lookup(run, "model.dtype")).lower().removeprefix("torch.")
    precision = str(lookup(run, "trainer.precision")).lower()
    found = []
    if dtype in LOW_PRECISION_WEIGHTS:
        found.append(f"model.dtype={dtype} keeps the master weights and AdamW states in 16 bits: updates "
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

    loggers = run.get("logger")
    return [f"logger.{name} ({node['_target_']}) needs the wandb package, which is not installed: "
            f"{INSTALL_HINT} (or choose logger=tensorboard)"
            for name, node in (loggers if isinstance(loggers, dict) else {}).items()
            if isinstance(node, dict) and is_wandb_target(node.get("_target_")) and not wandb_installed()]


def _benchmark_problems(run: dict) -> list[str]:
    benchmarks = run.get("benchmark") if isinstance(run.get("benchmark"), dict) else {}
    return source_problems((f"benchmark.{k}", v, f"benchmark {k!r}") for k, v in benchmarks.items())


def _check(cfg: DictConfig, what: str, *checks: Callable[[dict], list[str]]) -> None:
    """Raise one ``ValueError`` listing every ``???`` value of ``cfg`` and every problem the
    ``checks`` of its plain values find, each by its key."""
    missing: list[str] = []
    run = plain(cfg, missing)
    found = [f"{key} must be set (it is ???)" for key in missing]
    for check in checks:
        found += check(run)
    if found:
        listed = "\n  ".join(found)
        raise ValueError(f"{len(found)} bad value(s) in the {what} config:\n  {listed}")


def check_train_config(cfg: DictConfig, *checks: Callable[[dict], list[str]]) -> None:
    """Check the training config (``checks``: more checks of its plain values, e.g.
    ``train.lora_target_problems``)."""
    _check(cfg, "training", partial(problems, TrainConfig), plugin_problems,
           lambda run: source_problems(_train_sources(run)), precision_problems, logger_problems,
           *checks)


def check_eval_config(cfg: DictConfig) -> None:
    """Check the evaluation config, benchmarks included."""
    _check(cfg, "evaluation", partial(problems, EvalConfig), _benchmark_problems)


# --------------------------------------------------------------------------- generated presets

# The schemas' defaults as the files ``configs/<group>/_defaults.yaml``, which the presets extend:
# a preset lists only what it changes, and every setting stays overridable (``optim.lr=...``).
# Files, not ConfigStore nodes registered on import: Hydra's compose API (a notebook, a benchmark)
# then composes what the CLI does without importing medsrl first. tests/test_config.py fails when
# one is out of date with its schema.
DEFAULTS_SCHEMAS = {"algorithm": AlgorithmSection, "optim": OptimConfig, "rollout": RolloutConfig}
WRITE_DEFAULTS = "python -m medsrl.config --write-defaults"
CONFIG_ROOT = Path(__file__).resolve().parents[2] / "configs"


def defaults_path(group: str, config_dir: Path = CONFIG_ROOT) -> Path:
    return Path(config_dir) / group / "_defaults.yaml"


def defaults_yaml(group: str) -> str:
    """The text of ``configs/<group>/_defaults.yaml``: what it is, then the schema's defaults."""
    schema = DEFAULTS_SCHEMAS[group]
    header = (f"# GENERATED from the defaults of {schema.__name__} (src/medsrl/config.py, where each setting is\n"
              f"# described): do not edit. Change the schema, then regenerate: {WRITE_DEFAULTS}\n"
              f"# Not a preset: the base the {group} presets extend (`- _defaults` in their defaults list).\n")
    return header + OmegaConf.to_yaml(schema().model_dump(mode="json"))


def write_defaults(config_dir: Path = CONFIG_ROOT) -> list[Path]:
    """Write every ``<group>/_defaults.yaml`` under ``config_dir``; returns those whose text changed."""
    changed = []
    for group in DEFAULTS_SCHEMAS:
        path, text = defaults_path(group, config_dir), defaults_yaml(group)
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            changed.append(path)
    return changed


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="The settings' schemas (src/medsrl/config.py).")
    ap.add_argument("--write-defaults", action="store_true", help="regenerate configs/<group>/_defaults.yaml")
    if not ap.parse_args().write_defaults:
        ap.error("nothing to do: pass --write-defaults")
    for path in write_defaults():
        print(f"wrote {path}")
