"""Sweeps as users run them: the Optuna search over MEDS's knobs (composed, and a real 2-trial
sweep through ``medsrl-train``'s Hydra entry point) and the SLURM launcher (composed into the
sbatch script submitit would submit; there is no SLURM here)."""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode
from omegaconf import OmegaConf

from medsrl.features.logit_capture import select_layers
from run_helpers import ROOT

pytestmark = [
    pytest.mark.slow,
    # optuna 2.10's study-database models under SQLAlchemy 1.4 (pinned: optuna 2 cannot use 2.x)
    pytest.mark.filterwarnings("ignore:Deprecated API features detected"),
]

SEARCHED = ["algorithm.plugins.meds.alpha", "algorithm.plugins.meds.beta", "algorithm.plugins.meds.features.layers"]


def require(module: str) -> None:
    """The `sweep` extra (also in `dev`); missing it skips only outside CI."""
    try:
        importlib.import_module(module)
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"{module} is not installed: pip install -e '.[sweep]' (CI never skips this)")


def compose_with_hydra(overrides: list[str]):
    """The train config with its ``hydra`` node, as ``medsrl-train`` composes it."""
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=overrides, return_hydra_config=True)


def test_optuna_search_maximises_final_pass_at_8_over_meds_knobs():
    require("hydra_plugins.hydra_optuna_sweeper")
    cfg = compose_with_hydra(["hparams_search=meds_optuna", "experiment=tiny"])
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_ == "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    assert cfg.hydra.mode == RunMode.MULTIRUN  # `-m` may be left out
    assert sweeper.direction == "maximize" and sweeper.n_jobs == 1 and sweeper.n_trials == 20
    assert sweeper.sampler._target_ == "optuna.samplers.TPESampler" and sweeper.sampler.seed is not None
    assert sorted(sweeper.params) == sorted(SEARCHED)
    assert sweeper.params["algorithm.plugins.meds.alpha"].startswith("interval(")
    assert cfg.optimized_metric == "val/pass@8"
    assert cfg.callbacks.pass_at_k.n >= 8  # else the run has no val/pass@8
    # every searched key exists in the composed run (an override of a missing key fails each trial)
    assert cfg.algorithm.name == "meds"
    for key in SEARCHED:
        OmegaConf.select(cfg, key, throw_on_missing=True)
    for layers in ("1", "half", "all"):  # the layer choices are valid for the 4-layer tiny model
        assert select_layers(cfg.model.tiny.num_hidden_layers, layers)


