"""Every benchmark config loads the right problems, and its gold answers grade as correct."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from medsrl.reward.grader import MathGrader, math_verify_equivalent
from run_helpers import ROOT
from shared_paths import SHARED_DIR, require_shared

COUNTS = {
    "math500": 500,
    "aime24": 30,
    "amc23": 40,
    "minerva_math": 272,
    "olympiadbench": 675,
    "gsm8k": 1319,
}


def _benchmarks(names):
    overrides = [
        f"benchmark=[{','.join(names)}]",
        "paths.output_dir=.",
        f"paths.shared_dir={SHARED_DIR}",
    ]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("eval", overrides=overrides)
    return {name: instantiate(src) for name, src in cfg.benchmark.items()}


def test_paper_preset_names_the_five_benchmarks():
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("eval", overrides=["benchmark=paper", "paths.output_dir=."])
    assert list(cfg.benchmark) == ["math500", "aime24", "amc23", "minerva_math", "olympiadbench"]


@pytest.mark.shared
@pytest.mark.parametrize("name", sorted(COUNTS))
def test_benchmark_count_and_golds_grade_correct(name):
    require_shared("data", name)
    examples = _benchmarks([name])[name]
    assert len(examples) == COUNTS[name]
    assert all(e.problem.strip() and e.answer.strip() for e in examples)
    assert len({e.key for e in examples}) >= 0.99 * len(examples)
    responses = [f"So the final answer is $\\boxed{{{e.answer}}}$." for e in examples]
    with MathGrader(timeout_s=10.0, num_workers=1) as grader:
        results = grader.grade_batch(responses, [e.answer for e in examples])
    assert [e.answer for e, r in zip(examples, results, strict=True) if r.score != 1.0] == []


@pytest.mark.shared
@pytest.mark.parametrize("name", ["aime24", "amc23", "minerva_math", "olympiadbench"])
def test_math_verify_itself_parses_every_gold(name):
    """The grader's fast path accepts identical strings; check math-verify's own parse too
    (all 1517 golds of the five paper benchmarks pass, after clean_answer; see docs/EVALUATION.md)."""
    require_shared("data", name)
    examples = _benchmarks([name])[name]
    assert [e.answer for e in examples if not math_verify_equivalent(e.answer, e.answer)] == []
