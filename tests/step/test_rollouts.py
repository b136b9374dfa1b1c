"""Groups before packing and the packed step: rows, reward terms, shaped scores."""

from __future__ import annotations

import pytest
import torch

from medsrl.data.example import Prompt
from medsrl.reward.grader import GradeResult
from medsrl.rollout.base import RolloutBatch
from medsrl.step.rollouts import StepRollouts, split_groups


def _prompt(key):
    return Prompt(key=key, text=key, problem=key, answer="1", source="t")


def _batch():
    return RolloutBatch(
        prompt_index=[0, 0, 1, 1],
        prompt_ids=[[1, 2], [1, 2], [3], [3]],
        response_ids=[[5], [6, 7], [8, 9, 10], [11]],
        response_text=["a", "b", "c", "d"],
        finish_reason=["stop", "stop", "length", "stop"],
    )


def _grades(scores):
    return [GradeResult(float(s), "1" if s else "2", True) for s in scores]


def test_split_then_pack_keeps_rows_in_order():
    groups = split_groups([_prompt("p"), _prompt("q")], _batch(), _grades([1, 0, 0, 0]))
    assert [len(g) for g in groups] == [2, 2]
    assert groups[0].acc.tolist() == [1.0, 0.0] and groups[1].source == ["sampled", "sampled"]
    r = StepRollouts.from_groups(groups, step=3, stage="A", pad_token_id=0, device="cpu")
    assert r.group_ids.tolist() == [0, 0, 1, 1]
    assert r.response_ids == [[5], [6, 7], [8, 9, 10], [11]]
    assert r.keys == ["p", "p", "q", "q"]
    assert r.packed.response_mask.tolist()[2] == [1.0, 1.0, 1.0]
    assert r.terms["correct"].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_reward_terms_and_shaping_sum_to_the_scores():
    groups = split_groups([_prompt("p"), _prompt("q")], _batch(), _grades([1, 0, 0, 0]))
    r = StepRollouts.from_groups(groups, 0, None, 0, "cpu")
    r.add_reward("overlong", torch.tensor([0.0, 0.0, -0.5, 0.0]))
    r.shape_scores("meds", r.scores - torch.tensor([0.0, 0.1, 0.2, 0.0]))
    assert r.reward.tolist() == [1.0, 0.0, -0.5, 0.0]  # shaping leaves the logged reward alone
    assert r.scores.tolist() == pytest.approx([1.0, -0.1, -0.7, 0.0])
    total = sum(r.terms.values())
    torch.testing.assert_close(total, r.scores)
    assert list(r.terms) == ["correct", "overlong", "meds"]


def test_added_rows_are_tagged_with_their_source():
    (group,) = split_groups([_prompt("p")], _batch().select([0, 1]), _grades([1, 0]))
    group.add_rows(_batch().select([2]), _grades([1]), source="replay")
    assert len(group) == 3 and group.source == ["sampled", "sampled", "replay"]
    assert group.rollout.prompt_index == [0, 0, 0]
    with pytest.raises(ValueError, match="1 rows but 2 grades"):
        group.add_rows(_batch().select([3]), _grades([1, 0]), source="replay")
