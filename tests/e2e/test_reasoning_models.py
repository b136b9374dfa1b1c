"""R3's own setting end to end: ``experiment=r1-distill-1.5b_r3`` (and its DAPO baseline) as a
user launches it, on a random model of R1-Distill-Qwen-1.5B's architecture at 2 layers with the
shared Qwen tokenizer carrying a think-style chat template, on the DeepScaleR files.

Generation is served from a script of responses to the real prompts (a random model writes no
``</think>``), so what is checked is everything after it, for real: the prompt the tokenizer's
template renders, think-tag grading by the real grader (a box inside the reasoning is not the
answer; an unclosed reasoning scores 0 and is counted), R3's ranking over the graded span and
its length bonus, and an update that moves the weights.
"""

from __future__ import annotations

import pytest
from test_gpu_experiments import NARROW, _random_policy, changed_fraction, matrices

import medsrl.train as train_py
from medsrl.data.loaders import load_math_file
from medsrl.models.loading import load_tokenizer
from medsrl.rollout.base import RolloutBatch
from medsrl.rollout.hf import HFRolloutEngine
from reasoning_templates import R1_STYLE, tokenizer_dir_with_template
from run_helpers import compose_train, read_metrics
from shared_paths import require_shared

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("cpu_bf16_gemms")]

WRONG = "-7777"
SMALL = [
    "trainer.accelerator=cpu", "trainer.devices=1", "trainer.max_steps=2",
    "rollout.backend=hf", "rollout.logprobs=false", "algorithm.engine_is_cap=null",
    "data.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=64", "rollout.max_batch_size=16",
    "algorithm.mini_batch_prompts=2", "algorithm.micro_batch_size=8", "optim.scheduler.warmup_steps=0",
    "grader.num_workers=1", "callbacks.pass_at_k.every_n_steps=0", "callbacks.pass_at_k.at_start=false",
    "callbacks.sample_logger.every_n_steps=0", "logger=csv", "export_policy=false",
]


def scripted_responses(gold: str, all_wrong: bool) -> list[tuple[str, bool]]:
    """Four responses (text, closed): right after the reasoning (or wrong in an all-wrong group),
    right only inside the reasoning, never closed, closed without the right box."""
    first = f"<think>\nTry \\boxed{{{WRONG}}}.\n</think>\n\nThe answer is \\boxed{{{WRONG if all_wrong else gold}}}."
    return [
        (first, True),
        (f"<think>\nIt is \\boxed{{{gold}}}.\n</think>\n\nSo \\boxed{{{WRONG}}}.", True),
        (f"<think>\nIt is \\boxed{{{gold}}} and then", False),
        (f"<think>\nHm.</think>\\boxed{{{WRONG}}}", True),
    ]


def scripted_engine(tok, golds: dict[str, str], seen: list[str], lengths: list[list[int]]):
    """``HFRolloutEngine.generate`` replaced by the script: prompt ``i`` of a call gets the mixed
    responses when ``i`` is even, all-wrong ones when odd."""
    def generate(self, prompts, params):
        batch = RolloutBatch([], [], [], [], [])
        step_lengths = []
        for i, text in enumerate(prompts):
            seen.append(text)
            gold = next(g for problem, g in golds.items() if problem in text)
            for response, closed in scripted_responses(gold, all_wrong=i % 2 == 1)[: params.n]:
                ids = tok.encode(response, add_special_tokens=False) + ([tok.eos_token_id] if closed else [])
                batch.prompt_index.append(i)
                batch.prompt_ids.append(tok.encode(text, add_special_tokens=False))
                batch.response_ids.append(ids)
                batch.response_text.append(tok.decode(ids, skip_special_tokens=True))
                batch.finish_reason.append("stop" if closed else "length")
                step_lengths.append(len(ids))
        lengths.append(step_lengths)
        return batch
    return generate


