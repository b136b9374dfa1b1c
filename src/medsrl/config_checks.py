"""Type and range checks of every known config value, run at start, before any model loads.

Without them a bad value fails late and far from its key: ``optim.lr=abc`` inside torch's AdamW,
``rollout.n=0`` in the first step's sampling. Here each value is checked against a declarative
rule (a table ``hydra key -> rule``), every problem is collected, and one ``ValueError`` lists
them all as ``<hydra key> must be <what>, got <value>``.

Keys a config does not have are skipped (configs differ by algorithm and experiment); ``*`` in a
rule's key stands for every key of a mapping or index of a list (``data.stages.*.start_step``).
Plug-ins under ``algorithm.plugins`` are checked by their ``_target_`` class, whatever their key.
Strings are never numbers here: ``"1e-5"`` (a quoted YAML value) is refused, not converted.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

__all__ = ["Rule", "check_eval_config", "check_train_config", "collect_problems"]

_ABSENT: Any = object()  # a key the config does not have
_MISSING: Any = object()  # a key whose value is ``???`` (reported once, by the missing check)
SEED_MAX = 2**32 - 1  # numpy's (and Lightning's seed_everything's) bound


# --------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class Rule:
    """A check of one value: ``ok(value)``, and what the value must be (for the message)."""

    ok: Callable[[Any], bool]
    must_be: str


def _is_number(v: Any) -> bool:
    """A finite int or float; never a bool or a string (``"1e-5"`` is not a number here)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _bounds(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high}"
    return ""


def _within(v: float, low: float | None, high: float | None, low_open: bool, high_open: bool) -> bool:
    above = low is None or (v > low if low_open else v >= low)
    below = high is None or (v < high if high_open else v <= high)
    return above and below


def number(low: float | None = None, high: float | None = None, *, low_open: bool = False,
           high_open: bool = False, must_be: str | None = None) -> Rule:
    """A finite number (int or float) within the bounds."""
    text = must_be or f"a number {_bounds(low, high, low_open, high_open)}".rstrip()
    return Rule(lambda v: _is_number(v) and _within(v, low, high, low_open, high_open), text)


def integer(low: int | None = None, high: int | None = None) -> Rule:
    """An int (not a bool, not a float such as 2.0) within the bounds."""
    text = f"an int {_bounds(low, high, False, False)}".rstrip()
    return Rule(lambda v: _is_int(v) and _within(v, low, high, False, False), text)


def choice(*options: str) -> Rule:
    """One of the given strings."""
    return Rule(lambda v: isinstance(v, str) and v in options, "one of " + ", ".join(map(repr, options)))


def optional(rule: Rule) -> Rule:
    """``rule`` or null."""
    return Rule(lambda v: v is None or rule.ok(v), f"{rule.must_be} or null")


def either(*rules: Rule) -> Rule:
    """Any one of the rules."""
    return Rule(lambda v: any(r.ok(v) for r in rules), " or ".join(r.must_be for r in rules))


def pair(rule: Rule) -> Rule:
    """A list of two values, each passing ``rule`` (Adam's betas)."""
    return Rule(
        lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(rule.ok(x) for x in v),
        f"a pair of numbers each {rule.must_be.removeprefix('a number ')}",
    )


BOOL = Rule(lambda v: isinstance(v, bool), "true or false")
STRING = Rule(lambda v: isinstance(v, str), "a string")
POSITIVE = number(0, low_open=True, must_be="a positive number")
NON_NEGATIVE = number(0)
TOP_P = number(0, 1, low_open=True)
POSITIVE_INT = integer(1)
COUNT = integer(0)
SEED = integer(0, SEED_MAX)
# What select_layers takes: the last N layers, "half", "all", or a list of 1-based layers.
LAYERS = Rule(
    lambda v: (_is_int(v) and v >= 1)
    or (isinstance(v, str) and (v.strip().lower() in ("half", "all") or v.strip().isdigit()))
    or (isinstance(v, list) and len(v) > 0 and all(_is_int(x) and x >= 1 for x in v)),
    "an int >= 1, 'half', 'all' or a list of 1-based layers",
)
# What PEFT's LoraConfig.target_modules takes here: module names, or every linear layer.
LORA_TARGETS = Rule(
    lambda v: v == "all-linear" or (isinstance(v, list) and len(v) > 0
                                    and all(isinstance(x, str) and x.strip() for x in v)),
    "a non-empty list of module names (q_proj, ...) or 'all-linear'",
)


