"""The study runner end to end on a miniature study: every phase runs, and a rerun after an
interruption redoes only what was not finished; the protocols' settings and commands."""

import json
import runpy
import subprocess
import sys

import pytest
from studies import runner
from studies.runner import StudySettings, pending_evals, pending_runs, run_dir

MICRO = [  # a micro model with a few warm-start steps, tiny batches: the plumbing, not the numbers
    "model.tiny={hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2, num_key_value_heads: 1, "
    "intermediate_size: 64}",
    "model.warm_start.steps=3",
    "+model.warm_start.num_examples=64",
    "+model.warm_start.eval_examples=4",
    "+model.warm_start.eval_max_new_tokens=8",
    "data.prompts_per_step=2",
    "rollout.n=2",
    "rollout.max_new_tokens=24",
    "callbacks.pass_at_k.num_problems=2",
    "callbacks.pass_at_k.n=2",
    "callbacks.sample_logger.every_n_steps=0",
]


def _argv(tmp_path, name="mini"):
    # the Hydra overrides right after --seeds: they must not be read as seeds
    return [
        "--name", name, "--root", str(tmp_path / "study"), "--methods", "grpo", "meds", "--seeds", "0",
        *MICRO, f"paths.cache_dir={tmp_path / 'cache'}",
        "--steps-a", "1", "--steps-b", "1", "--eval-n", "2", "--eval-problems", "2",
    ]


@pytest.fixture
def commands_in_process(monkeypatch):
    """The study's ``python -m medsrl.<entry> ...`` commands run in this process (``runpy``, as
    the command line runs them): the runner's phases are what is tested here, and a fresh
    interpreter for each of its nine commands would add an import of Lightning (~10 s) to each."""
    real = subprocess.run

    def run(cmd, *args, **kwargs):
        if cmd[:2] != [sys.executable, "-m"] or not cmd[2].startswith("medsrl."):
            return real(cmd, *args, **kwargs)
        monkeypatch.setattr(sys, "argv", [cmd[2], *cmd[3:]])
        try:
            runpy.run_module(cmd[2], run_name="__main__", alter_sys=True)
        except SystemExit as stop:
            return subprocess.CompletedProcess(cmd, stop.code if isinstance(stop.code, int) else 1)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", run)


@pytest.mark.slow
@pytest.mark.usefixtures("commands_in_process")
@pytest.mark.filterwarnings("ignore:'medsrl.(train|eval)' found in sys.modules")  # runpy: imported already
def test_study_runs_every_phase_then_resumes_only_the_unfinished(tmp_path, capfd):
    runner.main(_argv(tmp_path))
    root = tmp_path / "study" / "mini"
    meta = json.loads((root / "study.json").read_text())
    assert [m["name"] for m in meta["methods"]] == ["grpo", "meds"] and meta["steps_a"] == 1
    s = StudySettings(name="mini", methods=["grpo", "meds"], seeds=[0], steps_a=1, steps_b=1)
    assert not pending_runs(root, s, "A") and not pending_runs(root, s, "B") and not pending_evals(root, s)
    for method in ("grpo", "meds"):
        a = json.loads((run_dir(root, method, 0, "A") / "summary.json").read_text())
        b = json.loads((run_dir(root, method, 0, "B") / "summary.json").read_text())
        assert (a["steps"], b["steps"]) == (1, 2)  # B resumed from A's step
        assert (root / "eval" / method / "seed0" / "error_modes.json").is_file()
    pre = json.loads((root / "precheck" / "error_modes.json").read_text())
    assert pre["trap"]["problems"] == 2 and pre["other"]["problems"] == 2
    doc = (root / "STUDY.md").read_text()
    assert "### Error modes" in doc and "| MEDS |" in doc
    capfd.readouterr()

    # An interruption during meds's stage B and its evaluation: only those two are redone.
    a_summary = run_dir(root, "grpo", 0, "A") / "summary.json"
    before = a_summary.stat().st_mtime_ns
    (run_dir(root, "meds", 0, "B") / "summary.json").unlink()
    (root / "eval" / "meds" / "seed0" / "results.json").unlink()
    runner.main(_argv(tmp_path))
    out = capfd.readouterr().out
    assert a_summary.stat().st_mtime_ns == before
    assert "experiment=study_meds" in out and "experiment=study_grpo" not in out  # one train call
    assert "+study_run=meds/seed0 " in out  # one evaluation
    assert (run_dir(root, "meds", 0, "B") / "summary.json").is_file()


