"""Settings of each package (grader workers), the presets and composing without importing medsrl."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from medsrl.reward.settings import MAX_GRADER_WORKERS, GraderConfig, grader_workers
from run_helpers import ROOT


def test_grader_workers_follow_the_cores_split_between_a_nodes_processes(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert grader_workers() == MAX_GRADER_WORKERS == 16
    assert grader_workers(processes_per_node=8) == 8
    assert grader_workers(processes_per_node=128) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert grader_workers() == 2
    assert GraderConfig().workers() == 2  # null: one per core
    assert GraderConfig(num_workers=0).workers(8) == 0  # as configured (0: in-process)


def test_every_fsdp_experiment_checkpoints_in_shards():
    """A full state dict has rank 0 gather the weights and both AdamW moments (~91 GB at 7B) at
    every checkpoint, and every rank gather them again at resume; sharded checkpoints (the
    default of trainer=fsdp) write and read each rank's shard only."""
    from run_helpers import ROOT, compose_train

    fsdp = []
    for path in sorted((ROOT / "configs" / "experiment").glob("[!_]*.yaml")):
        name = path.stem
        cfg = compose_train(Path("/tmp/unused"), [f"experiment={name}"], debug=None)
        if "fsdp" in str(cfg.trainer.get("strategy", "")).lower():
            fsdp.append(name)
            assert cfg.trainer.strategy.state_dict_type == "sharded", name
    assert sorted(fsdp) == ["qwen2.5-math-7b_dapo", "qwen2.5-math-7b_meds", "qwen3-8b_dapo", "qwen3-8b_meds"]


def test_the_generated_files_are_current():
    """``configs/<group>/_defaults.yaml``, ``configs/plugins/*.yaml`` and docs/SETTINGS.md are
    written from the schemas: a default changed in code and not regenerated would leave the
    presets on the old value, and the reference wrong."""
    from omegaconf import OmegaConf

    from medsrl.config_files import DEFAULTS_SCHEMAS, WRITE, defaults_path, generated_files

    for path, text in generated_files().items():
        assert path.is_file() and path.read_text() == text, f"{path} is out of date: regenerate it with `{WRITE}`"
    from run_helpers import BASE_CONFIG

    examples = {"stages": BASE_CONFIG["data"]["stages"], **BASE_CONFIG}  # of the required settings
    for group, schema in DEFAULTS_SCHEMAS.items():
        defaults = OmegaConf.to_container(OmegaConf.load(defaults_path(group)))
        required = {k: examples[k] for k, field in schema.model_fields.items() if field.is_required()}
        parsed = schema.model_validate(required).model_dump(mode="json", by_alias=True)
        assert defaults == {k: "???" if k in required else parsed[k] for k in defaults}, group


# ----------------------------------------------------------------------------- presets list only what they change

# The hand-written files whose settings have a schema: configs/train.yaml, configs/eval.yaml and
# these groups. Not checked: the generated files (`_defaults.yaml`, plugins/), benchmark/ (a
# source's null means the loader's own default, not a default it repeats), logger/, paths/,
# hydra/ and hparams_search/ (Lightning's, Hydra's and Optuna's settings: no schema defaults).
_SECTIONS = ("algorithm", "optim", "rollout", "model", "data", "trainer", "callbacks")  # package: the group
_GLOBAL = ("prompt", "debug", "experiment")  # @package _global_
# Set where the default is the same: a preset's name says which preset it is.
_OWN = {("algorithm", "algorithm.name")}
# A section composed alone (`_audit_<group>` in the scratch copy), so no experiment's setting hides a
# preset's; seed and paths for the interpolations (data.seed: ${seed}, ${paths.output_dir}).
_ALONE = "defaults:\n  - paths: default\n  - {group}: ???\n  - _self_\nseed: 42\n"

Context = tuple[str, tuple[str, ...]]  # (config name, overrides)


def _hand_written_configs(groups: tuple[str, ...]) -> list[str]:
    files = []
    for group in groups:
        if group in ("train", "eval"):
            files.append(f"{group}.yaml")
        else:
            files += [f"{group}/{p.name}" for p in sorted((ROOT / "configs" / group).glob("*.yaml"))
                      if p.name != "_defaults.yaml"]
    return files


@functools.cache
def _shipped(path: Path) -> dict:
    return _loaded(path)


