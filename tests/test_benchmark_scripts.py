"""Every script under ``benchmarks/`` runs here at toy size, or at least builds its config and
objects, so that a refactor cannot break one unnoticed (docs/BENCHMARKS.md). A new script fails
``test_every_benchmark_script_runs_at_toy_size`` until it has an entry below."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from run_helpers import ROOT
from shared_paths import require_shared

BENCHMARKS = ROOT / "benchmarks"


@dataclass(frozen=True)
class Toy:
    """A script's toy run: its arguments (``{tmp}``: the test's temp dir), keys its JSON line
    must have (``expect``: with these values), and what to prepare in the temp dir first."""

    args: tuple[str, ...]
    keys: tuple[str, ...] = ()
    setup: Callable[[Path], None] | None = None
    expect: tuple[tuple[str, object], ...] = ()


# What compare_trees.py reads of step_profile.py's JSON line, for the other checkout (a stub: a
# second checkout is not at hand; this checkout's step_profile.py runs for real).
STUB_PROFILE = {"seconds_per_step": {"step": 1.0, "generate": 0.5}, "mean_response_length": 10.0}


def _other_tree(tmp: Path) -> None:
    (tmp / "other" / "benchmarks").mkdir(parents=True)
    (tmp / "other" / "benchmarks" / "step_profile.py").write_text(f"print({json.dumps(STUB_PROFILE)!r})\n")


# debug=fast: the untrained micro model (no warm start), 2 steps of 4 prompts x 4
FAST = ("debug=fast", "paths.cache_dir={tmp}/cache")
# peer_trl's medsrl side at toy size: the micro model, warm-started for 2 steps (TRL loads it from disk)
PEER_TOY = ("debug=fast", "algorithm.entropy_coef=0.0", "algorithm.micro_batch_size=8", "paths.cache_dir={tmp}/cache",
            "model.warm_start={steps: 2, batch_size: 4, warmup_steps: 0, num_examples: 16, eval_examples: 2,"
            " eval_max_new_tokens: 8}")

TOY = {
    "cluster_refit.py": Toy(("--keys", "4", "--points", "32", "--overlap-seconds", "0.2"), ("results",)),
    # this checkout's step_profile.py at toy size against a stub "other checkout" (_other_tree)
    "compare_trees.py": Toy(("--other", "{tmp}/other", "--rounds", "1", "--steps", "2", "--warmup", "1", *FAST),
                            ("seconds_per_step", "ratio_this_over_other"), setup=_other_tree),
    "logprob_memory.py": Toy(("--tokens", "64", "--hidden", "16", "--rounds", "1"), ("fp32/fused", "bf16-mix/fused")),
    "master_weights.py": Toy(("--size", "64", "--steps", "1", "--seeds", "1"), ("bf16_changed",)),
    "method_overhead.py": Toy(("--methods", "dapo", "--steps", "2", "--rounds", "1", "--pool", "4", *FAST),
                              ("seconds_per_step",)),
    "padding_free.py": Toy(("--rounds", "1", "--rows", "8", "--n", "4", "--max-response", "32",
                            "--micro-batch", "2", "--max-rows", "4"), ("ways",)),
    # .venv has no trl: both sides built from the composed config, nothing trained
    "peer_trl.py": Toy(("--dry-run", "--steps", "2", "--medsrl-overrides", shlex.join(PEER_TOY)),
                       ("settings", "policy_dir"),  # the grader grades (its workers resolved by the schema)
                       expect=(("rewards", {"correct": [1.0, 0.0], "overlong": [0.0, 0.0]}),)),
    # .venv has no vLLM: the model, prompts and the HF side only
    "rollout_throughput.py": Toy(("--dry-run", "--prompts", "2", "--n", "2", "--max-new-tokens", "8", "--repeats", "1",
                                  "--hidden-size", "32", "--layers", "1", "--intermediate-size", "64"), ("hf",)),
    "shared_prompt.py": Toy(("--rounds", "1", "--prompts", "2", "--n", "2", *FAST, "paths.output_dir={tmp}/out"),
                            ("ratio_shared_over_whole",)),
    "step_route.py": Toy(("algorithm=grpo",), ("files", "lines", "calls")),
    "worker_start.py": Toy(("--toy",), ("rounds",)),
}
# Scripts whose toy run is elsewhere: where.
ELSEWHERE = {
    "gpu_check.py": Path(__file__),  # --toy, with the shared Qwen tokenizer: test_gpu_check_runs_each_case_...
    "step_profile.py": BENCHMARKS / "compare_trees.py",  # its toy run runs this tree's step_profile.py
}
SHELL = {"device_wheels.sh"}  # downloads wheels: its syntax is checked only


def _scripts() -> list[str]:
    return sorted(p.name for p in BENCHMARKS.iterdir() if p.is_file() and p.suffix in (".py", ".sh"))


def _run(cmd: list[str], timeout_s: int = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "MEDSRL_ROOT": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)


def _last_json(stdout: str) -> dict:
    """The script's last stdout line, which must be one JSON object (docs/BENCHMARKS.md)."""
    lines = stdout.strip().splitlines()
    assert lines, "no output on stdout"
    value = json.loads(lines[-1])
    assert isinstance(value, dict), lines[-1][:200]
    return value