def test_other_settings_in_the_same_root_are_refused(tmp_path):
    root = tmp_path / "r"
    runner.open_study(root, StudySettings(steps_a=3))
    with pytest.raises(SystemExit, match="other settings .*steps_a"):
        runner.open_study(root, StudySettings(steps_a=4))


def test_train_commands_are_hydra_multiruns(tmp_path):
    s = StudySettings(methods=["dapo", "meds"], seeds=[0, 1, 2])
    a = runner.train_command(tmp_path, s, "A", [("dapo", 0), ("dapo", 2), ("meds", 1)])
    assert [c[c.index("medsrl.train") + 2] for c in a] == ["experiment=study_dapo", "experiment=study_meds"]
    assert "seed=0,2" in a[0] and "seed=1" in a[1] and not any(x.startswith("ckpt_path") for x in a[0])
    (b,) = runner.train_command(tmp_path, s, "B", [("meds", 1)])
    assert "trainer.max_steps=40" in b and "resume_mode=full" in b
    assert f"ckpt_path={tmp_path}/train/meds/seed${{seed}}/A/checkpoints/last.ckpt" in b


def test_overrides_are_not_swallowed_by_a_list_option():
    options, overrides = runner.split_overrides(
        ["--seeds", "3", "4", "5", "study.pool_l1=32", "--methods", "dapo", "meds@alpha=1.0,beta=2.0", "--name=v2"])
    assert overrides == ["study.pool_l1=32"]
    assert options == ["--seeds", "3", "4", "5", "--methods", "dapo", "meds@alpha=1.0,beta=2.0", "--name=v2"]


def test_a_method_variant_is_its_experiment_with_overrides_in_a_directory_of_its_own(tmp_path):
    spec = "meds@alpha=1.0,beta=2.0"
    assert runner.method_overrides(spec) == ["algorithm.plugins.meds.alpha=1.0", "algorithm.plugins.meds.beta=2.0"]
    assert runner.method_overrides("meds@optim.optimizer.lr=1e-4") == ["optim.optimizer.lr=1e-4"]
    assert (runner.method_dir(spec) == "meds_alpha1.0_beta2.0"
            and runner.method_label(spec) == "MEDS (alpha 1.0, cap 2.0)")
    s = StudySettings(methods=["dapo", spec], seeds=[0])
    s.check()
    (a,) = runner.train_command(tmp_path, s, "A", [(spec, 0)])
    assert "experiment=study_meds" in a and "algorithm.plugins.meds.alpha=1.0" in a
    assert f"hydra.sweep.dir={tmp_path}/train/meds_alpha1.0_beta2.0" in a
    assert run_dir(tmp_path, spec, 0, "A") == tmp_path / "train" / "meds_alpha1.0_beta2.0" / "seed0" / "A"
    ev = runner.eval_command(tmp_path, s, [(spec, 0)])
    assert "+study_run=meds_alpha1.0_beta2.0/seed0" in ev
    for bad in (["nope@alpha=1"], ["meds@alpha"], ["meds@alpha=1", "meds@alpha=1"]):
        with pytest.raises(ValueError):
            StudySettings(methods=bad).check()


def test_a_stage_a_only_study_evaluates_stage_a_on_the_levels_asked(tmp_path):
    s = StudySettings(methods=["dapo"], seeds=[0], steps_b=0, levels=[1],
                      eval_overrides=["+benchmark.study_l1.trap_fraction=0.75"])
    s.check()
    assert runner.stages(s) == ("A",)
    ev = runner.eval_command(tmp_path, s, [("dapo", 0)])
    assert f"model_path={tmp_path / 'train'}/${{study_run}}/A/policy" in ev
    assert "~benchmark.study_l2" in ev and "benchmark.study_l1.split=test" in ev
    assert "+benchmark.study_l1.trap_fraction=0.75" in ev
    for bad in ({"steps_b": -1}, {"levels": [3]}, {"levels": []}):
        with pytest.raises(ValueError):
            StudySettings(**bad).check()


