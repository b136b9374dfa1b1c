"""Settings of each package (grader workers), the presets and composing without importing medsrl."""

from __future__ import annotations

import os
from pathlib import Path

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
    for group, schema in DEFAULTS_SCHEMAS.items():
        assert (OmegaConf.to_container(OmegaConf.load(defaults_path(group)))
                == schema().model_dump(mode="json", by_alias=True))


def test_presets_list_only_what_they_change():
    """A preset that extends its section's defaults (not another preset) repeats none of them."""
    from omegaconf import OmegaConf

    from medsrl.config_files import DEFAULTS_SCHEMAS, defaults_path

    repeated = []
    for group in DEFAULTS_SCHEMAS:
        defaults = OmegaConf.to_container(OmegaConf.load(defaults_path(group)))
        for path in sorted((ROOT / "configs" / group).glob("[!_]*.yaml")):
            preset = OmegaConf.to_container(OmegaConf.load(path))
            if "_defaults" not in preset.get("defaults", []):
                continue
            repeated += [f"{path.name}: {k}" for k, v in preset.items()
                         if k not in ("defaults", "name") and k in defaults and defaults[k] == v]
    assert not repeated, repeated


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
