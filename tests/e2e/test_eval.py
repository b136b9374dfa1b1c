"""medsrl-eval end to end: what a training run produced, tables and plot, resume, several runs."""

from __future__ import annotations

import json
import shutil

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import medsrl.evaluation.responses as runner_mod
from medsrl.eval import evaluate
from medsrl.train import train
from run_helpers import MICRO_WARM_START, ROOT, KilledOnCall, compose_train

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, micro_cache):
    """A 1-step run of the micro preset (warm-started: it writes boxed, mostly wrong answers)."""
    run = tmp_path_factory.mktemp("eval") / "run"
    run_cfg = compose_train(run, ["export_policy=true", "trainer.max_steps=1", *MICRO_WARM_START],
                            cache_dir=micro_cache)
    train(run_cfg)
    # A Hydra run saves its config here (compose_train runs without Hydra); .ckpt loading reads it.
    (run / ".hydra").mkdir(exist_ok=True)
    OmegaConf.save({"model": run_cfg.model}, run / ".hydra" / "config.yaml")
    return run


def _eval_cfg(out, *overrides):
    base = [
        f"paths.output_dir={out}",
        "benchmark.arithmetic.num=8",
        "n=4",
        "max_new_tokens=48",
        "batch_size=8",
        "template.system_prompt=null",
    ]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("eval", overrides=base + list(overrides))


def _table(out):
    return json.loads((out / "results.json").read_text())


def test_exported_policy_and_checkpoint_give_the_same_row_and_all_outputs(tmp_path, trained_run):
    policy, ckpt = trained_run / "policy", trained_run / "checkpoints" / "last.ckpt"
    rows = evaluate(_eval_cfg(tmp_path, f"model_path=[{policy},{ckpt}]"))
    assert [r["run"] for r in rows] == ["run", "run/last"]
    strip = lambda r: {k: v for k, v in r.items() if k != "run"}  # noqa: E731
    assert strip(rows[0]) == strip(rows[1])  # same weights, same seeds
    row = rows[0]
    assert row["problems"] == 8 and row["n"] == 4
    assert {"pass@1", "pass@2", "pass@4", "maj@n", "distinct_answers", "wrong_clusters"} <= set(row)
    assert row["pass@1"] <= row["pass@2"] <= row["pass@4"]
    assert row["distinct_answers"] > 0  # the warm-started micro model writes boxed answers
    lines = (tmp_path / "generations.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 8
    first = json.loads(lines[0])
    assert len(first["responses"]) == 4 and {"text", "extracted", "score", "feature"} <= set(
        first["responses"][0]
    )
    assert "| run | benchmark |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "results.csv").read_text().startswith("run,benchmark,")
    assert (tmp_path / "pass_at_k.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_interrupted_evaluation_resumes_to_the_same_table(tmp_path, trained_run, monkeypatch):
    policy = trained_run / "policy"
    whole = tmp_path / "whole"
    evaluate(_eval_cfg(whole, f"model_path={policy}", "benchmark.arithmetic.num=12"))

    # Crash on the 4th chunk (of 6): 3 chunks (6 problems) are on disk, plus a torn line.
    killer = KilledOnCall(runner_mod.SamplingParams, 4)
    monkeypatch.setattr(runner_mod, "SamplingParams", killer)
    cut = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        evaluate(_eval_cfg(cut, f"model_path={policy}", "benchmark.arithmetic.num=12"))
    assert len((cut / "generations.jsonl").read_text().splitlines()) == 6
    with open(cut / "generations.jsonl", "a") as f:
        f.write('{"run": "run", "benchmark": "arith')

    killer.calls = -100  # no more crashes; count the chunks sampled on resume
    evaluate(_eval_cfg(cut, f"model_path={policy}", "benchmark.arithmetic.num=12"))
    assert killer.calls == -100 + 3  # only the 3 missing chunks were sampled again
    assert _table(cut) == _table(whole)
    assert len((cut / "generations.jsonl").read_text().splitlines()) == 12


def test_resume_with_other_settings_is_refused(tmp_path, trained_run):
    policy = trained_run / "policy"
    evaluate(_eval_cfg(tmp_path, f"model_path={policy}"))
    with pytest.raises(ValueError, match="other settings"):
        evaluate(_eval_cfg(tmp_path, f"model_path={policy}", "temperature=0.5"))


def test_runs_dir_gives_one_row_per_run_named_by_its_overrides(tmp_path, trained_run):
    multirun = tmp_path / "multirun"
    for i, lr in enumerate(["1e-5", "3e-5"]):
        shutil.copytree(trained_run / "policy", multirun / str(i) / "policy")
        (multirun / str(i) / ".hydra").mkdir()
        OmegaConf.save(
            OmegaConf.create([f"optim.lr={lr}"]), multirun / str(i) / ".hydra" / "overrides.yaml"
        )
    (multirun / "multirun.yaml").write_text("{}")
    rows = evaluate(_eval_cfg(tmp_path / "out", f"runs_dir={multirun}"))
    assert [r["run"] for r in rows] == ["0: optim.lr=1e-5", "1: optim.lr=3e-5"]
    assert "0: optim.lr=1e-5" in (tmp_path / "out" / "results.md").read_text()


def test_nothing_to_evaluate_and_ckpt_without_run_config_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="nothing to evaluate"):
        evaluate(_eval_cfg(tmp_path))
    bad = tmp_path / "x" / "checkpoints" / "last.ckpt"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="config.yaml"):
        evaluate(_eval_cfg(tmp_path, f"model_path={bad}"))