def run_scripted(tmp_path, monkeypatch, experiment: str, extra: list[str]):
    tok = load_tokenizer(str(tokenizer_dir_with_template(
        require_shared("tokenizers", "qwen2.5-math"), tmp_path / "tokenizer", R1_STYLE)))
    cfg = compose_train(tmp_path, [f"experiment={experiment}", *SMALL, *extra], debug=None)
    golds = {}
    for stage in cfg.data.stages:
        for ds in stage.datasets:
            golds.update({e.problem: str(e.answer) for e in load_math_file(ds.source.path)})
    policy = _random_policy(cfg, NARROW)
    before = {k: v.detach().float().clone() for k, v in policy.named_parameters()}
    seen, lengths = [], []
    monkeypatch.setattr(train_py, "build_policy", lambda *a, **k: (policy, tok))
    monkeypatch.setattr(HFRolloutEngine, "generate", scripted_engine(tok, golds, seen, lengths))
    summary = train_py.train(cfg)
    assert summary["steps"] == 2
    # fp32 master weights under bf16 compute at lr 1e-6: every matrix weight moves (as the other
    # GPU experiments, tests/e2e/test_gpu_experiments.py)
    assert cfg.optim.optimizer.lr == 1e-6 and cfg.model.dtype == "float32" and cfg.trainer.precision == "bf16-mixed"
    after = {k: v.detach().float() for k, v in policy.named_parameters()}
    moved = changed_fraction(before, after, matrices(cfg, before))
    return cfg, read_metrics(tmp_path), seen, lengths, moved


@pytest.mark.shared
def test_r1_distill_r3_two_steps_grade_after_think(tmp_path, monkeypatch):
    require_shared("data", "deepscaler_train_aime", "aime.json")
    cfg, metrics, seen, lengths, moved = run_scripted(
        tmp_path, monkeypatch, "r1-distill-1.5b_r3", ["algorithm.plugins.r3.min_visits=0"])
    assert cfg.grader.reasoning_end == "</think>" and cfg.data.template.kind == "chat"
    assert cfg.model.architecture == "qwen2" and cfg.algorithm.plugins.r3.length_bonus == 32768
    # the tokenizer's own (think-style) template rendered every prompt, instruction in the user turn
    assert seen and all(s.startswith("<｜User｜>") and s.endswith("<｜Assistant｜><think>\n") for s in seen)
    assert all("Let's think step by step and output the final answer within \\boxed{}." in s for s in seen)
    for step in (0, 1):
        m = metrics[step]
        # 2 mixed groups (1 right of 4) and 2 all-wrong: a right box inside <think> is not counted
        assert m["train/acc"] == pytest.approx(2 / 16)
        assert m["train/grader/unclosed_reasoning_rate"] == pytest.approx(4 / 16)
        # the paper's length bonus on the right answers: reward = 1 + (1 - l / 32768)
        right = [n for j, n in enumerate(lengths[step]) if j % 8 == 0]
        assert m["train/reward"] == pytest.approx(sum(2 - n / 32768 for n in right) / 16, rel=1e-5)
        assert m["train/r3/ranking/groups"] == 2  # the all-wrong groups, ranked over the answer span
    assert moved > 0.99, moved


@pytest.mark.shared
def test_r1_distill_dapo_baseline_two_steps(tmp_path, monkeypatch):
    require_shared("data", "deepscaler_train_aime", "aime.json")
    cfg, metrics, seen, lengths, moved = run_scripted(
        tmp_path, monkeypatch, "r1-distill-1.5b_dapo",
        ["algorithm.plugins.overlong.buffer_length=16", "algorithm.plugins.dynamic_sampling.max_rounds=2"])
    assert cfg.algorithm.name == "dapo" and cfg.grader.reasoning_end == "</think>"
    for step in (0, 1):
        # DAPO keeps the mixed groups only: 1 right of 4 each
        assert metrics[step]["train/acc"] == pytest.approx(1 / 4)
    assert moved > 0.99, moved