def test_the_command_line_reads_the_stage_a_only_and_eval_options(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(runner, "run_study", lambda root, s: seen.update(s=s, root=root))
    runner.main(["--name", "x", "--root", str(tmp_path), "--steps-b", "0", "--levels", "1", "--no-eval",
                 "--eval-override=+benchmark.study_l1.trap_fraction=0.75", "rollout.n=16"])
    s = seen["s"]
    assert (s.steps_b, s.levels, s.evaluate) == (0, [1], False)
    assert s.eval_overrides == ["+benchmark.study_l1.trap_fraction=0.75"] and s.overrides == ["rollout.n=16"]


def _part(protocol, name):
    return next(p for p in runner.load_protocol(protocol)["parts"] if p["name"] == name)


def test_the_protocols_keep_the_settings_of_their_published_studies():
    assert runner.part_settings(_part("v1", "full"), {}) == StudySettings()
    assert runner.part_settings(_part("quick", "quick"), {}) == StudySettings(
        name="quick", seeds=[0], steps_a=10, steps_b=10, eval_n=8, eval_problems=32)
    assert runner.part_settings(_part("v2", "v2"), {"seeds": [3], "overrides": ["rollout.n=4"]}) == StudySettings(
        name="v2", methods=["dapo", "meds", "meds@alpha=1.0,beta=2.0", "meds@alpha=1.0,beta=10.0"], seeds=[3],
        pool_l1=32, pool_l2=24, eval_train=True, overrides=["rollout.n=4"])


def test_d3_arms_are_distinct_runs_of_known_methods():
    s = runner.part_settings(_part("v3", "v3_d3"), {"seeds": [0, 1, 2]})
    s.check()
    assert not s.evaluate and s.steps_b == 0
    # every trained-on response logged: the route analyses
    assert "callbacks.sample_logger.every_n_steps=1" in s.overrides


def test_d2_gives_the_third_arm_the_chosen_memory_at_a_stronger_alpha():
    from studies.audit import ANSWER_SETTINGS

    s = runner.part_settings(_part("v3", "v3_d2"), {}, ANSWER_SETTINGS)
    spec = "meds@algorithm.plugins.meds.clustering.mode=answer,alpha=0.5,beta=1.0"
    assert spec in s.methods and "rollout.n=16" in s.overrides
    # the folder and label of before the settings were grouped (docs/STUDY_V3.md)
    assert runner.method_dir(spec) == "meds_modeanswer_alpha0.5_beta1.0"
    assert runner.method_label(spec) == "MEDS (mode answer, alpha 0.5, cap 1.0)"
    assert "+benchmark.study_l1.trap_fraction=0.75" in s.eval_overrides
    assert "+model.warm_start.task_options.wrong_routes=[shortcut,add,drop]" in s.overrides
    assert not any(o.startswith("+benchmark") for o in s.overrides)  # they stay with the evaluation
    assert "meds@alpha=0.5,beta=1.0" in runner.part_settings(_part("v3", "v3_d2"), {}, []).methods


def test_a_memory_setting_keeps_its_published_folder_and_label_and_a_kept_flat_choice_still_runs():
    """D2's published arm (docs/STUDY_V3.md): the full keys of today and the flat keys a
    ``choice.json`` kept from before MEDS's settings were grouped name the same folder and label,
    and both train with the full keys."""
    from studies.audit import FEATURE_SETTINGS, STORE_SETTINGS

    full = "meds@" + ",".join([*FEATURE_SETTINGS["digits"], *STORE_SETTINGS["dedup"], "alpha=0.5", "beta=1.0"])
    kept = "meds@feature_logits=digits,dedup=true,alpha=0.5,beta=1.0"
    for spec in (full, kept):
        assert runner.method_dir(spec) == "meds_feature_logitsdigits_deduptrue_alpha0.5_beta1.0"
        assert runner.method_label(spec) == "MEDS (feature_logits digits, dedup true, alpha 0.5, cap 1.0)"
        assert runner.method_overrides(spec) == [
            "algorithm.plugins.meds.features.logits=digits", "algorithm.plugins.meds.clustering.dedup=true",
            "algorithm.plugins.meds.alpha=0.5", "algorithm.plugins.meds.beta=1.0"]
    assert runner.setting_name("algorithm.plugins.meds.features.dtype") == "feature_dtype"
    assert runner.setting_name("algorithm.plugins.meds.clustering.min_samples") == "min_samples"
    assert runner.method_overrides("meds@min_samples=2") == ["algorithm.plugins.meds.clustering.min_samples=2"]


def _memory_choices() -> list[list[str]]:
    """Every memory D1 can hand D2: each feature setting with each store setting, and the
    answer-keyed memory."""
    from studies.audit import ANSWER_SETTINGS, FEATURE_SETTINGS, STORE_SETTINGS

    return [f + st for f in FEATURE_SETTINGS.values() for st in STORE_SETTINGS.values()] + [ANSWER_SETTINGS]


def _train_overrides(cmd: list[str]) -> list[str]:
    """A ``medsrl.train`` command's overrides as a single run composes them (no Hydra's own)."""
    return [w for w in cmd[cmd.index("medsrl.train") + 1:] if w != "-m" and not w.startswith("hydra.")]


@pytest.mark.parametrize("protocol", sorted(p.stem for p in runner.PROTOCOLS.glob("*.yaml")))
def test_every_training_run_a_protocol_makes_composes_and_parses(protocol, tmp_path):
    """The overrides of every training run the protocol's parts can make (D2 with every memory
    D1 can choose), composed into the training config and parsed: a renamed setting fails here,
    not hours into a study."""
    from medsrl.run_config import RunConfig
    from run_helpers import compose_train

    commands = []
    for part in runner.load_protocol(protocol)["parts"]:
        if "audit" in part:
            commands.append(["medsrl.train", *part["train"], "skip_if_done=true", "logger=tensorboard"])
        elif part.get("run", True):
            memories = _memory_choices() if any("{memory}" in m for m in part.get("methods", [])) else [None]
            for memory in memories:
                s = runner.part_settings(part, {"seeds": [0]}, memory)
                s.check()
                for stage in runner.stages(s):
                    commands += runner.train_command(tmp_path, s, stage, [(m, 0) for m in s.methods])
    assert commands
    for overrides in dict.fromkeys(tuple(_train_overrides(c)) for c in commands):
        try:
            RunConfig.parse(compose_train(tmp_path / "run", list(overrides), debug=None))
        except Exception as err:
            raise AssertionError(f"{protocol}: {' '.join(overrides)}") from err


def test_v4_runs_seven_paired_arms_on_seeds_0_to_7_and_evaluates_each_and_the_warm_start(tmp_path):
    s = runner.part_settings(_part("v4", "v4"), {})
    s.check()
    assert s.seeds == list(range(8)) and (s.steps_a, s.steps_b, s.levels) == (12, 0, [1])
    assert (s.eval_n, s.eval_problems, s.pool_l1) == (16, 64, 32)
    labels = [runner.method_label(m) for m in s.methods]
    assert labels == ["DAPO", "W-REINFORCE", "Pass@k advantage", "Outcome UCB",
                      "MEDS (mode answer, alpha 0.5, cap 1.0)",
                      "MEDS (mode answer, alpha 0.5, cap 1.0, shuffle_penalties true)", "MEDS"]
    shuffled = s.methods[5]
    assert runner.method_overrides(shuffled)[-1] == "algorithm.plugins.meds.shuffle_penalties=true"
    assert runner.method_dir(shuffled) == "meds_modeanswer_alpha0.5_beta1.0_shuffle_penaltiestrue"
    # 56 training runs in 7 multiruns, one per arm over the 8 seeds; 57 evaluations, the warm start's first
    commands = runner.train_command(tmp_path, s, "A", pending_runs(tmp_path, s, "A"))
    assert len(commands) == 7 and all("seed=0,1,2,3,4,5,6,7" in c for c in commands)
    assert [c[c.index("medsrl.train") + 2] for c in commands[:4]] == [
        f"experiment=study_{m}" for m in ("dapo", "w_reinforce", "passk", "outcome_ucb")]
    jobs = pending_evals(tmp_path, s)
    assert len(jobs) == 57 and jobs[0] == (runner.WARM_START, 0)
    ev = runner.eval_command(tmp_path, s, jobs[1:])
    assert "n=16" in ev and "benchmark.study_l1.split=test" in ev and "benchmark.study_l1.num=64" in ev
    warm = runner.warm_start_eval_command(tmp_path / "w", s, tmp_path / "ws", "test")
    assert "n=16" in warm and "benchmark.study_l1.split=test" in warm


def test_a_study_that_names_no_methods_keeps_protocol_v1s_seven():
    assert StudySettings().methods == ["grpo", "dapo", "grpo_entropy", "meds", "r3", "meds_r3", "novelty"]
    assert {"w_reinforce", "passk", "outcome_ucb"} <= set(runner.METHODS)
