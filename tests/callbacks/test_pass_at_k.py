"""The held-out validation callback: val/accuracy, val/pass@k and diversity at start, every N
steps and at the end; the run summary reads its first and last accuracy; on several ranks each
samples a share of the problems and the figures are one process's."""

from __future__ import annotations

import json
import random

import pytest

from medsrl.callbacks.pass_at_k import PassAtKValidation
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


class _SeededEngine(_RecordingEngine):
    """Seeds each response as vLLM with ``per_request_seeds`` does, by ``(seed + prompt) * 2**20 +
    sample``: a problem draws the same responses in whatever call, on whichever rank, samples it.
    Answers 1-3 after a filler of random length, some without a box (no feature)."""

    def generate(self, prompts, params):
        from medsrl.rollout.base import RolloutBatch

        self.events.append(("generate", len(prompts)))
        rows = [i for i in range(len(prompts)) for _ in range(params.n)]
        texts = [self._response(random.Random((params.seed + i) * 2**20 + k % params.n)) for k, i in enumerate(rows)]
        return RolloutBatch(rows, [self.tokenizer(prompts[i])["input_ids"] for i in rows],
                            [self.tokenizer(t)["input_ids"] + [2] for t in texts], texts, ["stop"] * len(rows))

    @staticmethod
    def _response(rng: random.Random) -> str:
        filler = "".join(rng.choice("ab+= ") for _ in range(rng.randint(0, 9)))
        answer = rng.choice("123")
        return f"{filler} so {answer}" if rng.random() < 0.2 else f"{filler} so \\boxed{{{answer}}}"


def _run_validation(engine_class, num_problems: int, **settings) -> tuple[list, list[dict]]:
    """One validation of a tiny policy on ``num_problems`` prompts (gold answer 2) under bf16
    autocast: the events (sync, the engine's calls, release, each policy forward with whether
    autocast was on) and the metrics logged."""
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
    problems = [Prompt(f"k{i}", f"{i}+1?", f"{i}+1?", "2", "val") for i in range(num_problems)]
    logged = []
    trainer = SimpleNamespace(datamodule=SimpleNamespace(val_prompts=lambda: problems), global_step=0,
                              loggers=[SimpleNamespace(log_metrics=lambda m, step: logged.append(m))],
                              precision_plugin=MixedPrecision("bf16-mixed", "cpu"))
    module = SimpleNamespace(
        engine=engine_class(tok, events), tokenizer=tok, policy=policy, plugins=[],
        rollout_cfg=SimpleNamespace(max_new_tokens=8), grader=MathGrader(num_workers=0),
        algorithm=SimpleNamespace(micro_batch_size=16, max_tokens_per_microbatch=None),
        sync_engine=lambda stale_only: events.append("sync"), policy_for_generation=nullcontext,
    )
    cb = PassAtKValidation(**settings)
    cb.setup(trainer, module, "fit")
    cb._evaluate(trainer, module)
    return events, logged


def test_validation_samples_every_chunk_then_releases_the_engine_then_reads_features_under_autocast():
    """Validation ran its feature forward after each chunk with the engine still awake, outside
    autocast (fp32 over fp32 weights), and under FSDP on the whole policy gathered: about 87-113
    GiB at 7B on an 80 GB card. Now: sample every chunk, release the engine, then one feature
    pass through the policy module under the run's autocast."""
    events, logged = _run_validation(_RecordingEngine, 5, n=2, batch_size=4)  # chunks of 2 problems: 3 chunks
    assert events == ["sync", "generate", "generate", "generate", "release", ("forward", True)]
    assert 0 < logged[0]["val/accuracy"] < 1 and logged[0]["val/num_samples"] == 10
    assert "val/eigen_ratio" in logged[0]  # read from the features (NaN, so not logged, without)


@pytest.mark.slow
def test_validation_is_logged_at_start_every_n_steps_and_at_the_end(tmp_path, micro_cache):
    from medsrl.train import train

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
    from medsrl.train import train

    off = tmp_path / "off"
    summary = train(compose_train(off, ["callbacks.pass_at_k.every_n_steps=0"]))
    assert not any(k.startswith("val/") for m in read_metrics(off).values() for k in m)
    assert "val_accuracy_start" not in summary and "val_accuracy_end" not in summary

    late = tmp_path / "late"
    summary = train(compose_train(late, ["callbacks.pass_at_k.at_start=false"]))
    steps = [s for s, m in read_metrics(late).items() if "val/accuracy" in m]
    assert steps == [2]
    assert "val_accuracy_start" not in summary and "val_accuracy_end" in summary