# --------------------------------------------------------------------------- tables


def _dtypes() -> tuple[str, ...]:
    from medsrl.models.loading import _DTYPES

    return ("auto", *sorted(_DTYPES))


def _feature_dtypes() -> tuple[str, ...]:
    from medsrl.methods.meds.features import DTYPES

    return tuple(DTYPES)


def _grader_rules() -> dict[str, Rule]:
    # num_workers=0 grades in-process without a timeout (MathGrader: for debugging only).
    return {"grader.timeout_s": POSITIVE, "grader.num_workers": optional(COUNT),  # null: one per core
            "grader.reasoning_end": optional(Rule(lambda v: isinstance(v, str) and v.strip() != "",
                                                  "a non-empty tag such as '</think>', or null"))}


def _template_rules(prefix: str) -> dict[str, Rule]:
    """The prompt format (``data.template`` / eval's ``template``; data/template.py)."""
    from medsrl.data.template import TEMPLATE_KINDS

    return {f"{prefix}.kind": choice(*TEMPLATE_KINDS), f"{prefix}.system_prompt": optional(STRING),
            f"{prefix}.instruction": optional(STRING), f"{prefix}.extra_empty_assistant_turn": BOOL,
            f"{prefix}.enable_thinking": optional(BOOL)}


# Settings of a file or generator source (load_math_file, generate_arithmetic, ...).
SOURCE_RULES: dict[str, Rule] = {
    "path": STRING,
    "name": optional(STRING),
    "num": POSITIVE_INT,
    "limit": optional(POSITIVE_INT),
    "on_bad_row": choice("skip", "raise"),
    "problem_field": optional(STRING),
    "answer_field": optional(STRING),
    "split": STRING,
}


