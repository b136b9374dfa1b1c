"""Which MEDS feature an evaluation computes, and that it is the training feature."""

from __future__ import annotations

import logging

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from medsrl.eval import feature_spec_for
from medsrl.evaluation.response_features import response_features
from medsrl.evaluation.responses import SamplingSpec
from medsrl.features.reader import FeatureSpec, round_to_bfloat16
from medsrl.models.char_tokenizer import build_char_tokenizer
from medsrl.models.tiny import build_tiny_model
from medsrl.rollout.base import RolloutBatch
from medsrl.run_config import EvalRunConfig
from run_helpers import ROOT

EVAL_DEFAULT = FeatureSpec(layers=3, diff=True)  # differs from every plug-in default on purpose


def make_run(tmp_path, cfg: dict, name: str = "run"):
    """A fake training run directory whose Hydra config is ``cfg``."""
    run = tmp_path / name
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(cfg), run / ".hydra" / "config.yaml")
    return run


def meds_run(tmp_path, meds: dict, name: str = "run"):
    plugin = {"_target_": "medsrl.methods.meds.plugin.Meds", "alpha": 0.02, **meds}
    return make_run(tmp_path, {"algorithm": {"name": "meds", "plugins": {"meds": plugin}}}, name)


# --------------------------------------------------------------------------- feature_spec_for


def test_a_meds_run_gives_its_own_feature_settings(tmp_path, caplog):
    run = meds_run(tmp_path, {"features": {"layers": "half", "diff": True, "final_norm": True, "dtype": "bfloat16"}})
    want = FeatureSpec(layers="half", diff=True, final_norm=True, dtype="bfloat16")
    with caplog.at_level(logging.INFO, logger="medsrl.eval"):
        assert feature_spec_for(run / "policy", EVAL_DEFAULT) == want
        assert feature_spec_for(str(run / "checkpoints" / "last.ckpt"), EVAL_DEFAULT) == want
    assert str(run / ".hydra" / "config.yaml") in caplog.text  # the log names the run config


def test_missing_plugin_keys_take_the_plugin_defaults_not_evals(tmp_path):
    run = meds_run(tmp_path, {"features": {"layers": [20, 24]}})
    assert feature_spec_for(run / "policy", EVAL_DEFAULT) == FeatureSpec(layers=(20, 24))
    assert feature_spec_for(meds_run(tmp_path, {}, "bare").joinpath("policy"), EVAL_DEFAULT) == FeatureSpec()


def test_a_run_with_the_flat_feature_keys_of_before_names_their_new_place(tmp_path):
    run = meds_run(tmp_path, {"layers": 7, "feature_dtype": "bfloat16"})
    with pytest.raises(ValueError) as err:
        feature_spec_for(run / "policy", EVAL_DEFAULT)
    assert str(run / ".hydra" / "config.yaml") in str(err.value)
    assert "algorithm.plugins.meds.layers was moved to algorithm.plugins.meds.features.layers" in str(err.value)
    assert "algorithm.plugins.meds.feature_dtype was moved to algorithm.plugins.meds.features.dtype" in str(err.value)


def test_models_without_a_meds_run_get_evals_features(tmp_path, caplog):
    no_cfg = tmp_path / "bare"  # a run dir without .hydra/config.yaml
    dapo = make_run(
        tmp_path,
        {"algorithm": {"name": "dapo", "plugins": {"overlong": {"buffer_length": 4}}}},
        "dapo",
    )
    disabled = make_run(tmp_path, {"algorithm": {"plugins": {"meds": None}}}, "off")
    model_only = make_run(tmp_path, {"model": {"name": "tiny"}}, "model_only")
    elsewhere = meds_run(tmp_path, {"features": {"layers": 5}}, "elsewhere")
    paths = [
        no_cfg / "policy",
        no_cfg / "checkpoints" / "last.ckpt",
        dapo / "policy",
        disabled / "policy",
        model_only / "checkpoints" / "step_000020.ckpt",
        elsewhere / "export" / "model.ckpt",  # not <run>/checkpoints/*.ckpt
        "Qwen/Qwen2.5-Math-7B",
    ]
    with caplog.at_level(logging.INFO, logger="medsrl.eval"):
        for path in paths:
            assert feature_spec_for(path, EVAL_DEFAULT) == EVAL_DEFAULT, path
    assert "eval's features" in caplog.text


def test_features_null_turns_features_off_even_for_a_meds_run(tmp_path):
    run = meds_run(tmp_path, {"features": {"layers": 5}})
    assert feature_spec_for(run / "policy", None) is None


# --------------------------------------------------------------------------- eval.yaml