def test_a_sharded_checkpoint_gives_the_row_of_its_single_file_twin(tmp_path, trained_run):
    """The run's last.ckpt rewritten as FSDP writes a sharded one (a DCP directory, meta.pt beside):
    model_path and runs_dir take the directory and evaluate the same weights."""
    import torch
    import torch.distributed.checkpoint as dcp

    from medsrl.eval import run_name, runs_in

    single = torch.load(trained_run / "checkpoints" / "last.ckpt", weights_only=False)
    run = tmp_path / "sharded_run"
    shutil.copytree(trained_run / ".hydra", run / ".hydra")
    sharded = run / "checkpoints" / "last.ckpt"
    dcp.save({"state_dict": single.pop("state_dict"), "optimizer_0": single.pop("optimizer_states")[0]},
             checkpoint_id=sharded, no_dist=True)
    torch.save(single, sharded / "meta.pt")
    assert sharded.is_dir() and run_name(sharded) == "sharded_run/last"
    assert runs_in(tmp_path) == [("sharded_run", str(sharded))]
    rows = evaluate(_eval_cfg(tmp_path / "out", f"model_path=[{trained_run / 'checkpoints' / 'last.ckpt'},{sharded}]"))
    assert [r["run"] for r in rows] == ["run/last", "sharded_run/last"]
    assert {k: v for k, v in rows[0].items() if k != "run"} == {k: v for k, v in rows[1].items() if k != "run"}


def test_a_directory_that_is_not_a_checkpoint_is_refused_naming_it(tmp_path):
    from medsrl.models.checkpoint_files import CheckpointError

    broken = tmp_path / "run" / "checkpoints" / "step_000002.ckpt"
    broken.mkdir(parents=True)
    with pytest.raises(CheckpointError, match=f"{broken}: a directory but not a sharded checkpoint"):
        evaluate(_eval_cfg(tmp_path / "out", f"model_path={broken}"))


def test_model_path_mapping_names_the_rows(tmp_path):
    from medsrl.eval import models_to_evaluate
    from medsrl.run_config import EvalRunConfig

    cfg = _eval_cfg(tmp_path, "model_path={start: /m/a, rl: /runs/x/policy}")
    assert models_to_evaluate(EvalRunConfig.parse(cfg)) == [("start", "/m/a"), ("rl", "/runs/x/policy")]
    cfg = _eval_cfg(tmp_path, "model_path=[/runs/x/policy,/runs/y/policy]")
    assert models_to_evaluate(EvalRunConfig.parse(cfg)) == [("x", "/runs/x/policy"), ("y", "/runs/y/policy")]


def test_a_meds_run_is_evaluated_on_its_own_feature(tmp_path, trained_run, caplog):
    """Eval's features (last 14 layers: both of the micro model's 2) for a plain model; the run's
    MEDS plug-in settings (all layers with diffs: 1 value, L2-L1) for a MEDS run's policy."""
    meds_run = tmp_path / "meds_run"
    shutil.copytree(trained_run / "policy", meds_run / "policy")
    (meds_run / ".hydra").mkdir()
    run_cfg = OmegaConf.load(trained_run / ".hydra" / "config.yaml")
    run_cfg.algorithm = {"plugins": {"meds": {"features": {"layers": "all", "diff": True}}}}
    OmegaConf.save(run_cfg, meds_run / ".hydra" / "config.yaml")
    out = tmp_path / "out"
    with caplog.at_level("INFO", logger="medsrl.eval"):
        evaluate(_eval_cfg(out, f"model_path=[{trained_run / 'policy'},{meds_run / 'policy'}]"))
    assert str(meds_run / ".hydra" / "config.yaml") in caplog.text
    feats: dict[str, list] = {"run": [], "meds_run": []}
    for line in (out / "generations.jsonl").read_text().splitlines():
        rec = json.loads(line)
        feats[rec["run"]] += [r["feature"] for r in rec["responses"] if r["feature"] is not None]
    assert feats["run"] and {len(f) for f in feats["run"]} == {2}
    assert feats["meds_run"] and {len(f) for f in feats["meds_run"]} == {1}