def train_rules() -> dict[str, Rule]:
    """The rules of the training config (configs/train.yaml and its groups), plug-ins aside.
    Built on each call: the registries may have gained entries (``register_advantage``)."""
    from medsrl.algo import ADVANTAGE_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES
    from medsrl.algo.kl import _KL_ALIASES

    return {
        "seed": SEED,
        "resume_mode": choice("full", "weights"),
        "ckpt_path": optional(STRING),
        "export_policy": BOOL,
        "skip_if_done": BOOL,
        "optimized_metric": optional(STRING),
        "model.dtype": choice(*_dtypes()),
        "model.gradient_checkpointing": BOOL,
        "model.random_init": BOOL,
        # LoRA (models/lora.py): r 0 = off; target names are checked against the model below
        "model.lora.r": integer(0),
        "model.lora.alpha": POSITIVE,
        "model.lora.dropout": number(0, 1, high_open=True),
        "model.lora.target_modules": LORA_TARGETS,
        "model.lora.merge_on_export": BOOL,
        # what an experiment is sized for (medsrl-plan checks it): null, or {name, gpu_memory_gib}
        "hardware.name": STRING,
        "hardware.gpu_memory_gib": POSITIVE,
        # optim: lr 0 is allowed on purpose (a weights-only start that must keep the weights)
        "optim.lr": NON_NEGATIVE,
        "optim.weight_decay": NON_NEGATIVE,
        "optim.betas": pair(number(0, 1, high_open=True)),
        "optim.eps": POSITIVE,
        "optim.warmup_steps": COUNT,
        "optim.grad_clip": number(0, must_be="a number >= 0 (0: no clipping)"),
        "optim.max_param_norm_growth": either(number(0, 0, must_be="0 (off)"),
                                                number(1, low_open=True, must_be="a number > 1")),
        # rollout
        "rollout.backend": choice("hf", "vllm"),
        "rollout.n": POSITIVE_INT,
        "rollout.temperature": POSITIVE,
        "rollout.top_p": TOP_P,
        "rollout.max_new_tokens": POSITIVE_INT,
        "rollout.max_batch_size": POSITIVE_INT,
        "rollout.max_prompt_tokens": POSITIVE_INT,
        "rollout.logprobs": BOOL,
        "rollout.vllm.gpu_memory_utilization": TOP_P,
        "rollout.vllm.kv_cache_memory_bytes": optional(POSITIVE_INT),
        "rollout.vllm.tensor_parallel_size": POSITIVE_INT,
        "rollout.vllm.enforce_eager": BOOL,
        "rollout.vllm.enable_sleep_mode": BOOL,
        "rollout.vllm.dtype": STRING,
        "rollout.vllm.max_model_len": optional(POSITIVE_INT),
        "rollout.vllm.per_request_seeds": BOOL,
        # algorithm
        "algorithm.name": STRING,
        "algorithm.advantage": choice(*sorted(ADVANTAGE_ESTIMATORS)),
        "algorithm.policy_loss": choice(*sorted(POLICY_LOSSES)),
        "algorithm.clip_low": NON_NEGATIVE,
        "algorithm.clip_high": NON_NEGATIVE,
        "algorithm.dual_clip": optional(number(1, low_open=True)),
        "algorithm.loss_agg_mode": choice(*LOSS_AGG_MODES),
        "algorithm.kl_coef": NON_NEGATIVE,
        "algorithm.kl_kind": choice(*_KL_ALIASES),
        "algorithm.entropy_coef": NON_NEGATIVE,  # the update only adds a term when > 0
        "algorithm.ppo_epochs": POSITIVE_INT,
        "algorithm.mini_batch_prompts": optional(POSITIVE_INT),
        "algorithm.micro_batch_size": POSITIVE_INT,
        "algorithm.max_tokens_per_microbatch": optional(POSITIVE_INT),
        "algorithm.engine_is_cap": optional(POSITIVE),
        # data
        "data.prompts_per_step": POSITIVE_INT,
        "data.val_size": optional(POSITIVE_INT),
        "data.seed": SEED,
        "data.stages.*.name": STRING,
        "data.stages.*.start_step": COUNT,
        "data.stages.*.datasets.*.name": STRING,
        "data.stages.*.datasets.*.weight": POSITIVE,
        "data.val.*.name": STRING,
        **_template_rules("data.template"),
        # trainer (Lightning): max_steps -1 = no limit
        "trainer.max_steps": either(POSITIVE_INT, Rule(lambda v: v == -1 and _is_int(v), "-1")),
        "trainer.log_every_n_steps": POSITIVE_INT,
        "trainer.enable_progress_bar": BOOL,
        **_grader_rules(),
        # callbacks
        "callbacks.pass_at_k.n": POSITIVE_INT,
        "callbacks.pass_at_k.every_n_steps": COUNT,  # 0: off
        "callbacks.pass_at_k.num_problems": optional(POSITIVE_INT),
        "callbacks.pass_at_k.at_start": BOOL,
        "callbacks.pass_at_k.batch_size": POSITIVE_INT,
        "callbacks.pass_at_k.temperature": NON_NEGATIVE,  # 0: greedy
        "callbacks.pass_at_k.top_p": TOP_P,
        "callbacks.pass_at_k.max_new_tokens": optional(POSITIVE_INT),
        "callbacks.pass_at_k.seed": SEED,
        "callbacks.sample_logger.every_n_steps": COUNT,  # 0: off
        "callbacks.sample_logger.num_samples": COUNT,
        "callbacks.progress_bar.refresh_rate": COUNT,  # 0: no bar
        "callbacks.progress_bar.window": POSITIVE_INT,
        "callbacks.model_checkpoint.every_n_train_steps": optional(COUNT),
        "callbacks.milestones.every_n_steps": COUNT,  # 0: off
        "callbacks.milestones.dtype": choice(*_dtypes()),
    }