@pytest.mark.slow
@pytest.mark.parametrize("script", _scripts())
def test_every_benchmark_script_runs_at_toy_size(script, tmp_path):
    if script in SHELL:
        proc = _run(["bash", "-n", str(BENCHMARKS / script)])
        assert proc.returncode == 0, proc.stderr
        return
    if script in ELSEWHERE:
        assert script in ELSEWHERE[script].read_text(), f"{ELSEWHERE[script]} no longer runs {script}"
        return
    if script not in TOY:
        pytest.fail(f"benchmarks/{script} has no toy run: add it to TOY in {Path(__file__).name} "
                    "(a small-size flag, or --dry-run where it needs a GPU or another venv)")
    toy = TOY[script]
    if toy.setup:
        toy.setup(tmp_path)
    args = [a.replace("{tmp}", str(tmp_path)) for a in toy.args]
    proc = _run([sys.executable, str(BENCHMARKS / script), *args])
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-6000:]}"
    result = _last_json(proc.stdout)
    missing = [k for k in toy.keys if k not in result]
    assert not missing, f"{script}'s JSON lacks {missing}: {sorted(result)}"
    for key, value in toy.expect:
        assert result.get(key) == value, (key, result.get(key))


@pytest.mark.slow
def test_gpu_check_runs_each_case_in_its_own_process_beside_the_plan(tmp_path):
    """``gpu_check.py --toy`` (``make gpu-check``'s CPU version): one device, FSDP with validation,
    a checkpoint and a milestone, a resume from that checkpoint in a fresh process, LoRA; each case
    trains, and every phase of the plan of its config is there by name with its figure (the
    allocator peaks are CUDA's: none on a CPU)."""
    import importlib.util

    from medsrl.plan.cli import compose_train_config, plan_for

    spec = importlib.util.spec_from_file_location("gpu_check", BENCHMARKS / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    measured_as = gpu_check.MEASURED_AS
    tok = require_shared("tokenizers", "qwen2.5-math")
    out, work = tmp_path / "check.json", tmp_path / "work"
    proc = _run([sys.executable, str(BENCHMARKS / "gpu_check.py"), "--toy", "--tokenizer", str(tok),
                 "--out", str(out), "--work-dir", str(work)], timeout_s=900)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    result = _last_json(proc.stdout)
    assert json.loads(out.read_text()) == result
    cases = result["cases"]
    assert list(cases) == ["one-device", "fsdp", "resume", "lora"] and result["ok"]
    for name, case in cases.items():
        assert case["ok"], (name, case.get("error"))
        assert case["backend"] == "hf" and case["precision"] == "32-true" and case["world_size"] == 1
        assert len(case["step_s"]) == len(case["steps"]) and all(s > 0 for s in case["step_s"])
        # the module's phases the plan's are compared with are the ones it times
        assert {f"time/{phase}" for phase in measured_as.values()} <= set(case["steps"][0])
        plan = plan_for(compose_train_config(case["overrides"]), case["plan_prompt_tokens"])
        assert [p["phase"] for p in case["phases"]] == [p.name for p in plan.phases]
        assert [p["plan_gib"] for p in case["phases"]] == pytest.approx([p.total / 2**30 for p in plan.phases])
        assert case["peaks_gib"] == {} and all(p["peak_gib"] is None for p in case["phases"])
        for step in case["steps"]:
            assert step["nonfinite_updates"] == 0
            # the HF engine is the trainer's own module: the IS weights are 1 up to KV-cache numerics
            assert step["engine_is/weight_mean"] == pytest.approx(1.0, abs=1e-3)
            assert step["weights_changed_frac"] > (0.5 if name == "lora" else 0.99)
    one, fsdp, resume, lora = cases.values()
    assert [s["step"] for s in one["steps"]] == [0, 1] and "checkpoint" not in one["outside_steps_s"]
    assert {"validation sampling", "validation features", "checkpoint", "milestone"} <= set(fsdp["outside_steps_s"])
    assert (work / "fsdp" / "checkpoints" / "last.ckpt").is_dir()  # sharded: a folder of shard files
    assert (work / "fsdp" / "milestones" / "step_000002").is_dir()
    assert [s["step"] for s in resume["steps"]] == [2] and resume["steps_done"] == 3
    assert "resume" in resume["outside_steps_s"]
    assert "Restored all states from the checkpoint" in (work / "resume.log").read_text()
    assert lora["trained_params"] < lora["params"] / 50  # the adapters only
