"""docs/PLUGINS.md's worked example, run as written: its module and YAML file are taken from the
page, checked on a hand-made step, then trained for two steps through the real Hydra config."""

from __future__ import annotations

import math
import re
import sys
from types import SimpleNamespace

import pytest
import torch

from medsrl.plugins.base import StepContext
from medsrl.step.metrics import PhaseTimer
from medsrl.train import train
from run_helpers import MICRO_WARM_START, ROOT, compose_train, read_metrics

PAGE = (ROOT / "docs" / "PLUGINS.md").read_text()


def _block(lang: str, first_line: str) -> str:
    for body in re.findall(rf"```{lang}\n(.*?)```", PAGE, flags=re.S):
        if body.startswith(first_line) or first_line in body.splitlines()[0]:
            return body
    raise AssertionError(f"no ```{lang} block starting with {first_line!r} in docs/PLUGINS.md")


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """The page's module and config written where Python and Hydra find them."""
    root = tmp_path_factory.mktemp("example")
    (root / "answer_repeat.py").write_text(_block("python", "# answer_repeat.py"))
    (root / "configs" / "plugins").mkdir(parents=True)
    (root / "configs" / "plugins" / "answer_repeat.yaml").write_text(_block("yaml", "_target_: answer_repeat"))
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    sys.modules.pop("answer_repeat", None)


def test_the_rule_on_a_hand_made_step(example):
    from answer_repeat import RepeatedAnswerPenalty

    plugin = RepeatedAnswerPenalty(coef=0.1)
    ctx = StepContext(0, None, PhaseTimer(), 1)

    def step(answers):
        grades = [SimpleNamespace(score=1.0 if a == "4" else 0.0, extracted=a) for a in answers]
        scores = torch.tensor([g.score for g in grades])
        r = SimpleNamespace(keys=["k"] * len(answers), grades=grades, scores=scores, terms={})
        r.shape_scores = lambda name, new: (setattr(r, "scores", new), r.terms.setdefault(name, new - scores))
        plugin.shape_rewards(r, ctx)
        plugin.commit([plugin.step_additions(r, ctx)], ctx)
        return r.scores.tolist()

    assert step(["5", "5", "4", None]) == [0.0, 0.0, 1.0, 0.0]  # nothing seen yet
    # "5" was given wrong twice: 0.1 * ln 3; "6" is new; the right answer is untouched
    assert step(["5", "6", "4"]) == pytest.approx([-0.1 * math.log(3), 0.0, 1.0])
    assert plugin.state_dict() == {"seen": {"k|5": 3, "k|6": 1}}


@pytest.mark.slow
def test_trains_through_the_config_without_touching_the_module(example, tmp_path, micro_cache):
    cfg = compose_train(tmp_path, MICRO_WARM_START + [
        f"hydra.searchpath=[file://{example / 'configs'}]",
        "algorithm=dapo", "algorithm.plugins.dynamic_sampling=null",
        "+plugins@algorithm.plugins.answer_repeat=answer_repeat",
        "algorithm.plugins.answer_repeat.coef=0.5",
        "trainer.max_steps=2", "callbacks.pass_at_k.every_n_steps=0", "callbacks.pass_at_k.at_start=false",
    ], cache_dir=micro_cache)
    assert [k for k, v in cfg.algorithm.plugins.items() if v is not None] == ["overlong", "answer_repeat"]
    train(cfg)
    m = read_metrics(tmp_path)
    assert m[1]["train/answer_repeat/answers_known"] > 0  # wrong answers of step 0 remembered
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["callbacks"]["plugin:answer_repeat"]["seen"]