def _loaded(path: Path) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path)) or {}


def _includes(group: str, option: str) -> set[str]:
    """``option`` and the presets of its group it extends (``- dapo``, ``- gpu``, ...), transitively."""
    names = {option}
    for entry in _shipped(ROOT / "configs" / group / f"{option}.yaml").get("defaults", []):
        if isinstance(entry, str) and (ROOT / "configs" / group / f"{entry}.yaml").is_file():
            names |= _includes(group, entry)
    return names


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (ROOT / "configs" / group).glob("[!_]*.yaml"))


def _contexts(rel: str) -> list[Context]:
    """The compositions ``configs/<rel>`` takes part in: with every option of its group that
    extends it (itself included); eval with each engine (rollout=hf|vllm sets what eval.yaml nulls)."""
    if rel == "train.yaml":
        return [("train", ()), ("train", ("~experiment",))]
    if rel == "eval.yaml":
        return [("eval", ()), ("eval", ("rollout=hf",)), ("eval", ("rollout=vllm",))]
    group, stem = rel.split("/")[0], Path(rel).stem
    name = "train" if group in _GLOBAL else f"_audit_{group}"
    return [(name, (f"{group}={o}",)) for o in _options(group) if stem in _includes(group, o)]


def _compose(config_dir: Path, context: Context):
    from hydra import compose, initialize_config_dir

    name, overrides = context
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return compose(name, overrides=["paths.output_dir=/tmp/unused", *overrides])


def _package(rel: str) -> tuple[str, ...]:
    if "/" not in rel or "# @package _global_" in (ROOT / "configs" / rel).read_text():
        return ()
    return (rel.split("/")[0],)


def _body_leaves(rel: str) -> list[tuple]:
    """A file's settings as their key paths in the composed config: nested mappings walked, a list
    one value (Hydra replaces a list whole)."""
    body = {k: v for k, v in _shipped(ROOT / "configs" / rel).items() if k != "defaults"}

    def walk(node, at):
        for key, value in node.items():
            if isinstance(value, dict) and value:
                yield from walk(value, (*at, key))
            else:
                yield (*at, key)

    return list(walk(body, _package(rel)))


def _at(container, path: tuple) -> tuple[bool, object]:
    for key in path:
        if not isinstance(container, dict) or key not in container:
            return False, None
        container = container[key]
    return True, container


def _dotted(path: tuple) -> str:
    return ".".join(map(str, path))


def _plain(value):
    """A parsed run as plain data (a built node as its class and settings)."""
    from pydantic import BaseModel

    from medsrl.run_config import Built

    if isinstance(value, Built):
        return {"class": f"{value.cls.__module__}.{value.cls.__qualname__}", "settings": _plain(value.settings)}
    if isinstance(value, BaseModel):
        return {k: _plain(getattr(value, k)) for k in [*type(value).model_fields, *(value.model_extra or {})]}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@functools.cache
def _section_schema(group: str):
    from pydantic import TypeAdapter

    from medsrl.run_config import RunConfig

    return TypeAdapter(RunConfig.model_fields[group].rebuild_annotation())


def _run_of(values: dict, name: str):
    """What a composed config runs: the parsed run (or section, composed alone), and the nodes
    Hydra builds as they are (the trainer, loggers, and callbacks pydantic cannot read)."""
    from medsrl.run_config import EvalRunConfig, RunConfig

    if name == "eval":
        return _plain(EvalRunConfig.parse(values))
    if name == "train":
        run = RunConfig.parse(values)
        callbacks, trainer, logger = run.callbacks, values.get("trainer"), values.get("logger")
        parsed = _plain(run)
    else:
        group = name.removeprefix("_audit_")
        section = _section_schema(group).validate_python(values[group])
        callbacks = section if group == "callbacks" else {}
        trainer, logger, parsed = values[group] if group == "trainer" else None, None, _plain(section)
    by_hydra = {k: values["callbacks"][k] for k, b in callbacks.items() if b.settings is None}
    return parsed, trainer, logger, by_hydra


def _same_run_without(values: dict, raw: dict, name: str, path: tuple, run) -> bool:
    """Whether the composed config (``values`` resolved, ``raw`` not) without the setting at
    ``path`` still runs ``run``: the schema's default. Not when another setting interpolates it."""
    import copy
    import json

    if f"${{{_dotted(path)}" in json.dumps(raw):
        return False
    values = copy.deepcopy(values)
    del _at(values, path[:-1])[1][path[-1]]
    try:
        return _run_of(values, name) == run
    except ValueError:  # a required value
        return False