def _feature_rules() -> dict[str, Rule]:
    """The MEDS feature settings, shared by the MEDS and novelty plug-ins."""
    return {"layers": LAYERS, "diff": BOOL, "final_norm": BOOL, "feature_dtype": choice(*_feature_dtypes())}


def plugin_rules() -> dict[str, dict[str, Rule]]:
    """Rules of each known plug-in's settings, by the class name of its ``_target_``."""
    from medsrl.methods.meds.penalty import TARGETS
    from medsrl.methods.novelty import VECTORS

    snapshots = {"snapshot_every_n_steps": COUNT, "panels_every_n_steps": COUNT, "snapshot_dir": optional(STRING)}
    return {
        "Meds": {
            "alpha": NON_NEGATIVE,
            "beta": optional(NON_NEGATIVE),
            **_feature_rules(),
            "target": choice(*TARGETS),
            "noise_is_cluster": BOOL,
            "k": POSITIVE_INT,
            "min_cluster_size": integer(2),
            "min_samples": POSITIVE_INT,
            "cap_per_key": optional(POSITIVE_INT),
            "mode": choice("cluster", "single"),
            "refit": choice("background", "sync"),
            "refit_workers": POSITIVE_INT,
            "refit_growth": NON_NEGATIVE,
            "mixed_groups_only": BOOL,
            "remember_dropped": BOOL,
            "reset_on_stage_change": BOOL,
            "panel_prompts": COUNT,
            **snapshots,
        },
        "DynamicSampling": {"max_rounds": COUNT},
        # 0 < buffer_length < rollout.max_new_tokens: the upper bound is a relation (below)
        "OverlongPenalty": {"buffer_length": POSITIVE_INT, "penalty_factor": NON_NEGATIVE},
        "EntropyBonus": {"coef": NON_NEGATIVE, "cap_ratio": NON_NEGATIVE},
        "NoveltyBonus": {"vectors": choice(*VECTORS), **_feature_rules()},
        "Steer": {"low": NON_NEGATIVE, "high": NON_NEGATIVE},
        "R3": {
            "replay.enabled": BOOL,
            "replay.k": optional(POSITIVE_INT),
            "replay.alpha": NON_NEGATIVE,
            "replay.lam": POSITIVE,
            "replay.importance_cap": optional(POSITIVE),
            "reflection.enabled": BOOL,
            "reflection.tau": optional(number()),
            "reflection.instruction": STRING,
            "reflection.max_prompts": optional(COUNT),
            "ranking.enabled": BOOL,
            "ranking.p": TOP_P,
            "ranking.r_max": NON_NEGATIVE,
            "length_bonus": optional(POSITIVE_INT),
            "cap_per_key": optional(POSITIVE_INT),
            "min_visits": COUNT,
            "start_step": COUNT,
            **snapshots,
        },
    }


def eval_rules() -> dict[str, Rule]:
    """The rules of the evaluation config (configs/eval.yaml), benchmarks aside."""
    return {
        "model_path": Rule(lambda v: v is None or isinstance(v, (str, list, dict)),
                           "a path, a list of paths, a {name: path} mapping or null"),
        "runs_dir": optional(STRING),
        "tokenizer": optional(STRING),
        "dtype": choice(*_dtypes()),
        "device": STRING,
        **_template_rules("template"),
        "n": POSITIVE_INT,
        "temperature": NON_NEGATIVE,  # 0: greedy
        "top_p": TOP_P,
        "max_new_tokens": POSITIVE_INT,
        "seed": SEED,
        "batch_size": POSITIVE_INT,
        "limit": optional(POSITIVE_INT),
        "features.layers": LAYERS,
        "features.diff": BOOL,
        "features.final_norm": BOOL,
        "features.dtype": choice(*_feature_dtypes()),
        **_grader_rules(),
    }


