"""The run config parsed once at start: values checked against type and range, each problem named
by its Hydra key, before any model loads."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from medsrl.rollout.settings import RolloutConfig
from medsrl.run_config import EvalRunConfig, RunConfig
from medsrl.train import parse_run
from run_helpers import ROOT, compose_train, config_problems

MEDS = "medsrl.methods.meds.plugin.Meds"
PASS_AT_K = "medsrl.callbacks.pass_at_k.PassAtKValidation"
OVERLONG = "medsrl.methods.overlong.OverlongPenalty"
ARITHMETIC = "medsrl.data.arithmetic.generate_arithmetic"


def problems(values: dict) -> list[str]:
    """The messages of the parser on a hand-made config (over the smallest one that parses)."""
    found = config_problems(values)
    assert found, "no problem found"
    return found


def one_problem(values: dict) -> str:
    found = problems(values)
    assert len(found) == 1, found
    return found[0]


# ---------------------------------------------------------------- each kind of rule


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"optim": {"optimizer": {"lr": "abc"}}}, "optim.optimizer.lr must be a number >= 0, got 'abc'"),
        # a quoted YAML number
        ({"optim": {"optimizer": {"lr": "1e-5"}}}, "optim.optimizer.lr must be a number >= 0, got '1e-5'"),
        ({"optim": {"optimizer": {"lr": -1e-5}}}, "optim.optimizer.lr must be a number >= 0, got -1e-05"),
        ({"optim": {"optimizer": {"lr": float("nan")}}}, "optim.optimizer.lr must be a number >= 0, got nan"),
        ({"optim": {"optimizer": {"eps": 0}}}, "optim.optimizer.eps must be a positive number or null, got 0"),
        ({"optim": {"optimizer": {"betas": [0.9, 1.0]}}},
         "optim.optimizer.betas must be a pair of numbers each in [0, 1) or null, got [0.9, 1.0]"),
        ({"optim": {"optimizer": {"betas": [0.9]}}},
         "optim.optimizer.betas must be a pair of numbers each in [0, 1) or null, got [0.9]"),
        ({"optim": {"scheduler": {"warmup_steps": -1}}}, "optim.scheduler.warmup_steps must be an int >= 0, got -1"),
        ({"optim": {"grad_clip": None}}, "optim.grad_clip must be a number >= 0 (0: no clipping), got None"),
        ({"optim": {"max_param_norm_growth": 0.5}},
         "optim.max_param_norm_growth must be 0 (off) or a number > 1, got 0.5"),
        ({"rollout": {"n": 0}}, "rollout.n must be an int >= 1, got 0"),
        ({"rollout": {"n": 2.0}}, "rollout.n must be an int >= 1, got 2.0"),
        ({"rollout": {"n": True}}, "rollout.n must be an int >= 1, got True"),
        ({"rollout": {"temperature": 0.0}}, "rollout.temperature must be a positive number, got 0.0"),
        ({"rollout": {"top_p": 0}}, "rollout.top_p must be a number in (0, 1], got 0"),
        ({"rollout": {"top_p": 1.5}}, "rollout.top_p must be a number in (0, 1], got 1.5"),
        ({"rollout": {"logprobs": "yes"}}, "rollout.logprobs must be true or false, got 'yes'"),
        ({"rollout": {"backend": "sglang"}}, "rollout.backend must be one of 'hf', 'vllm', got 'sglang'"),
        ({"algorithm": {"clip_low": -0.2}}, "algorithm.clip_low must be a number >= 0, got -0.2"),
        ({"algorithm": {"dual_clip": 1.0}}, "algorithm.dual_clip must be a number > 1 or null, got 1.0"),
        ({"algorithm": {"loss_agg_mode": "mean"}}, "algorithm.loss_agg_mode must be one of 'token-mean'"),
        ({"algorithm": {"advantage": "ppo"}}, "algorithm.advantage must be one of 'drgrpo', 'gdpo', 'grpo'"),
        ({"algorithm": {"mini_batch_prompts": 0}}, "algorithm.mini_batch_prompts must be an int >= 1 or null, got 0"),
        ({"algorithm": {"ppo_epochs": 0}}, "algorithm.ppo_epochs must be an int >= 1, got 0"),
        ({"data": {"prompts_per_step": 0}}, "data.prompts_per_step must be an int >= 1, got 0"),
        ({"data": {"stages": [{"name": "A", "start_step": -1, "datasets": [{"name": "a", "source": {}}]}]}},
         "data.stages.0.start_step must be an int >= 0, got -1"),
        ({"trainer": {"max_steps": 0}}, "trainer.max_steps must be an int >= 1 or -1, got 0"),
        ({"seed": -3}, "seed must be an int in [0, 4294967295], got -3"),
        ({"grader": {"timeout_s": 0}}, "grader.timeout_s must be a positive number, got 0"),
        ({"grader": {"num_workers": -1}}, "grader.num_workers must be an int >= 0 or null, got -1"),
        ({"grader": {"reasoning_end": ""}}, "grader.reasoning_end must be a non-empty tag such as '</think>', or null"),
        ({"data": {"template": {"kind": "jinja"}}}, "data.template.kind must be one of 'qwen_math', 'chat', 'plain'"),
        ({"data": {"template": {"enable_thinking": "yes"}}},
         "data.template.enable_thinking must be true or false or null"),
        ({"callbacks": {"pass_at_k": {"_target_": PASS_AT_K, "n": 0}}},
         "callbacks.pass_at_k.n must be an int >= 1, got 0"),
        ({"callbacks": {"pass_at_k": {"_target_": PASS_AT_K, "every_n_steps": -1}}},
         "callbacks.pass_at_k.every_n_steps must be an int >= 0"),
        ({"resume_mode": "some"}, "resume_mode must be one of 'full', 'weights', got 'some'"),
        ({"callbacks": {"milestones": {"_target_": "medsrl.callbacks.milestones.WeightMilestones",
                                       "every_n_steps": -1}}},
         "callbacks.milestones.every_n_steps must be an int >= 0"),
        ({"hardware": {"name": "8x H100", "gpu_memory_gib": 0}}, "hardware.gpu_memory_gib must be a positive number"),
        ({"model": {"dtype": "bfloat16"}}, "model.dtype=bfloat16 keeps the master weights and AdamW states in 16 bits"),
        ({"trainer": {"precision": "bf16-true"}}, "trainer.precision=bf16-true casts the master weights to 16 bits"),
        # with LoRA model.dtype is the adapters': the base's has its own key
        ({"model": {"dtype": "bfloat16", "lora": {"r": 8}}}, "model.dtype=bfloat16 keeps the LoRA adapters (the only "
         "trained weights; the frozen base's dtype is model.lora.base_dtype) and AdamW states in 16 bits"),
        ({"model": {"lora": {"r": 8, "base_dtype": "int8"}}}, "model.lora.base_dtype must be one of 'compute', 'auto'"),
    ],
)
def test_each_rule_names_the_key_the_expectation_and_the_value(values, message):
    assert one_problem(values).startswith(message)


@pytest.mark.parametrize(
    "values",
    [
        {},  # keys a config does not have are skipped
        {"optim": {"optimizer": {"lr": 0.0, "betas": [0.0, 0.999]}, "grad_clip": 0.0}},  # lr 0: a weights-only start
        {"optim": {"optimizer": {"lr": 3}}},  # an int is a number
        {"rollout": {"top_p": 1, "n": 1}},
        {"algorithm": {"dual_clip": None, "mini_batch_prompts": None}},
        {"trainer": {"max_steps": -1}},  # Lightning: no limit
        {"grader": {"num_workers": 0}},  # in-process grading (debugging)
        {"grader": {"num_workers": None}},  # one per core
        {"trainer": {"precision": "bf16-mixed"}, "model": {"dtype": "float32"}},
        # LoRA as users run it: a bf16 frozen base, fp32 adapters (the default under bf16-mixed), or an fp32 base
        {"trainer": {"precision": "bf16-mixed"}, "model": {"dtype": "float32", "lora": {"r": 8, "base_dtype": "bf16"}}},
        {"trainer": {"precision": "bf16-mixed"}, "model": {"lora": {"r": 16, "base_dtype": "compute"}}},
        {"trainer": {"precision": "bf16-mixed"}, "model": {"lora": {"r": 16, "base_dtype": "float32"}}},
        # pure 16 bits when asked for by name; or nothing to lose (lr 0)
        {"trainer": {"precision": "bf16-true"}, "model": {"dtype": "bfloat16", "allow_16bit_weights": True}},
        {"trainer": {"precision": "bf16-true"}, "model": {"dtype": "bfloat16"}, "optim": {"optimizer": {"lr": 0.0}}},
        {"callbacks": {"pass_at_k": {"_target_": PASS_AT_K, "temperature": 0.0, "every_n_steps": 0}}},  # greedy; off
    ],
)
def test_good_and_boundary_values_pass(values):
    assert config_problems(values) == []


def test_every_problem_is_reported_at_once():
    found = problems({"optim": {"optimizer": {"lr": "abc", "eps": -1}}, "rollout": {"n": 0},
                      "trainer": {"max_steps": "10"}})
    assert [f.split(" must ")[0] for f in found] == ["optim.optimizer.lr", "optim.optimizer.eps",
                                                     "rollout.n", "trainer.max_steps"]


def test_a_value_set_by_interpolation_is_checked_resolved():
    found = problems({"seed": 7, "data": {"seed": "${seed}", "prompts_per_step": "${seed}x"}})
    assert found == ["data.prompts_per_step must be an int >= 1, got '7x'"]


def test_missing_unknown_and_related_values():
    msg = one_problem({"rollout": {"n": "???"}})
    assert msg == "rollout.n must be set (it is ???)"
    msg = one_problem({"algorithm": {"clip_hgh": 0.3}})
    assert msg.startswith("algorithm.clip_hgh is not a setting of algorithm (known: ")
    msg = one_problem({"rollout": {"max_new_tokens": 16},
                       "algorithm": {"plugins": {"overlong": {"_target_": OVERLONG, "buffer_length": 16}}}})
    assert msg == "algorithm.plugins.overlong.buffer_length must be less than rollout.max_new_tokens (16), got 16"


def test_plugins_are_checked_by_their_target_under_any_key():
    steer = {"_target_": "medsrl.methods.steer.Steer", "low": 1.2, "high": 0.8}
    found = problems({"algorithm": {"plugins": {
        "memory": {"_target_": MEDS, "alpha": -0.1, "clustering": {"k": 0, "min_cluster_size": 1, "mode": "x"}},
        "dyn": {"_target_": "medsrl.methods.dynamic_sampling.DynamicSampling", "max_rounds": -1},
        "r3": {"_target_": "medsrl.methods.r3.plugin.R3", "ranking": {"p": 0}, "replay": {"lam": 0}},
        "steer": steer,
        "typo": {"_target_": MEDS, "alhpa": 0.1},
        "gone": {"_target_": "medsrl.plugins.nothing.Here"},
        "settings_only": {"alpha": -1},  # no _target_: not a plug-in of this run (ignored, as in train)
    }}})
    assert "algorithm.plugins.memory.alpha must be a number >= 0, got -0.1" in found
    assert "algorithm.plugins.memory.clustering.k must be an int >= 1, got 0" in found
    assert "algorithm.plugins.memory.clustering.min_cluster_size must be an int >= 2, got 1" in found
    assert "algorithm.plugins.memory.clustering.mode must be one of 'cluster', 'single', 'answer', got 'x'" in found
    assert "algorithm.plugins.dyn.max_rounds must be an int >= 0, got -1" in found
    assert "algorithm.plugins.r3.ranking.p must be a number in (0, 1], got 0" in found
    assert "algorithm.plugins.r3.replay.lam must be a positive number, got 0" in found
    assert any(f.startswith("algorithm.plugins.typo.alhpa is not a setting of Meds") for f in found)
    assert "algorithm.plugins.gone._target_ must be a medsrl Plugin class, got 'medsrl.plugins.nothing.Here'" in found
    assert len(found) == 9, found
    # a bound between settings: checked on the typed run, once every section parses
    assert problems({"algorithm": {"plugins": {"steer": steer}}}) == [
        "algorithm.plugins.steer.low must be <= algorithm.plugins.steer.high (0.8), got 1.2"]


def test_the_readme_example_grpo_on_tiny_warns_of_nothing_but_a_typo_still_warns(caplog):
    """tiny sets overlong's and dynamic sampling's settings for the algorithms that use them;
    under algorithm=grpo they are expected, not news. A name no plug-in preset has is."""
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=["algorithm=grpo", "+algorithm.plugins.mdes.alpha=0.1"])
    with caplog.at_level("INFO", logger="medsrl.run_config"):
        RunConfig.parse(cfg)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == ["algorithm.plugins.mdes has settings but no _target_: not built in this run, ignored"]
    assert any("algorithm.plugins.overlong has settings" in r.getMessage() for r in caplog.records)


def test_a_generator_source_names_its_dataset_and_generator():
    msg = one_problem({"data": {"stages": [{"name": "A", "start_step": 0, "datasets": [
        {"name": "easy", "weight": 1.0, "source": {"_target_": ARITHMETIC, "num": 0, "split": "train"}}]}]}})
    assert msg == f"data.stages.0.datasets.0.source.num must be an int >= 1, got 0 (dataset 'easy', {ARITHMETIC})"


def test_the_schema_is_plain_pydantic():
    with pytest.raises(ValueError, match="must be an int >= 1"):
        RolloutConfig(n=0)
    assert RolloutConfig(n=4).n == 4
    assert config_problems({"rollout": {"n": 0}}) == ["rollout.n must be an int >= 1, got 0"]
    assert config_problems({"rollout": {"n": 4}}) == []


def test_eval_rules():
    cfg = OmegaConf.create({
        "n": 0, "temperature": 0.0, "top_p": 1.0, "limit": 0, "dtype": "float64", "seed": 0,
        "features": {"layers": "half", "dtype": "auto"},
        "benchmark": {"arithmetic": {"_target_": ARITHMETIC, "num": -2}},
        "grader": {"timeout_s": "5"},
    })
    with pytest.raises(ValueError) as err:
        EvalRunConfig.parse(cfg)
    found = [f.strip() for f in str(err.value).splitlines()[1:]]
    assert len(found) == 5, found
    assert {
        "n must be an int >= 1, got 0",
        "limit must be an int >= 1 or null, got 0",
        "grader.timeout_s must be a positive number, got '5'",
        f"benchmark.arithmetic.num must be an int >= 1, got -2 (benchmark 'arithmetic', {ARITHMETIC})",
    } < set(found)
    assert any(f.startswith("dtype must be one of 'auto', ") and f.endswith("got 'float64'") for f in found)


# ---------------------------------------------------------------- the real configs


def _experiments() -> list[str]:
    return sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("*.yaml") if not p.stem.startswith("_"))


def _algorithms() -> list[str]:
    return sorted(p.stem for p in (ROOT / "configs" / "algorithm").glob("[!_]*.yaml"))  # _defaults: the schema


@pytest.mark.parametrize(
    "overrides",
    [[], ["rollout=vllm", "trainer=fsdp", "data=math"]]
    + [[f"prompt={p.stem}", "data=deepscaler"] for p in sorted((ROOT / "configs" / "prompt").glob("*.yaml"))]
    + [[f"experiment={e}"] for e in _experiments()]
    + [[f"algorithm={a}"] for a in _algorithms()],
)
def test_every_shipped_training_config_passes(tmp_path, overrides):
    RunConfig.parse(compose_train(tmp_path, overrides, debug=None))


def _eval_cfg(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("eval", overrides=["paths.output_dir=/nowhere", *overrides])


@pytest.mark.parametrize("benchmark", ["arithmetic", "paper", "study", "gsm8k"])
def test_every_shipped_eval_config_passes(benchmark):
    EvalRunConfig.parse(_eval_cfg(f"benchmark={benchmark}"))


@pytest.fixture
def no_model(monkeypatch):
    """Building or loading a model fails the test: the checks must come first."""
    import medsrl.eval
    import medsrl.train

    def fail(*args, **kwargs):
        raise AssertionError("a model was built before the config was checked")

    monkeypatch.setattr(medsrl.train, "build_policy", fail)
    monkeypatch.setattr(medsrl.eval, "load_for_eval", fail)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["optim.optimizer.lr=abc"], "optim.optimizer.lr must be a number >= 0, got 'abc'"),
        (["rollout.n=0"], "rollout.n must be an int >= 1, got 0"),
        (["algorithm.plugins.overlong.buffer_length=-4"],
         "algorithm.plugins.overlong.buffer_length must be an int >= 1"),
        # a misspelt option of the estimator, of the loss and of a plug-in: named at start, with what it has
        (["+algorithm.advantage_options.epsilon=1e-6"],
         "algorithm.advantage_options.epsilon is not a setting of advantage 'grpo' (known: eps)"),
        (["algorithm.policy_loss=lp_reg", "+algorithm.policy_loss_options.tua=0.1"],
         "algorithm.policy_loss_options.tua is not a setting of policy_loss 'lp_reg' (known: beta, bottom_frac, tau, "
         "tau_relative)"),
        (["algorithm.policy_loss=clip_cov", "+algorithm.policy_loss_options.clip_cov_ratio=2"],
         "algorithm.policy_loss_options.clip_cov_ratio must be a number in (0, 1], got 2"),
        # an estimator's option bounded by another section (passk's k <= rollout.n)
        (["algorithm=passk", "algorithm.advantage_options.k=64"],
         "algorithm.advantage_options.k must be <= rollout.n (4), got 64"),
        (["algorithm=meds", "+algorithm.plugins.meds.alhpa=0.2"],
         "algorithm.plugins.meds.alhpa is not a setting of Meds (known: alpha, beta, clustering, features, "),
        # a key of before: named with its new place
        (["algorithm=meds", "+algorithm.plugins.meds.feature_dtype=bfloat16", "+algorithm.plugins.meds.k=5"],
         "algorithm.plugins.meds.feature_dtype was moved to algorithm.plugins.meds.features.dtype"),
        (["algorithm=novelty", "+algorithm.plugins.novelty.layers=2"],
         "algorithm.plugins.novelty.layers was moved to algorithm.plugins.novelty.features.layers"),
    ],
)
def test_medsrl_train_fails_at_start_before_the_model_is_built(tmp_path, no_model, overrides, message):
    from medsrl.train import build_run

    cfg = compose_train(tmp_path / "run", overrides)
    with pytest.raises(ValueError, match="training config") as err:
        build_run(cfg)
    assert message in str(err.value)


def test_medsrl_eval_fails_before_any_model_loads(tmp_path, no_model):
    from medsrl.eval import evaluate

    out = tmp_path / "eval"
    cfg = _eval_cfg(f"paths.output_dir={out}", "model_path=/some/model", "n=0", "top_p=0")
    with pytest.raises(ValueError, match="evaluation config") as err:
        evaluate(cfg)
    assert "n must be an int >= 1, got 0" in str(err.value)
    assert "top_p must be a number in (0, 1], got 0" in str(err.value)
    assert not out.exists()  # nothing written either


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.lora.r=-1", "model.lora.r must be an int >= 0, got -1"),
        ("model.lora.dropout=1.0", "model.lora.dropout must be a number in [0, 1), got 1.0"),
        ("model.lora.alpha=0", "model.lora.alpha must be a positive number, got 0"),
        ("model.lora.target_modules=[]", "model.lora.target_modules must be a non-empty list of module names"),
        ("+model.lora.rank=8", "model.lora.rank is not a setting of model.lora (known: "),
        # checked on the model built on the meta device, before any weight loads
        ("model.lora.target_modules=[q_proj,qkv_proj]",
         "model.lora.target_modules: 'qkv_proj' matches no module of Qwen2ForCausalLM (its linear layers: "),
    ],
)
def test_bad_lora_settings_are_named_before_the_model_is_built(tmp_path, no_model, override, message):
    from medsrl.train import build_run

    cfg = compose_train(tmp_path / "run", ["model.lora.r=8", override])
    with pytest.raises(ValueError, match="training config") as err:
        build_run(cfg)
    assert message in str(err.value)


def test_lora_targets_of_a_real_architecture_are_checked_from_its_shape(tmp_path):
    cfg = compose_train(tmp_path, ["experiment=qwen3-8b_dapo", "model.lora.r=16"], debug=None)
    parse_run(cfg)  # the default targets exist in Qwen3
    cfg = compose_train(tmp_path, ["experiment=qwen3-8b_dapo", "model.lora.r=16", "model.lora.target_modules=[c_attn]"],
                        debug=None)
    with pytest.raises(ValueError, match="'c_attn' matches no module of Qwen3ForCausalLM"):
        parse_run(cfg)


# ---------------------------------------------------------------- parsed once, read typed

# The entry layer: the modules that turn a composed config into a RunConfig (tests/test_import_layers.py's top layer).
ENTRY_LAYER = ("train.py", "eval.py", "warmstart.py", "run_config.py", "config_files.py", "plan/", "study/")
# Keys that name a setting but are read from other mappings (each with what it reads)
NOT_CONFIG = {("data/datamodule.py", "stages"): "the datamodule's checkpoint state",
              ("models/loading.py", "model"): "a tokenizer.json's model section"}


def _setting_names() -> set[str]:
    """Every setting's name: the run config's sections, each plug-in's and each registered
    estimator's and loss's options."""
    from pydantic import BaseModel

    from medsrl.algo.advantages import ADVANTAGE_OPTIONS
    from medsrl.algo.policy_loss import POLICY_LOSS_OPTIONS
    from medsrl.settings import settings_model

    names, todo = set(), [RunConfig, EvalRunConfig, *ADVANTAGE_OPTIONS.values(), *POLICY_LOSS_OPTIONS.values()]
    for path in (ROOT / "configs" / "plugins").glob("*.yaml"):
        target = OmegaConf.load(path)["_target_"]
        module, name = target.rsplit(".", 1)
        todo.append(settings_model(getattr(__import__(module, fromlist=[name]), name)))
    while todo:
        model = todo.pop()
        for name, field in model.model_fields.items():
            names.add(name)
            todo += [t for t in _models(field.annotation) if issubclass(t, BaseModel)]
    return names


def _models(hint) -> list:
    from typing import get_args

    return [hint] if isinstance(hint, type) else [m for a in get_args(hint) for m in _models(a)]


def test_no_setting_is_read_with_a_default_below_the_entry_layer():
    """Below the entry layer the settings arrive parsed: a ``.get("<setting>", <default>)`` there
    is a second home for a default, which drifts (``rollout.n`` was 8 in the schema, 1 in the plan)."""
    import re

    names = _setting_names()
    assert {"n", "lr", "alpha", "micro_batch_size", "gpu_memory_utilization", "tau"} <= names
    found = []
    src = ROOT / "src" / "medsrl"
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        if rel.startswith(ENTRY_LAYER):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for key in re.findall(r"""\.get\(\s*["'](\w+)["']\s*,""", line):
                if key in names and (rel, key) not in NOT_CONFIG:
                    found.append(f"{rel}:{i}: {line.strip()}")
    assert not found, found


def test_a_run_parses_its_config_once(tmp_path, monkeypatch):
    """One training run (two steps, validation, a checkpoint, a resume's worth of state) builds
    its settings once, at the start: nothing below parses a section again (every build of a
    settings class is counted, by ``model_validate`` or by its constructor)."""
    from collections import Counter

    from pydantic import BaseModel

    from medsrl.settings import Settings
    from medsrl.train import train

    built: Counter[str] = Counter()
    validate, init = Settings.model_validate.__func__, Settings.__init__

    def counted_validate(cls, *args, **kwargs):
        built[cls.__qualname__] += 1
        return validate(cls, *args, **kwargs)

    def counted_init(self, *args, **kwargs):
        built[type(self).__qualname__] += 1
        init(self, *args, **kwargs)

    monkeypatch.setattr(Settings, "model_validate", classmethod(counted_validate))
    monkeypatch.setattr(Settings, "__init__", counted_init)
    cfg = compose_train(tmp_path / "run", ["algorithm=meds", "algorithm.plugins.dynamic_sampling=null",
                                           "+callbacks.pass_at_k.features=null"])
    RunConfig.parse(cfg)
    at_start = dict(built)
    built.clear()
    train(cfg)
    assert {"RunConfig", "Meds", "OverlongPenalty", "PassAtKValidation"} <= set(at_start), sorted(at_start)
    sections, todo = set(at_start), [RunConfig]  # and every section a RunConfig holds
    while todo:
        model = todo.pop()
        sections.add(model.__qualname__)
        todo += [t for f in model.model_fields.values() for t in _models(f.annotation)
                 if issubclass(t, BaseModel) and t.__qualname__ not in sections]
    again = {k: built[k] for k in sections if built[k] != at_start.get(k, 0)}
    assert not again, again  # train(cfg) parses once, as at the start, and builds no section again