def _outcome(raw: dict, name: str):
    """What a composed config runs, or why it does not."""
    from omegaconf import OmegaConf

    try:
        return _run_of(OmegaConf.to_container(OmegaConf.create(raw), resolve=True), name)
    except Exception as err:  # noqa: BLE001 (the same error with and without a setting: the same outcome)
        return repr(err)


def _same_under_other_presets(work: Path, context: Context, path: tuple) -> bool:
    """Whether a global file's setting at ``path``, which its compositions have without it, is
    still not needed when the command line chooses another preset of the section holding it
    (``experiment=qwen2.5-math-1.5b_dapo trainer=ddp``: ddp's devices are auto, the experiment's 1).
    The same value, or the same run (a parsed default), under every other preset."""
    import copy

    from omegaconf import OmegaConf

    name, overrides = context
    groups = [path[0]] if path[0] in _SECTIONS else []
    if path[:2] == ("data", "template") or path[0] == "grader":
        groups.append("prompt")
    for group in groups:
        for option in _options(group):
            swapped = (name, (*overrides, f"{group}={option}"))
            real = OmegaConf.to_container(_compose(ROOT / "configs", swapped), resolve=False)
            at_base = _at(OmegaConf.to_container(_compose(work, swapped), resolve=False), path)
            if at_base == _at(real, path):
                continue
            if not _at(real, path)[0]:
                return False
            without = copy.deepcopy(real)  # the setting as the other files give it
            parent = _at(without, path[:-1])[1]
            if at_base[0]:
                parent[path[-1]] = at_base[1]
            else:
                del parent[path[-1]]
            if _outcome(without, name) != _outcome(real, name):
                return False
    return True


def _audit_presets(work: Path, groups: tuple[str, ...]) -> tuple[list[str], list[tuple[str, tuple, Context]]]:
    """``(repeated, kept)``. ``repeated``: the settings of the hand-written files that every
    composition the file takes part in has without them (the default it extends gives the same
    value, nested keys included). ``kept``: those equal to their schema's default that no default
    file provides, as (file, key path, context): without them a ``+``-less override fails (the
    experiments' and the prompt and debug presets' not sought). ``groups``: the files' groups
    (train, eval: those files). ``work``: a scratch copy of configs/, each file in turn emptied
    (its defaults list only)."""
    import shutil

    from omegaconf import OmegaConf

    shutil.copytree(ROOT / "configs", work)
    for group in _SECTIONS:
        (work / f"_audit_{group}.yaml").write_text(_ALONE.format(group=group))
    composed: dict[Context, tuple] = {}  # context -> (config, its container)
    runs: dict[Context, tuple] = {}
    repeated, kept = [], []
    for rel in _hand_written_configs(groups):
        contexts = _contexts(rel)
        for context in contexts:
            if context not in composed:
                cfg = _compose(work, context)
                composed[context] = cfg, OmegaConf.to_container(cfg, resolve=False)
        reals = [composed[c][1] for c in contexts]
        defaults = _loaded(work / rel).get("defaults")
        head = "# @package _global_\n" if _package(rel) == () and "/" in rel else ""
        (work / rel).write_text(head + (OmegaConf.to_yaml({"defaults": defaults}) if defaults else ""))
        is_global = rel.split("/")[0] in _GLOBAL
        try:
            bases = [OmegaConf.to_container(_compose(work, c), resolve=False) for c in contexts]
            for path in _body_leaves(rel):
                if (rel.split("/")[0], _dotted(path)) in _OWN:
                    continue
                at_base = [_at(b, path) for b in bases]
                # (absent from both: a later file replaced its mapping, as r1-distill-1.5b_r3's overlong: null)
                if all(at == _at(r, path) for at, r in zip(at_base, reals, strict=True)):
                    if not is_global or _same_under_other_presets(work, contexts[0], path):
                        repeated.append(f"{rel}: {_dotted(path)}")
                    continue
                if any(found for found, _ in at_base):
                    continue  # it changes what the files it extends give
                if is_global:
                    continue  # kept settings: sought in the sections' presets, train.yaml and eval.yaml
                first = contexts[0]
                if first not in runs:
                    values = OmegaConf.to_container(composed[first][0], resolve=True)
                    runs[first] = values, _run_of(values, first[0])
                values, run = runs[first]
                if _same_run_without(values, composed[first][1], first[0], path, run):
                    kept.append((rel, path, first))
        finally:
            shutil.copy(ROOT / "configs" / rel, work / rel)
    return repeated, kept


