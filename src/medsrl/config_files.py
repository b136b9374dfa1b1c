"""The files written from the schemas, never by hand (``tests/test_config.py`` fails when one is
stale; regenerate with ``python -m medsrl.config_files --write``): ``configs/<group>/_defaults.yaml``
(a section's defaults its presets extend, so a preset lists only what it changes; files, not
ConfigStore nodes, so Hydra's compose API needs no medsrl import), ``configs/plugins/<name>.yaml``
(a plug-in's ``_target_`` and defaults) and ``docs/SETTINGS.md``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from pydantic_core import to_jsonable_python

from medsrl.algo.advantages import ADVANTAGE_ESTIMATORS, ADVANTAGE_OPTIONS
from medsrl.algo.policy_loss import POLICY_LOSS_OPTIONS, POLICY_LOSSES
from medsrl.data.settings import DataConfig, Source
from medsrl.models.settings import ModelConfig
from medsrl.rollout.settings import RolloutConfig
from medsrl.run_config import CONFIG_DIR, AlgorithmSection, EvalRunConfig, RunConfig, target_class
from medsrl.settings import Settings, help_of, inner_model, settings_model
from medsrl.step.settings import OptimConfig

DEFAULTS_SCHEMAS = {"algorithm": AlgorithmSection, "optim": OptimConfig, "rollout": RolloutConfig, "model": ModelConfig,
                    "data": DataConfig,
                    # the run's settings without a config group (model/, trainer/, ... give the others)
                    "train": RunConfig,
                    "eval": EvalRunConfig}  # configs/eval.yaml extends configs/eval/_defaults.yaml
WRITE = "python -m medsrl.config_files --write"
REFERENCE = CONFIG_DIR.parent / "docs" / "SETTINGS.md"
_NOTICE = "GENERATED from {what}, where each setting is described: do not edit.\n# Regenerate: {write}"


def defaults_path(group: str, config_dir: Path = CONFIG_DIR) -> Path:
    return Path(config_dir) / group / "_defaults.yaml"


def schema_defaults(group: str, config_dir: Path = CONFIG_DIR) -> dict[str, Any]:
    """Each setting's default, ``???`` for a required one; for ``train``, those without a config group."""
    schema = DEFAULTS_SCHEMAS[group]
    return {field.alias or name: "???" if field.is_required() else
            to_jsonable_python(field.get_default(call_default_factory=True), by_alias=True)
            for name, field in schema.model_fields.items()
            if group != "train" or not (Path(config_dir) / name).is_dir()}


def defaults_yaml(group: str) -> str:
    """The text of ``configs/<group>/_defaults.yaml``: what it is, then the schema's defaults."""
    schema = DEFAULTS_SCHEMAS[group]
    what = f"the defaults of {schema.__name__} ({schema.__module__})"
    base = (f"the base configs/{group}.yaml extends (`- {group}/_defaults@_here_`)"
            + (": the settings without a config group" if group == "train" else "")
            if (CONFIG_DIR / f"{group}.yaml").is_file() else
            f"the base the {group} presets extend (`- _defaults` in their defaults list)")
    return (f"# {_NOTICE.format(what=what, write=WRITE)}\n# Not a preset: {base}.\n"
            + OmegaConf.to_yaml(schema_defaults(group)))


def plugin_yaml(target: str) -> str:
    """The text of ``configs/plugins/<name>.yaml``: the plug-in's class and its defaults."""
    cls = target_class(target)
    what = f"the signature of {cls.__name__} ({cls.__module__})"
    values = {"_target_": target, **settings_model(cls)().model_dump(mode="json")}
    return f"# {_NOTICE.format(what=what, write=WRITE)}\n" + OmegaConf.to_yaml(values)


def reference_md(config_dir: Path = CONFIG_DIR) -> str:
    """docs/SETTINGS.md: each section's settings, their defaults and help."""
    what = "the schemas (src/medsrl/**/settings.py, plug-in and callback signatures)"
    notice = _NOTICE.format(what=what, write=WRITE).replace("\n# ", " ")
    out = ["# Settings", "", f"<!-- {notice} -->", "",
           "Every setting of `medsrl-train` (configs/train.yaml) and `medsrl-eval` (configs/eval.yaml), with its "
           "default and what it does. Override any on the command line: `medsrl-train rollout.n=16`.", ""]
    top = {k: f for k, f in RunConfig.model_fields.items() if not inner_model(f.annotation)[0]}
    out += _table("Run", "", RunConfig, top)
    for name in ("model", "data", "rollout", "algorithm", "optim", "grader", "trainer"):
        schema = inner_model(RunConfig.model_fields[name].annotation)[0]
        out += _table(name, name, schema)
    for kind, models, names in (("advantage", ADVANTAGE_OPTIONS, ADVANTAGE_ESTIMATORS),
                                ("policy_loss", POLICY_LOSS_OPTIONS, POLICY_LOSSES)):
        for name, model in sorted((n, models[n]) for n in names):
            if model.model_fields:
                out += _table(f"algorithm.{kind}={name}", f"algorithm.{kind}_options", model)
    for path in sorted((Path(config_dir) / "plugins").glob("*.yaml")):
        cls = target_class(OmegaConf.load(path)["_target_"])
        out += _table(f"plugins={path.stem} ({cls.__name__})", f"algorithm.plugins.{path.stem}", settings_model(cls))
    callbacks = OmegaConf.load(Path(config_dir) / "callbacks" / "default.yaml")
    for name, node in callbacks.items():
        cls = target_class(node["_target_"])
        if cls.__module__.startswith("medsrl."):
            out += _table(f"callbacks.{name} ({cls.__name__})", f"callbacks.{name}", settings_model(cls))
    out += _table("Evaluation (configs/eval.yaml)", "", EvalRunConfig,
                  {k: f for k, f in EvalRunConfig.model_fields.items() if k not in ("rollout", "paths")})
    out += _table("Data sources (`source:` of a dataset, each benchmark)", "", Source)
    return "\n".join(out).rstrip() + "\n"


def _table(title: str, prefix: str, schema: type, fields: dict | None = None) -> list[str]:
    return [f"## {title}", "", "| setting | default | |", "|---|---|---|", *_rows(prefix, schema, fields), ""]


def _rows(prefix: str, schema: type, fields: dict | None = None) -> list[str]:
    rows = []
    for name, field in (fields if fields is not None else schema.model_fields).items():
        key = f"{prefix}.{name}" if prefix else name
        sub, held = inner_model(field.annotation)
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

    ap = argparse.ArgumentParser(description="The files generated from the schemas.")
    ap.add_argument("--write", action="store_true", help="regenerate the _defaults, plug-in and reference files")
    if not ap.parse_args().write:
        ap.error("nothing to do: pass --write")
    from medsrl import config_files  # as medsrl names it, not as __main__

    for path in config_files.write_generated():
        print(f"wrote {path}")