# ---------------------------------------------------------------- bad input found before any model


@pytest.fixture
def no_model_load(monkeypatch):
    import medsrl.eval

    def fail(*args, **kwargs):
        raise AssertionError("a model was loaded before the benchmarks were checked")

    monkeypatch.setattr(medsrl.eval, "load_for_eval", fail)


@pytest.mark.parametrize("text", ["", '{"problem": "1 + 1"}\n'], ids=["empty", "all_bad"])
def test_an_empty_benchmark_file_fails_before_any_model_loads_and_names_the_file(tmp_path, no_model_load, text):
    path = tmp_path / "aime25.jsonl"
    path.write_text(text)
    cfg = _eval_cfg(tmp_path / "out", "benchmark=[arithmetic,file]", f"benchmark.file.path={path}",
                    "model_path=/some/model")
    with pytest.raises(Exception) as err:  # Hydra wraps the loader's DataError
        evaluate(cfg)
    assert not isinstance(err.value, AssertionError)
    assert str(path) in str(err.value)


def test_two_benchmarks_of_one_name_are_refused_before_any_model_loads(tmp_path, no_model_load):
    cfg = _eval_cfg(tmp_path, "benchmark=[arithmetic,file]", f"benchmark.file.path={tmp_path / 'arithmetic.jsonl'}",
                    "model_path=/some/model")
    with pytest.raises(ValueError, match="both named 'arithmetic'.*benchmark.file.name"):
        evaluate(cfg)


def test_benchmark_names():
    from medsrl.data.settings import Source
    from medsrl.eval import benchmark_name

    assert benchmark_name("file", Source(path="/x/aime25.jsonl", name=None)) == "aime25"
    assert benchmark_name("file", Source(path="/x/aime25/test.jsonl")) == "aime25"
    assert benchmark_name("file", Source(path="/x/aime25.jsonl", name="foo")) == "foo"
    assert benchmark_name("study_l1", Source(num=64)) == "study_l1"


def test_eval_yaml_lists_only_what_it_changes_and_composes_the_schemas_defaults():
    """configs/eval.yaml extends the generated eval/_defaults.yaml (EvalRunConfig's defaults, which
    docs/SETTINGS.md shows): it repeats none of them, and a run parses to exactly those defaults."""
    from medsrl.run_config import EvalRunConfig

    defaults = OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "eval" / "_defaults.yaml"))
    own = OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "eval.yaml"))
    # rollout: nulls the rollout=hf|vllm presets' training keys, which are merged after the defaults
    assert not [k for k, v in own.items() if k not in ("defaults", "rollout") and defaults.get(k) == v]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        run = EvalRunConfig.parse(compose("eval", overrides=["paths.output_dir=/x"]))
    fields = set(EvalRunConfig.model_fields) - {"benchmark", "paths"}  # those two: their config groups
    assert run.model_dump(include=fields) == EvalRunConfig().model_dump(include=fields)


def test_a_file_benchmark_is_named_after_its_file_or_its_name_key(tmp_path, trained_run):
    data = tmp_path / "aime25.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(2)))
    policy = trained_run / "policy"
    for out, extra, label in [(tmp_path / "a", [], "aime25"), (tmp_path / "b", ["benchmark.file.name=foo"], "foo")]:
        rows = evaluate(_eval_cfg(out, "benchmark=[arithmetic,file]", f"benchmark.file.path={data}", "limit=2",
                                  f"model_path={policy}", *extra))
        assert [r["benchmark"] for r in rows] == ["arithmetic", label]
        assert [r["benchmark"] for r in _table(out)] == ["arithmetic", label]
        assert f"| {label} |" in (out / "results.md").read_text()
        assert _table(out)[1]["problems"] == 2


# ---------------------------------------------------------------- the engine (rollout=hf|vllm)


