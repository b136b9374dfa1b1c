"""The held-out validation callback: val/accuracy, val/pass@k and diversity at start, every N
steps and at the end; the run summary reads its first and last accuracy."""

from __future__ import annotations

import json

import pytest

from medsrl.callbacks.pass_at_k import PassAtKValidation
from medsrl.train import train
from run_helpers import MICRO_WARM_START, compose_train, read_metrics


class _RecordingEngine:
    """A rollout engine with its own weights (as vLLM): every response boxes an answer (1, 2, 3, ...)."""

    uses_policy_weights = False

    def __init__(self, tokenizer, events: list) -> None:
        self.tokenizer, self.events = tokenizer, events

    def generate(self, prompts, params):
        from medsrl.rollout.base import RolloutBatch

        self.events.append("generate")
        rows = [i for i in range(len(prompts)) for _ in range(params.n)]
        texts = [f"so \\boxed{{{k % 3 + 1}}}" for k in range(len(rows))]
        return RolloutBatch(rows, [self.tokenizer(prompts[i])["input_ids"] for i in rows],
                            [self.tokenizer(t)["input_ids"] + [2] for t in texts], texts, ["stop"] * len(rows))

    def release(self) -> None:
        self.events.append("release")


def test_validation_samples_every_chunk_then_releases_the_engine_then_reads_features_under_autocast():
    """Validation ran its feature forward after each chunk with the engine still awake, outside
    autocast (fp32 over fp32 weights), and under FSDP on the whole policy gathered: about 87-113
    GiB at 7B on an 80 GB card. Now: sample every chunk, release the engine, then one feature
    pass through the policy module under the run's autocast."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    import torch
    from lightning.pytorch.plugins.precision import MixedPrecision

    from medsrl.data.example import Prompt
    from medsrl.models.char_tokenizer import build_char_tokenizer
    from medsrl.models.tiny import build_tiny_model
    from medsrl.reward.grader import MathGrader

    events: list = []
    tok = build_char_tokenizer()
    policy = build_tiny_model(seed=0, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                              num_key_value_heads=1, intermediate_size=64)
    policy.register_forward_pre_hook(lambda *_: events.append(("forward", torch.is_autocast_enabled("cpu"))))
    problems = [Prompt(f"k{i}", f"{i}+1?", f"{i}+1?", "2", "val") for i in range(5)]
    logged = []
    trainer = SimpleNamespace(datamodule=SimpleNamespace(val_prompts=lambda: problems), global_step=0,
                              loggers=[SimpleNamespace(log_metrics=lambda m, step: logged.append(m))],
                              precision_plugin=MixedPrecision("bf16-mixed", "cpu"))
    module = SimpleNamespace(
        engine=_RecordingEngine(tok, events), tokenizer=tok, policy=policy, plugins=[],
        rollout_cfg=SimpleNamespace(max_new_tokens=8), grader=MathGrader(num_workers=0),
        algorithm=SimpleNamespace(micro_batch_size=64, max_tokens_per_microbatch=None),
        sync_engine=lambda stale_only: events.append("sync"), policy_for_generation=nullcontext,
    )
    cb = PassAtKValidation(n=2, batch_size=4)  # chunks of 2 problems: 3 chunks
    cb.setup(trainer, module, "fit")
    cb._evaluate(trainer, module)
    assert events == ["sync", "generate", "generate", "generate", "release", ("forward", True)]
    assert 0 < logged[0]["val/accuracy"] < 1 and logged[0]["val/num_samples"] == 10
    assert "val/eigen_ratio" in logged[0]  # read from the features (NaN, so not logged, without)


@pytest.mark.slow
def test_validation_is_logged_at_start_every_n_steps_and_at_the_end(tmp_path, micro_cache):
    out = tmp_path / "run"
    overrides = [
        *MICRO_WARM_START,
        "callbacks.pass_at_k.n=4",
        "callbacks.pass_at_k.num_problems=6",
        "trainer.max_steps=3",
        "data.val_size=8",
    ]
    summary = train(compose_train(out, overrides, cache_dir=micro_cache))
    metrics = read_metrics(out)
    for step in (0, 2, 3):  # before step 1, every 2 steps, and after the last
        m = metrics[step]
        for name in [
            "val/accuracy",
            "val/pass@1",
            "val/pass@2",
            "val/pass@4",
            "val/maj@n",
            "val/distinct_answers",
            "val/distinct_wrong",
            "val/wrong_clusters",
        ]:
            assert name in m, (step, name)
        assert m["val/accuracy"] == m["val/pass@1"]
        assert m["val/num_samples"] == 6 * 4
        assert m["val/pass@1"] <= m["val/pass@2"] <= m["val/pass@4"]
        assert 1.0 <= m["val/distinct_answers"] <= 4.0  # the warm-started micro model boxes answers
    assert "val/pass@1" not in metrics.get(1, {})
    assert summary["val_accuracy_start"] == metrics[0]["val/accuracy"]
    assert summary["val_accuracy_end"] == metrics[3]["val/accuracy"]
    assert json.loads((out / "summary.json").read_text()) == summary


@pytest.mark.slow
def test_validation_can_be_turned_off_or_skip_the_start(tmp_path):
    off = tmp_path / "off"
    summary = train(compose_train(off, ["callbacks.pass_at_k.every_n_steps=0"]))
    assert not any(k.startswith("val/") for m in read_metrics(off).values() for k in m)
    assert "val_accuracy_start" not in summary and "val_accuracy_end" not in summary

    late = tmp_path / "late"
    summary = train(compose_train(late, ["callbacks.pass_at_k.at_start=false"]))
    steps = [s for s, m in read_metrics(late).items() if "val/accuracy" in m]
    assert steps == [2]
    assert "val_accuracy_start" not in summary and "val_accuracy_end" in summary


def test_validation_features_follow_the_runs_meds_plugin():
    from types import SimpleNamespace

    from medsrl.features.reader import FeatureSpec
    from medsrl.methods.meds.plugin import Meds

    def resolved(features, plugins):
        cb = PassAtKValidation(features=features)
        cb.setup(None, SimpleNamespace(plugins=plugins), "fit")
        return cb.settings.features

    meds = Meds(layers="half", diff=True, feature_dtype="float32")
    assert resolved("run", [meds]) == FeatureSpec(layers="half", diff=True, dtype="float32")
    assert resolved("run", []) == FeatureSpec()  # no MEDS in the run: the defaults
    assert resolved(None, [meds]) is None
    assert resolved({"layers": 3}, [meds]) == FeatureSpec(layers=3)