@pytest.mark.parametrize("groups", [
    pytest.param(("train", "eval", *_SECTIONS), id="sections"),
    # ~90 compositions of the whole run (15-25 s here), more when a setting is a candidate
    pytest.param(_GLOBAL, id="experiments-prompts-debug", marks=pytest.mark.slow),
])
def test_presets_list_only_what_they_change(tmp_path, groups):
    """No hand-written setting repeats the default it extends, nested keys included: train.yaml
    and eval.yaml over their generated defaults, every section's presets composed alone over
    theirs (and over the presets they extend), the prompt and debug presets and the experiments
    over the run they change, in every composition each file takes part in (one that other
    presets or experiments extend: in theirs too), and for the global files also under every
    other preset of the section a setting is in (an experiment's trainer.devices: 1 is trainer=gpu's
    too, but not trainer=ddp's). The settings equal to their schema's default that stay (a
    callback's, tiny's warm start) are those no default file provides: without them, Hydra
    refuses an override without ``+``, which is checked by composing one."""
    import shutil

    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf

    work = tmp_path / "configs"
    repeated, kept = _audit_presets(work, groups)
    assert not repeated, f"settings that repeat the default they extend (delete them): {repeated}"
    assert kept or groups == _GLOBAL, "no kept setting found: the check below checks nothing"
    for rel, path, context in kept:
        name, overrides = context
        override = f"{_dotted(path)}=null"
        _compose(work, (name, (*overrides, override)))  # as shipped: no + needed
        body = _loaded(work / rel)
        del _at(body, path[len(_package(rel)):-1])[1][path[-1]]
        (work / rel).write_text(OmegaConf.to_yaml(body))
        try:
            with pytest.raises(ConfigCompositionException, match="Could not override"):
                _compose(work, (name, (*overrides, override)))
        finally:
            shutil.copy(ROOT / "configs" / rel, work / rel)


# Composes in a process that has imported hydra and tests/run_helpers only (no medsrl).
_COMPOSE_ALONE = """
import json, sys
from pathlib import Path
from omegaconf import OmegaConf
from run_helpers import compose_train
runs = [OmegaConf.to_container(compose_train(Path(o), x, debug=d), resolve=True) for o, x, d in json.load(sys.stdin)]
assert not [m for m in sys.modules if m.split(".")[0] == "medsrl"], "medsrl was imported"
print(json.dumps(runs))
"""


def test_compose_without_importing_medsrl_gives_the_clis_settings(tmp_path):
    """A notebook's ``hydra.compose(config_name="train")`` needs no ``import medsrl`` first (the
    presets extend files, not nodes registered on import) and gives what ``medsrl-train``
    composes, whose process has imported everything (``medsrl.train``)."""
    import json
    import subprocess
    import sys

    from omegaconf import OmegaConf

    import medsrl.train  # noqa: F401  (every import side effect the CLI's process has)
    from run_helpers import ROOT, compose_train

    cases = [
        (str(tmp_path / "a"), [], None),
        (str(tmp_path / "b"), ["algorithm=grpo", "optim.optimizer.lr=3e-4", "rollout=vllm", "rollout.n=4"], None),
        (str(tmp_path / "c"), ["experiment=qwen2.5-math-1.5b_meds", "optim.scheduler.warmup_steps=0"], None),
        (str(tmp_path / "d"), ["algorithm=meds_r3", "algorithm.clip_high=0.3"], "fast"),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests" / "helpers")}
    proc = subprocess.run([sys.executable, "-c", _COMPOSE_ALONE], input=json.dumps(cases), env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    alone = json.loads(proc.stdout)
    for (out, overrides, debug), composed in zip(cases, alone, strict=True):
        cli = OmegaConf.to_container(compose_train(Path(out), overrides, debug=debug), resolve=True)
        assert composed == cli, overrides
        assert cli["optim"]["optimizer"]["lr"] > 0 and "clip_low" in cli["algorithm"]  # the schema's defaults are in