# --------------------------------------------------------------------------- reading the config


def expand(cfg: Any, pattern: str) -> Iterator[str]:
    """The concrete keys a pattern names in ``cfg``: ``*`` stands for every key of a mapping or
    index of a list; a plain part must exist. Keys whose value is absent are not yielded."""
    head, _, rest = pattern.partition(".")
    if head == "*":
        if isinstance(cfg, (DictConfig, Mapping)):
            parts = [str(k) for k in cfg.keys()]
        elif isinstance(cfg, (ListConfig, list)):
            parts = [str(i) for i in range(len(cfg))]
        else:
            return
    else:
        parts = [head]
    for part in parts:
        child = _child(cfg, part)
        if child is _ABSENT:
            continue
        if not rest:
            yield part
        else:
            yield from (f"{part}.{k}" for k in expand(child, rest))


def _child(node: Any, part: str) -> Any:
    """``node[part]`` (a mapping key or a list index), ``_ABSENT`` when there is none; a missing
    (``???``) value is returned as ``_MISSING`` and an unresolvable one raises."""
    if isinstance(node, DictConfig):
        if part not in node:
            return _ABSENT
        if OmegaConf.is_missing(node, part):
            return _MISSING
        return node[part]
    if isinstance(node, Mapping):
        return node.get(part, _ABSENT)
    if isinstance(node, (ListConfig, list)) and part.isdigit() and int(part) < len(node):
        if isinstance(node, ListConfig) and OmegaConf.is_missing(node, int(part)):
            return _MISSING
        return node[int(part)]
    return _ABSENT


def lookup(cfg: Any, key: str) -> Any:
    """The value at a dotted key, plain Python (lists and dicts, not OmegaConf nodes), or
    ``_ABSENT`` / ``_MISSING``."""
    node = cfg
    for part in key.split("."):
        node = _child(node, part)
        if node is _ABSENT or node is _MISSING:
            return node
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node


def problem(key: str, rule: Rule, value: Any) -> str:
    """The message of one bad value."""
    return f"{key} must be {rule.must_be}, got {value!r}"


def collect_problems(cfg: Any, rules: Mapping[str, Rule], prefix: str = "") -> list[str]:
    """Every value of ``cfg`` that a rule (``pattern -> rule``) refuses, as messages."""
    found = []
    for pattern, rule in rules.items():
        for key in expand(cfg, prefix + pattern):
            value = lookup(cfg, key)
            if value is not _MISSING and not rule.ok(value):
                found.append(problem(key, rule, value))
    return found


def missing_problems(cfg: DictConfig) -> list[str]:
    """Required values (``???``) left unset."""
    return [f"{key} must be set (it is ???)" for key in sorted(OmegaConf.missing_keys(cfg))]


# --------------------------------------------------------------------------- sections


def _plugin_class(target: str):
    """The class a ``_target_`` names, or None when it cannot be imported."""
    from hydra.utils import get_class

    try:
        return get_class(target)
    except Exception:  # hydra raises ImportError or ValueError: reported by the caller
        return None


def _accepted_keys(cls) -> set[str] | None:
    """The keyword arguments ``cls`` takes; None when it takes any (``**kwargs``)."""
    params = inspect.signature(cls.__init__).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.name != "self"}