def compose_eval(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("eval", overrides=list(overrides))


def _settings(*overrides):
    return EvalRunConfig.parse(compose_eval("paths.output_dir=/nowhere", *overrides))


def test_eval_yaml_features():
    assert _settings().features == FeatureSpec()
    assert _settings("features=null").features is None
    spec = _settings("features.layers=[20,24]", "features.dtype=float32").features
    assert spec == FeatureSpec(layers=(20, 24), dtype="float32")
    with pytest.raises(ValueError, match=r"features.feature_dtype is not a setting of features \(known: diff, "):
        _settings("+features.feature_dtype=auto")
    with pytest.raises(ValueError, match="features.dtype must be one of 'auto', 'float32', 'bfloat16'"):
        _settings("features.dtype=half")


def test_stored_evaluations_keep_their_fingerprints():
    """The resume fingerprints of generations stored before SamplingSpec (EvalSettings's, computed
    by that code): same keys, values and JSON, so those evaluations still resume."""
    def fp(run, model, benchmark, features="eval", engine=None):
        spec = run if features == "eval" else run.model_copy(update={"features": features})
        extra = {"template": run.template.model_dump(), "limit": run.limit, **({"engine": engine} if engine else {})}
        return spec.fingerprint(model, benchmark, **extra)

    default = _settings()
    assert fp(default, "logs/train/runs/x/policy", "arithmetic") == "530f7ac8fd04"
    run = _settings("features=null", "n=4", "temperature=0.6", "limit=10", "max_new_tokens=2815", "seed=3",
                    "batch_size=4096", "top_p=0.95")
    assert fp(run, "Qwen/Qwen2.5-Math-7B", "math500") == "b5e1023a9675"
    chat = _settings("template.kind=chat", "template.system_prompt=null", "template.enable_thinking=false")
    engine = {"backend": "vllm", "dtype": "bfloat16", "per_request_seeds": False}
    assert fp(chat, "r/checkpoints/last.ckpt", "aime24", FeatureSpec(layers="half", dtype="bfloat16", diff=True),
              engine) == "8cb84b0e7158"
    digits = FeatureSpec(layers=(20, 24), logits="digits", final_norm=True)
    assert fp(default, "r/policy", "gsm8k", digits) == "24f29bfbc342"


def test_the_feature_spec_is_part_of_the_fingerprint():
    def fp(**kw):
        return SamplingSpec(**kw).fingerprint("run/policy", "math500")

    assert fp(features=FeatureSpec(layers=[2, 5])) == fp(features=FeatureSpec(layers=(2, 5)))
    prints = {
        fp(features=FeatureSpec()),
        fp(features=FeatureSpec(layers="half")),
        fp(features=FeatureSpec(diff=True)),
        fp(features=FeatureSpec(final_norm=True)),
        fp(features=FeatureSpec(dtype="bfloat16")),
        fp(features=None),
    }
    assert len(prints) == 6


def rollout(tok, texts):
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    prompt = tok.encode("1+2=", add_special_tokens=False)
    n = len(texts)
    return RolloutBatch(list(range(n)), [prompt] * n, ids, list(texts), ["stop"] * n)


def reference_layer_logits(model, tok, prompt: str, response: str) -> torch.Tensor:
    """[N] logits of the first boxed answer token from every layer, one sequence alone, via
    ``output_hidden_states=True``."""
    p = tok.encode(prompt, add_special_tokens=False)
    r = tok.encode(response, add_special_tokens=False)
    brace = len(p) + response.rindex("\\boxed{") + len("\\boxed")  # char tokenizer: 1 char = 1 id
    with torch.no_grad():
        hs = model(input_ids=torch.tensor([p + r]), output_hidden_states=True).hidden_states
        nxt = (p + r)[brace + 1]
        return torch.stack([model.lm_head(h[0, brace]).float()[nxt] for h in hs[1:]])


def test_response_features_are_the_reference_feature():
    tok = build_char_tokenizer()
    model = build_tiny_model(0).eval()  # 4 layers
    texts = ["so \\boxed{3}", "no box", "a \\boxed{12} b", "\\boxed{"]
    batch = rollout(tok, texts)
    spec = FeatureSpec(layers=2, diff=True)
    feats = response_features(model, tok, batch, spec=spec, micro_batch_size=2)
    assert feats[1] is None and feats[3] is None  # no box; "{" last: nothing to score
    for row in (0, 2):
        lv = reference_layer_logits(model, tok, "1+2=", texts[row])
        want = torch.stack([lv[2] - lv[1], lv[3] - lv[2]])  # L3-L2, L4-L3
        torch.testing.assert_close(torch.tensor(feats[row]), want, rtol=1e-4, atol=1e-5)
    assert response_features(model, tok, batch, spec=spec, micro_batch_size=1) == feats
    rounded = response_features(model, tok, batch, spec=FeatureSpec(dtype="bfloat16"))
    first = torch.tensor(rounded[0])
    assert first.shape == (4,) and torch.equal(first, round_to_bfloat16(first))
    model.train()
    assert response_features(model, tok, rollout(tok, ["none", "x"]), spec=spec) == [None, None]
    assert len(response_features(model, tok, batch, spec=FeatureSpec())[2]) == 4
    assert model.training  # the caller's mode is restored