def sbatch_script(tmp_path: Path, monkeypatch, overrides: list[str]) -> str:
    """The sbatch script of one job, from the launcher as Hydra instantiates it: submitit gets our
    resources and writes them into the script (a stub ``srun`` stands in for the cluster; nothing runs)."""
    require("hydra_plugins.hydra_submitit_launcher")
    import submitit
    from hydra.utils import instantiate

    cfg = compose_with_hydra(["hydra/launcher=slurm", f"hydra.sweep.dir={tmp_path}", "hydra.job.name=train",
                              *overrides])
    assert cfg.hydra.launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    (stub / "srun").write_text("#!/bin/sh\nexit 0\n")
    (stub / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{stub}{os.pathsep}{os.environ['PATH']}")

    scripts = []

    def capture(executor, fn, *args):  # in place of sbatch: the script each job would get
        scripts.append(executor._executor._make_submission_file_text("python -m medsrl.train", "uid"))
        return []

    monkeypatch.setattr(submitit.AutoExecutor, "map_array", capture)
    launcher = instantiate(cfg.hydra.launcher)
    launcher.config = cfg
    launcher.launch([["optim.optimizer.lr=1e-5"]], initial_job_idx=0)
    (script,) = scripts
    return script


def test_slurm_launcher_builds_the_sbatch_script(tmp_path, monkeypatch):
    """The default (tiny, trainer=cpu): one task on one node, no GPU requested."""
    script = sbatch_script(tmp_path, monkeypatch, [])
    for line in ("--time=240", "--cpus-per-task=4", "--mem=32GB", "--nodes=1", "--ntasks-per-node=1",
                 "--job-name=train", f"--output={tmp_path}/.submitit/%j/"):
        assert f"#SBATCH {line}" in script, line
    assert "--gpus-per-node" not in script


@pytest.mark.filterwarnings("ignore:The `srun` command is available")  # the stub srun on PATH
@pytest.mark.parametrize(("overrides", "nodes", "tasks"), [
    (["experiment=qwen2.5-math-7b_meds"], 1, 8),                      # trainer=fsdp trainer.devices=8
    (["experiment=qwen2.5-math-7b_meds", "trainer.num_nodes=2"], 2, 8),
    (["experiment=qwen2.5-math-1.5b_meds"], 1, 1),                    # trainer=gpu, one GPU
    (["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"], 1, 2),
])
def test_slurm_jobs_have_one_task_per_device_as_lightning_requires(tmp_path, monkeypatch, overrides, nodes, tasks):
    """Lightning's SLURM environment refuses a job whose --ntasks-per-node is not trainer.devices
    (or whose --nodes is not trainer.num_nodes): the launcher reads both from the run's config, and
    a GPU run asks for a GPU per task with hydra.launcher.gpus_per_node=${trainer.devices}."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    gpu = "trainer.accelerator=cpu" not in overrides
    extra = ["hydra.launcher.gpus_per_node=${trainer.devices}"] if gpu else []
    script = sbatch_script(tmp_path, monkeypatch, [*overrides, *extra])
    assert f"#SBATCH --nodes={nodes}" in script and f"#SBATCH --ntasks-per-node={tasks}" in script
    assert (f"#SBATCH --gpus-per-node={tasks}" in script) is gpu
    if not gpu:
        assert "--gpus-per-node" not in script

    cfg = compose_with_hydra(overrides)
    devices, num_nodes = cfg.trainer.devices, OmegaConf.select(cfg, "trainer.num_nodes", default=1)
    monkeypatch.setenv("SLURM_JOB_NAME", "train")  # a batch job, not an interactive shell
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", str(tasks))
    monkeypatch.setenv("SLURM_NNODES", str(nodes))
    SLURMEnvironment().validate_settings(num_devices=devices, num_nodes=num_nodes)  # what Lightning checks
    if devices != 1:  # the launcher's old fixed tasks_per_node: 1 is what Lightning refused
        monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "1")
        with pytest.raises(ValueError, match="ntasks-per-node=1"):
            SLURMEnvironment().validate_settings(num_devices=devices, num_nodes=num_nodes)


def test_slurm_with_devices_auto_fails_at_launch_naming_the_value():
    """trainer=ddp / fsdp default to devices: auto, which is no task count: the launcher's config
    says so (the comment in configs/hydra/launcher/slurm.yaml tells the user to set trainer.devices)."""
    require("hydra_plugins.hydra_submitit_launcher")
    from omegaconf.errors import InterpolationValidationError

    cfg = compose_with_hydra(["hydra/launcher=slurm", "trainer=ddp"])
    assert cfg.trainer.devices == "auto"
    with pytest.raises(InterpolationValidationError, match="'auto'"):
        cfg.hydra.launcher.tasks_per_node  # noqa: B018


@pytest.fixture
def restore_logging():
    """Hydra's job logging re-configures the root logger (a file handler in the run dir)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in root.handlers:
        if h not in handlers:
            h.close()
    root.handlers[:], root.level = handlers, level


def run_main(argv: list[str], monkeypatch) -> None:
    """``medsrl-train <argv>`` in this process (its trials fork no interpreter of their own)."""
    from medsrl.train import main

    monkeypatch.setattr(sys, "argv", ["medsrl-train", *argv])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # raise, not exit, on a failed trial
    try:
        main()
    finally:
        GlobalHydra.instance().clear()


def test_optuna_sweep_runs_two_trials_and_a_rerun_skips_them(tmp_path, monkeypatch, capsys, restore_logging):
    """``medsrl-train -m hparams_search=meds_optuna`` for real, shrunk to 2 one-step trials of the
    micro model: each trial trains with its own MEDS settings and Optuna gets its value. Re-run
    into the same dir with skip_if_done, the seeded search asks the same trials, which are skipped."""
    require("hydra_plugins.hydra_optuna_sweeper")
    sweep = tmp_path / "sweep"
    argv = [
        "-m", "hparams_search=meds_optuna", "experiment=tiny", "debug=fast",
        "hydra.sweeper.n_trials=2", "optimized_metric=val/pass@2",  # debug=fast samples n=2
        f"hydra.sweep.dir={sweep}", f"paths.cache_dir={tmp_path / 'cache'}", "skip_if_done=true",
        "trainer.max_steps=1", "callbacks.pass_at_k.at_start=false", "callbacks.model_checkpoint=null",
    ]
    run_main(argv, monkeypatch)

    trials = []
    for job in ("0", "1"):
        summary = json.loads((sweep / job / "summary.json").read_text())
        overrides = yaml.safe_load((sweep / job / ".hydra" / "overrides.yaml").read_text())
        assert summary["steps"] == 1 and math.isfinite(summary["val/pass@2"])
        trials.append({o.split("=")[0]: o.split("=", 1)[1] for o in overrides if o.split("=")[0] in SEARCHED})
    assert all(sorted(t) == sorted(SEARCHED) for t in trials)
    assert trials[0] != trials[1]  # Optuna asked two different points
    result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert result["name"] == "optuna"
    assert sorted(result["best_params"]) == sorted(SEARCHED)
    assert math.isfinite(result["best_value"])
    best = max(json.loads((sweep / j / "summary.json").read_text())["val/pass@2"] for j in "01")
    assert result["best_value"] == pytest.approx(best)

    def no_build(cfg):
        raise AssertionError("a finished trial must not be built again")

    import medsrl.train

    monkeypatch.setattr(medsrl.train, "build_run", no_build)
    capsys.readouterr()
    run_main(argv, monkeypatch)
    assert capsys.readouterr().out.count("finished before (summary.json): skipped") == 2
    assert yaml.safe_load((sweep / "optimization_results.yaml").read_text()) == result


def test_hparams_search_is_off_by_default():
    cfg = compose_with_hydra([])
    assert cfg.hydra.sweeper._target_.endswith("BasicSweeper")
    assert cfg.optimized_metric == "val/accuracy" and cfg.skip_if_done is False
    assert Path(ROOT / "configs" / "hparams_search" / "meds_optuna.yaml").exists()


@pytest.mark.parametrize(("overrides", "optimises"), [
    ([], False),                               # a single run
    (["hydra.mode=MULTIRUN"], False),          # a grid: no value needed
    (["hparams_search=meds_optuna"], True),    # Optuna ranks trials on it
])
def test_only_an_optimising_sweeper_makes_a_missing_metric_fatal(overrides, optimises):
    from hydra.core.hydra_config import HydraConfig

    from medsrl.train import sweeper_optimises

    if overrides:
        require("hydra_plugins.hydra_optuna_sweeper")
    HydraConfig.instance().set_config(compose_with_hydra(overrides))
    try:
        assert sweeper_optimises() is optimises
    finally:
        HydraConfig.instance().cfg = None