def plugin_problems(cfg: DictConfig) -> list[str]:
    """``algorithm.plugins.<name>``: an importable ``_target_``, only keys it takes, and the
    rules of its class. Entries without ``_target_`` are ignored by the trainer, so here too."""
    plugins = lookup(cfg, "algorithm.plugins")
    if not isinstance(plugins, dict):
        return []
    rules_by_class = plugin_rules()
    found = []
    for name, node in plugins.items():
        if not isinstance(node, dict) or "_target_" not in node:
            continue
        where = f"algorithm.plugins.{name}"
        target = node["_target_"]
        cls = _plugin_class(target) if isinstance(target, str) else None
        if cls is None:
            found.append(f"{where}._target_ must be an importable plug-in class, got {target!r}")
            continue
        accepted = _accepted_keys(cls)
        if accepted is not None:
            for key in sorted(k for k in node if not k.startswith("_") and k not in accepted):
                found.append(f"{where}.{key} is not a setting of {cls.__name__} (known: {', '.join(sorted(accepted))})")
        found += collect_problems(cfg, rules_by_class.get(cls.__name__, {}), prefix=f"{where}.")
    return found


def _dataclass_sections() -> dict[str, type]:
    """The sections that ``medsrl.config`` builds into dataclasses (which refuse unknown keys
    only when the module is built, after the model)."""
    from medsrl import config

    return {"algorithm": config.AlgorithmConfig, "rollout": config.RolloutConfig,
            "rollout.vllm": config.VLLMConfig, "optim": config.OptimConfig, "grader": config.GraderConfig}


def unknown_key_problems(cfg: DictConfig) -> list[str]:
    """Keys of the dataclass-built sections that no field takes (``+algorithm.clip_hgh=0.3``)."""
    found = []
    for section, cls in _dataclass_sections().items():
        node = lookup(cfg, section)
        if not isinstance(node, dict):
            continue
        known = {f.name for f in fields(cls)} | ({"plugins"} if section == "algorithm" else set())
        for key in sorted(set(node) - known):
            found.append(f"{section}.{key} is not a setting of {section} (known: {', '.join(sorted(known))})")
    return found


def source_problems(cfg: DictConfig, owners: Sequence[tuple[str, str]]) -> list[str]:
    """The settings of file and generator sources (``num``, ``limit``, ``path`` ...), each
    message naming the dataset or benchmark and the loader or generator."""
    found = []
    for key, label in owners:
        node = lookup(cfg, key)
        if not isinstance(node, dict) or "_target_" not in node:
            continue
        context = f" ({label}, {node['_target_']})"
        found += [p + context for p in collect_problems(cfg, SOURCE_RULES, prefix=f"{key}.")]
    return found


def _train_sources(cfg: DictConfig) -> list[tuple[str, str]]:
    """``(source key, "dataset 'name'")`` of every training and validation dataset."""
    owners = []
    for pattern in ("data.stages.*.datasets.*", "data.val.*"):
        for key in expand(cfg, pattern):
            name = lookup(cfg, f"{key}.name")
            label = f"dataset {name!r}" if isinstance(name, str) else f"dataset {key}"
            owners.append((f"{key}.source", label))
    return owners


def relation_problems(cfg: DictConfig) -> list[str]:
    """Bounds that depend on another value (checked only when both values are well typed)."""
    found = []
    max_new = lookup(cfg, "rollout.max_new_tokens")
    for name in expand(cfg, "algorithm.plugins.*"):
        node = lookup(cfg, name)
        if not isinstance(node, dict):
            continue
        target = str(node.get("_target_", ""))
        if target.endswith(".OverlongPenalty") and _is_int(node.get("buffer_length")) and _is_int(max_new):
            if node["buffer_length"] >= max_new:
                found.append(f"{name}.buffer_length must be less than rollout.max_new_tokens "
                             f"({max_new}), got {node['buffer_length']!r}")
        if target.endswith(".Steer") and _is_number(node.get("low")) and _is_number(node.get("high")):
            if node["low"] > node["high"]:
                found.append(f"{name}.low must be <= {name}.high ({node['high']!r}), got {node['low']!r}")
    return found


LOW_PRECISION_WEIGHTS = ("bfloat16", "bf16", "float16", "fp16", "half", "16")
PURE_16BIT_PRECISIONS = ("bf16-true", "16-true")