@pytest.mark.parametrize("chosen,device,installed,want", [
    (None, "cuda", True, "vllm"), (None, "cuda:1", True, "vllm"), (None, "cuda", False, "hf"),
    (None, "cpu", True, "hf"), ("hf", "cuda", True, "hf"), ("vllm", "cpu", False, "vllm"),
])
def test_the_engine_is_vllm_on_a_cuda_gpu_with_vllm_installed_unless_chosen(
    monkeypatch, chosen, device, installed, want
):
    import importlib.util

    from medsrl.eval import choose_backend

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if installed else None)
    backend, why = choose_backend(chosen, device)
    assert backend == want
    assert why.startswith(f"rollout={chosen}" if chosen else "no rollout chosen")


def test_eval_config_takes_the_rollout_presets_and_refuses_their_sampling_keys(tmp_path, no_model_load):
    for preset, backend in [(None, None), ("hf", "hf"), ("vllm", "vllm")]:
        cfg = _eval_cfg(tmp_path, *([f"rollout={preset}"] if preset else []))
        assert cfg.rollout.get("backend") == backend
        assert cfg.rollout.vllm.gpu_memory_utilization == 0.5 and cfg.rollout.vllm.enable_sleep_mode is False
    cfg = _eval_cfg(tmp_path, "rollout=vllm", "rollout.max_new_tokens=8192", "rollout.n=8", "model_path=/some/model")
    with pytest.raises(ValueError) as err:
        evaluate(cfg)
    assert "rollout.max_new_tokens must be null: eval samples with its own max_new_tokens, got 8192" in str(err.value)
    assert "rollout.n must be null: eval samples with its own n, got 8" in str(err.value)


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    """An untrained tiny policy (1,024 positions) exported with its char tokenizer."""
    from medsrl.models.char_tokenizer import build_char_tokenizer
    from medsrl.models.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("tiny") / "policy"
    build_tiny_model(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=64).save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("engine", [
    ["rollout=hf", "max_new_tokens=1000"],
    ["rollout=vllm", "rollout.vllm.max_model_len=60"],  # refused before vLLM is imported
], ids=["hf-positions", "vllm-max_model_len"])
def test_a_prompt_the_engine_cannot_take_is_refused_before_sampling_naming_it(
    tmp_path, tiny_policy, monkeypatch, engine
):
    """Every problem is evaluated: a prompt that leaves no room for max_new_tokens (the model's
    1,024 positions; or rollout.vllm.max_model_len) stops the run at start, naming the benchmark,
    the problem, the setting and the largest max_new_tokens that fits every prompt."""
    import re

    import medsrl.eval

    def no_sampling(*args, **kwargs):
        raise AssertionError("sampled before the prompts were checked")

    monkeypatch.setattr(medsrl.eval, "build_engine", no_sampling)
    monkeypatch.setattr(runner_mod, "sample_chunk", no_sampling)
    with pytest.raises(ValueError) as err:
        evaluate(_eval_cfg(tmp_path, f"model_path={tiny_policy}", *engine))
    message = str(err.value)
    limit = 1024 if engine[0] == "rollout=hf" else 60
    what = "the model's positions (max_position_embeddings)" if limit == 1024 else "rollout.vllm.max_model_len"
    assert f"exceed {what}, {limit} tokens" in message
    assert re.search(r"benchmark 'arithmetic' problem \d+: \d+ prompt tokens", message)
    longest = int(re.search(r"The longest: benchmark 'arithmetic' problem \d+: (\d+) prompt tokens", message).group(1))
    room = int(re.search(r"set max_new_tokens <= (\d+)", message).group(1))
    assert room == limit - longest and 1 <= room < (1000 if limit == 1024 else 48)
    assert not (tmp_path / "generations.jsonl").read_text()


class _Terminal:
    """stderr as a terminal: what the bar needs to draw."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()

    def isatty(self):
        return True


def test_a_bar_per_benchmark_on_a_terminal_and_none_without_one_or_quiet(tmp_path, trained_run, capsys, monkeypatch):
    import sys

    import medsrl.evaluation.progress as progress

    policy = f"model_path={trained_run / 'policy'}"
    evaluate(_eval_cfg(tmp_path / "pipe", policy))  # stderr is captured: not a terminal
    assert "samples/s" not in capsys.readouterr().err
    monkeypatch.setattr(progress.sys, "stderr", _Terminal(sys.stderr))
    evaluate(_eval_cfg(tmp_path / "tty", policy))
    err = capsys.readouterr().err
    assert "run / arithmetic" in err and "8/8" in err and "samples/s" in err
    evaluate(_eval_cfg(tmp_path / "quiet", policy, "quiet=true"))
    assert "samples/s" not in capsys.readouterr().err