def test_validation_samples_with_the_runs_feature_and_token_budget():
    from types import SimpleNamespace

    from medsrl.evaluation.responses import SamplingSpec
    from medsrl.features.reader import FeatureSpec
    from medsrl.methods.meds.plugin import Meds
    from medsrl.methods.novelty import NoveltyBonus

    def resolved(plugins, **settings):
        cb = PassAtKValidation(**settings)
        cb.setup(None, SimpleNamespace(plugins=plugins, rollout_cfg=SimpleNamespace(max_new_tokens=77)), "fit")
        return cb.sampling

    meds = Meds(features={"layers": "half", "diff": True, "dtype": "float32"})
    assert resolved([meds], features="run").features == FeatureSpec(layers="half", diff=True, dtype="float32")
    assert resolved([NoveltyBonus(features={"layers": 2})]).features == FeatureSpec(layers=2)
    assert resolved([]).features == FeatureSpec()  # no feature plug-in in the run: the defaults
    assert resolved([meds], features=None).features is None
    assert resolved([meds], features={"layers": 3}).features == FeatureSpec(layers=3)
    assert resolved([], max_new_tokens=None) == SamplingSpec(n=8, max_new_tokens=77, seed=1234, batch_size=128)
    assert resolved([], max_new_tokens=5, n=2).max_new_tokens == 5


def test_each_rank_takes_a_contiguous_share_of_the_problems_cut_where_the_chunks_are():
    from medsrl.evaluation.responses import SamplingSpec, chunks_of, share_chunks

    chunked = SamplingSpec(n=4, batch_size=32)  # chunks of 8: 0-8, 8-16, 16-24, 24-30
    parts = [share_chunks(30, chunked, r, 2) for r in range(2)]
    assert parts == [[range(0, 8), range(8, 15)], [range(15, 16), range(16, 24), range(24, 30)]]
    chunks = chunks_of(30, chunked)
    assert all(any(p.start >= c.start and p.stop <= c.stop for c in chunks) for p in parts[0] + parts[1])
    one_chunk = SamplingSpec(n=4, batch_size=128)  # AIME24: 30 problems, one chunk of 32
    assert [share_chunks(30, one_chunk, r, 8) for r in (0, 5, 6, 7)] == [
        [range(0, 4)], [range(20, 24)], [range(24, 27)], [range(27, 30)]]
    assert [share_chunks(1, one_chunk, r, 2) for r in range(2)] == [[range(0, 1)], []]


AIME_LIKE = dict(n=4, batch_size=128)  # 30 problems make one sampling chunk (of 32)
SIZES = (30, 1)  # AIME24's, and fewer problems than ranks


def _validate_on_rank(rank: int) -> dict:
    """Each size validated on this rank, with the feature pass run as under FSDP: the ranks agree
    on its number of forwards and one without rows joins with idle ones (a rank that skipped the
    pass would leave the others' gather to time out)."""
    import medsrl.evaluation.response_features as features

    features.is_sharded = lambda policy: True
    return {str(num): _summary(*_run_validation(_SeededEngine, num, **AIME_LIKE)) for num in SIZES}


def _summary(events: list, logged: list[dict]) -> dict:
    return {"metrics": logged[0], "sampled": [e[1] for e in events if e[0] == "generate"],
            "syncs": events.count("sync"), "releases": events.count("release"),
            "forwards": sum(1 for e in events if e[0] == "forward")}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    from gloo_ranks import on_gloo_ranks

    return on_gloo_ranks(_validate_on_rank, tmp_path_factory.mktemp("pass_at_k"), timeout_s=60)


@pytest.mark.slow
def test_every_rank_samples_a_share_and_the_figures_are_one_processes(two_ranks):
    """AIME24's 30 problems were one sampling chunk, so one rank of eight sampled them all. Now
    15 and 15 on 2 ranks, and the metrics (pass@k, maj@n, diversity from the features) equal
    one process's exactly."""
    one = _summary(*_run_validation(_SeededEngine, 30, **AIME_LIKE))
    assert one["sampled"] == [30]
    assert [r["30"]["sampled"] for r in two_ranks] == [[15], [15]]
    assert "val/eigen_ratio" in one["metrics"] and 0 < one["metrics"]["val/accuracy"] < 1
    for r in two_ranks:
        assert r["30"]["metrics"] == one["metrics"]
        assert r["30"]["syncs"] == r["30"]["releases"] == 1
    assert two_ranks[0]["30"]["forwards"] == two_ranks[1]["30"]["forwards"] > 1


@pytest.mark.slow
def test_a_rank_without_problems_joins_every_collective_and_releases(two_ranks):
    """One problem on 2 ranks: rank 1 samples nothing, still syncs, releases and runs as many
    (idle) feature forwards as rank 0; both log one process's figures."""
    one = _summary(*_run_validation(_SeededEngine, 1, **AIME_LIKE))
    assert [r["1"]["sampled"] for r in two_ranks] == [[1], []]
    for r in two_ranks:
        assert r["1"]["metrics"] == one["metrics"]
        assert r["1"]["syncs"] == r["1"]["releases"] == 1
        assert r["1"]["forwards"] == one["forwards"] >= 1