def weight_precision_problems(cfg: DictConfig) -> list[str]:
    """16-bit master weights train only when asked for by name (``model.allow_16bit_weights``).

    AdamW's update at lr 1e-6 is far below one bf16 step of a weight of size 0.02, so pure bf16
    leaves most weights unchanged and nothing fails (docs/GPU.md): fp32 masters with
    ``trainer.precision=bf16-mixed`` compute in bf16 and keep every update."""
    if lookup(cfg, "model.allow_16bit_weights") is True or lookup(cfg, "optim.lr") == 0:
        return []
    dtype = str(lookup(cfg, "model.dtype")).lower().removeprefix("torch.")
    precision = str(lookup(cfg, "trainer.precision")).lower()
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


def lora_problems(cfg: DictConfig) -> list[str]:
    """``model.lora``: no unknown key, and with ``r > 0`` every ``target_modules`` name matching a
    module of the model, checked on the model built on the ``meta`` device (as medsrl-plan
    builds it) before any weight loads; a model that cannot be built so is checked after load."""
    node = lookup(cfg, "model.lora")
    if not isinstance(node, dict):
        return []
    from medsrl.models.lora import LoraSettings, target_problems

    known = {f.name for f in fields(LoraSettings)}
    found = [f"model.lora.{k} is not a setting of model.lora (known: {', '.join(sorted(known))})"
             for k in sorted(set(node) - known)]
    targets = node.get("target_modules")
    if found or not (_is_int(node.get("r")) and node["r"] > 0) or not LORA_TARGETS.ok(targets):
        return found
    from medsrl.plan.model_size import meta_model

    try:
        model = meta_model(lookup(cfg, "model"))
    except Exception:  # no shape or config.json to build from: apply_lora checks after load
        return found
    return found + target_problems(model, targets)


def logger_problems(cfg: DictConfig) -> list[str]:
    """A logger whose package is not installed: W&B (``logger=wandb`` / ``many``) is the
    ``wandb`` extra, so say how to install it rather than fail in Lightning's constructor."""
    from medsrl.utils.wandb_log import INSTALL_HINT, is_wandb_target, wandb_installed

    loggers = cfg.get("logger") if isinstance(cfg, (DictConfig, Mapping)) else None
    if not isinstance(loggers, (DictConfig, Mapping)):
        return []
    found = []
    for name, node in loggers.items():  # only _target_ is read: the rest may need Hydra to resolve
        if isinstance(node, (DictConfig, Mapping)) and is_wandb_target(node.get("_target_")) and not wandb_installed():
            found.append(f"logger.{name} ({node['_target_']}) needs the wandb package, which is not "
                         f"installed: {INSTALL_HINT} (or choose logger=tensorboard)")
    return found


def _raise(found: list[str], what: str) -> None:
    if found:
        listed = "\n  ".join(found)
        raise ValueError(f"{len(found)} bad value(s) in the {what} config:\n  {listed}")


def check_train_config(cfg: DictConfig) -> None:
    """Check the training config; raise one ``ValueError`` listing every bad value by its key."""
    found = missing_problems(cfg)
    found += collect_problems(cfg, train_rules())
    found += unknown_key_problems(cfg)
    found += plugin_problems(cfg)
    found += source_problems(cfg, _train_sources(cfg))
    found += relation_problems(cfg)
    found += weight_precision_problems(cfg)
    found += logger_problems(cfg)
    found += lora_problems(cfg)
    _raise(found, "training")


def check_eval_config(cfg: DictConfig) -> None:
    """Check the evaluation config (benchmarks included); raise one ``ValueError`` listing every
    bad value by its key."""
    found = missing_problems(cfg)
    found += collect_problems(cfg, eval_rules())
    found += source_problems(cfg, [(key, f"benchmark {key.split('.', 1)[1]!r}") for key in expand(cfg, "benchmark.*")])
    _raise(found, "evaluation")
