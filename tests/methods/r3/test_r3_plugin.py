"""The R3 plug-in's hooks on hand-made groups: replay, ranking, reflection, the history it keeps,
its advantages and importance weights, and its place before DAPO's filter."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from medsrl.data.example import Prompt
from medsrl.data.template import PromptTemplate
from medsrl.methods.dynamic_sampling import DynamicSampling
from medsrl.methods.r3.history import StoredResponse
from medsrl.methods.r3.plugin import R3
from medsrl.plugins.base import StepContext
from medsrl.plugins.host import PluginHost
from medsrl.reward.grader import GradeResult
from medsrl.rollout.base import RolloutBatch
from medsrl.step.metrics import PhaseTimer
from medsrl.step.rollouts import Group, StepRollouts
from run_helpers import config_problems

PROMPT_IDS = [5, 6]


def _prompt(key: str) -> Prompt:
    return Prompt(key, f"<{key}>", f"problem {key}", "1", "t")


def _group(key: str, scores: list[float], tokens: list[list[int]] | None = None) -> Group:
    n = len(scores)
    tokens = tokens or [[10 + i, 2] for i in range(n)]
    batch = RolloutBatch([0] * n, [PROMPT_IDS] * n, tokens, [f"r{t[0]}" for t in tokens], ["stop"] * n)
    grades = [GradeResult(s, "1" if s else "7", True) for s in scores]
    return Group(_prompt(key), batch, grades, ["sampled"] * n)


def _stored(step: int, correct: bool, token: int, logprobs=(-1.0, -1.0), reward=None) -> StoredResponse:
    return StoredResponse((token, 2), f"old{token}", float(correct) if reward is None else reward, correct,
                          step, "stop", "1" if correct else "7", True, logprobs)


def _ctx(step: int = 5, num_prompts: int = 1) -> StepContext:
    return StepContext(step, "A", PhaseTimer(), num_prompts)


def _r3(n: int = 4, **kw) -> R3:
    """An R3 plug-in set up as Lightning would: ``n`` responses a prompt, seed 3, the data's template."""
    kw.setdefault("snapshot_every_n_steps", 0)
    kw.setdefault("panels_every_n_steps", 0)
    r3 = R3(**kw)
    trainer = SimpleNamespace(datamodule=SimpleNamespace(render=PromptTemplate(system_prompt=None).render))
    module = SimpleNamespace(tokenizer=None, grader_cfg=SimpleNamespace(reasoning_end=None),
                             rollout_cfg=SimpleNamespace(n=n), seed=3)
    r3.setup(trainer, module, "fit")
    return r3


def test_replay_mixes_in_the_most_recent_opposite_outcome_responses():
    r3 = _r3(replay={"k": 2})
    for step, correct, token in [(1, True, 91), (2, False, 92), (3, True, 93), (3, True, 94), (4, True, 95)]:
        r3.history.add("a", _stored(step, correct, token))
    g = _group("a", [0, 0, 0, 0])
    ctx = _ctx()
    r3.transform_groups([g], ctx)
    # the two most recent correct ones: step 4, then the later of step 3's two
    assert [r[0] for r in g.rollout.response_ids[4:]] == [95, 94]
    assert g.source == ["sampled"] * 4 + ["r3", "r3"]
    assert g.rollout.prompt_ids[4] == PROMPT_IDS and g.acc.tolist() == [0, 0, 0, 0, 1, 1]
    assert g.has_spread and g.trainable
    assert ctx.metrics["r3/replay/rescued_groups"] == 1 and ctx.metrics["r3/replay/rows"] == 2
    # an all-right group gets the one stored wrong response; a mixed group is left alone
    right, mixed = _group("a", [1, 1, 1, 1]), _group("a", [1, 0, 1, 1])
    r3.transform_groups([right, mixed], _ctx())
    assert [r[0] for r in right.rollout.response_ids[4:]] == [92] and len(mixed) == 4


def test_nothing_acts_before_a_prompt_was_seen_or_before_start_step():
    r3 = _r3(start_step=6)
    r3.history.add("a", _stored(1, True, 91))
    g = _group("a", [0, 0, 0, 0])
    r3.transform_groups([g], _ctx(step=5))
    assert len(g) == 4 and g.kept_by is None
    fresh = _group("new", [0, 0, 0, 0])
    r3.transform_groups([fresh], _ctx(step=6))
    assert len(fresh) == 4 and not fresh.trainable


def test_an_all_wrong_group_without_stored_right_answers_is_kept_for_ranking():
    r3 = _r3()
    r3.history.add("a", _stored(1, False, 91))
    g = _group("a", [0, 0, 0, 0])
    r3.transform_groups([g], _ctx())
    assert len(g) == 4 and g.kept_by == "r3" and g.trainable and not g.has_spread
    off = _r3(ranking={"enabled": False})
    off.history.add("a", _stored(1, False, 91))
    g = _group("a", [0, 0, 0, 0])
    off.transform_groups([g], _ctx())
    assert not g.trainable and off.token_stats == ()


def test_groups_of_dapos_extra_rounds_pass_through_r3_first():
    r3 = _r3()
    r3.history.add("b", _stored(1, True, 91))
    extra = {1: [_group("b", [0, 0, 0, 0]), _group("c", [1, 1, 1, 1])]}
    dm = SimpleNamespace(extra_prompts=lambda step, r, k: [f"x{r}"] * k)
    ctx = _ctx(num_prompts=2)
    first = [_group("a", [1, 0, 0, 1]), _group("z", [1, 1, 1, 1])]
    kept = PluginHost([r3, DynamicSampling(max_rounds=3)]).fill_batch(first, lambda prompts, r: extra[r], dm, ctx)
    # round 0 keeps a; round 1's all-wrong b is rescued by replay before the filter and kept
    assert [g.prompt.key for g in kept] == ["a", "b"] and kept[1].source[-1] == "r3"
    assert ctx.metrics["r3/replay/rescued_groups"] == 1
    assert ctx.metrics["dynamic_sampling/extra_rounds"] == 1
    # every sampled group of the step is noted for the history, also those the filter dropped
    assert [k for k, _ in r3._seen] == ["a", "z", "b", "c"]


def test_reflection_prompt_for_a_failing_prompt_only():
    r3 = _r3(reflection={"tau": 0.3, "instruction": "Fix it."})
    for token, correct in [(91, False), (92, False), (93, True), (94, False)]:
        r3.history.add("a", _stored(1, correct, token))  # mean 0.25 < 0.3
    r3.history.add("b", _stored(1, True, 95))  # mean 1
    r3.history.add("c", _stored(1, True, 96))
    r3.history.add("c", _stored(1, False, 97))  # mean 0.5
    ctx = _ctx()
    extra = r3.add_prompts([_prompt("a"), _prompt("b"), _prompt("c"), _prompt("new")], ctx)
    assert len(extra) == 1 and ctx.metrics["r3/reflection/prompts"] == 1
    p = extra[0]
    assert p.key == "a:reflect" and p.answer == "1" and p.source == "r3_reflection"
    wrong = p.problem.split("A previous attempt:\n\n")[1].split("\n\n")[0]
    assert wrong in {"old91", "old92", "old94"} and p.problem.endswith("Fix it.")
    assert p.text == f"<|im_start|>user\n{p.problem}<|im_end|>\n<|im_start|>assistant\n"
    # the pick is fixed by (seed, step, key): the same on every rank and after a resume
    assert r3.add_prompts([_prompt("a")], _ctx())[0].problem == p.problem
    # tau defaults to 1/n: 0.25 is not below 1/4, but below 1/2
    for n, prompts in [(4, 0), (2, 1)]:
        default = _r3(n=n)
        default.history = r3.history
        assert len(default.add_prompts([_prompt("a")], _ctx())) == prompts
    assert _r3(reflection={"tau": 0.3, "max_prompts": 0}).add_prompts([_prompt("a")], _ctx()) == []


def _packed(groups: list[Group], step: int = 5) -> StepRollouts:
    return StepRollouts.from_groups(groups, step, "A", 0, "cpu")


def test_history_gets_every_sampled_response_with_log_probs_where_scored():
    r3 = _r3()
    r3.history.add("a", _stored(1, True, 91))
    kept, dropped = _group("a", [0, 0, 0, 0]), _group("z", [1, 1, 1, 1])
    ctx = _ctx()
    r3.transform_groups([kept, dropped], ctx)  # kept is rescued; say a later filter drops z
    rollouts = _packed([kept])
    rollouts.old_logp = torch.arange(10, dtype=torch.float32).reshape(5, 2) / -10
    rollouts.add_reward("overlong", torch.tensor([-0.5, 0, 0, 0, 0]))
    adds = r3.step_additions(rollouts, ctx)
    assert [k for k, _ in adds] == ["a"] * 4 + ["z"] * 4  # the replayed row is not stored again
    first, z = adds[0][1], adds[4][1]
    assert first.logprobs == pytest.approx((0.0, -0.1)) and first.reward == -0.5 and first.step == 5
    assert adds[1][1].logprobs == pytest.approx((-0.2, -0.3))
    assert z.logprobs is None and z.reward == 1.0 and z.correct and z.extracted == "1"
    r3.commit([adds, [("q", _stored(5, False, 99))]], ctx)  # another rank's, after this one's
    assert r3.history.keys() == ["a", "z", "q"] and r3.history.visits("a") == 2
    assert ctx.metrics["r3/history/responses"] == 10


def test_replayed_groups_get_their_own_normalisation_and_capped_importance_weights():
    r3 = _r3(replay={"k": 1, "alpha": 2.0, "lam": 0.5, "importance_cap": 1.5})
    r3.history.add("a", _stored(1, True, 91, logprobs=(-1.5, -0.5)))
    r3.history.add("b", _stored(1, False, 92, logprobs=None))
    ga, gb, gc = _group("a", [0, 0, 0]), _group("b", [1, 1, 1]), _group("c", [1, 0, 0])
    ctx = _ctx()
    r3.transform_groups([ga, gb, gc], ctx)
    rollouts = _packed([ga, gb, gc])
    rollouts.old_logp = torch.full((len(rollouts), 2), -1.0)
    grpo = torch.full((len(rollouts),), 7.0)  # what the estimator gave: replaced in mixed groups
    adv = r3.shape_advantages(rollouts, grpo, ctx)
    # group a: [0, 0, 0, 1], mean 0.25, std 0.5 -> / (2 * 0.5 + 0.5)
    assert adv[:4].tolist() == pytest.approx([-0.25 / 1.5] * 3 + [0.75 / 1.5])
    assert adv[4:8].tolist() == pytest.approx([0.25 / 1.5] * 3 + [-0.75 / 1.5])
    assert adv[8:].tolist() == [7.0] * 3  # not replayed: untouched
    w = rollouts.loss_weights
    # a's replayed row: exp(-1 - (-1.5)) = 1.65 capped at 1.5, exp(-1 - (-0.5)) = 0.61
    assert w[3].tolist() == pytest.approx([1.5, math.exp(-0.5)])
    assert w[7].tolist() == [1.0, 1.0]  # b's stored row has no log-probs: weight 1, counted
    assert torch.all(w[:3] == 1) and torch.all(w[8:] == 1)
    assert ctx.metrics["r3/replay/rows_without_logprobs"] == 1
    # token-level advantages ([B, R]) are replaced row-wise too
    tok = r3.shape_advantages(_packed_again(r3, ctx), torch.full((11, 2), 7.0), ctx)
    assert tok[0].tolist() == pytest.approx([-0.25 / 1.5] * 2) and tok[10].tolist() == [7.0, 7.0]


def _packed_again(r3: R3, ctx) -> StepRollouts:
    r3._step = -1  # a new step
    ga, gb, gc = _group("a", [0, 0, 0]), _group("b", [1, 1, 1]), _group("c", [1, 0, 0])
    r3.transform_groups([ga, gb, gc], ctx)
    rollouts = _packed([ga, gb, gc])
    rollouts.old_logp = torch.full((len(rollouts), 2), -1.0)
    return rollouts


def test_ranking_rewards_all_wrong_groups_from_the_scoring_entropies():
    r3 = _r3(ranking={"p": 0.5, "r_max": 0.6})
    r3.history.add("a", _stored(1, False, 91))
    r3.history.add("c", _stored(1, False, 91))
    ga = _group("a", [0, 0, 0], tokens=[[1, 2], [3, 4], [5, 6]])
    gc = _group("c", [1, 0, 0])
    rollouts = _packed([ga, gc])
    # p = 0.5 of 2 tokens -> E_peak = the max; row 0: (2.0, 1.1), row 1: (1.0, 0.6), row 2: (0.5, 0.5)
    rollouts.token_stats["entropy"] = torch.tensor(
        [[0.2, 2.0], [1.0, 0.2], [0.5, 0.5], [9.0, 9.0], [9.0, 9.0], [9.0, 9.0]])
    ctx = _ctx()
    r3.shape_rewards(rollouts, ctx)
    # nobody beats anybody (the higher peak always has the higher global entropy): order by
    # lower global entropy, rows 2, 1, 0 -> 0.6, 0.3, 0
    assert rollouts.scores[:3].tolist() == pytest.approx([0.0, 0.3, 0.6])
    assert rollouts.reward[:3].tolist() == [0, 0, 0]  # shaping, not the graded reward
    assert rollouts.terms["serr"].tolist() == pytest.approx([0.0, 0.3, 0.6, 0, 0, 0])
    assert rollouts.scores[3:].tolist() == [1, 0, 0]  # a mixed group is not ranked
    assert ctx.metrics["r3/ranking/groups"] == 1 and ctx.metrics["r3/ranking/rows"] == 3


def test_state_round_trip_and_bad_settings():
    r3 = _r3()
    r3.history.add("a", _stored(1, True, 91))
    back = _r3()
    back.load_state_dict(r3.state_dict())
    assert back.digest() == r3.digest() and back.history.responses("a") == r3.history.responses("a")
    r3 = {"_target_": "medsrl.methods.r3.plugin.R3", "replay": {"kk": 1, "importance_cap": 0}, "ranking": {"p": 1.5}}
    found = config_problems({"algorithm": {"plugins": {"r3": r3}}})
    assert len(found) == 3, found
    assert "algorithm.plugins.r3.replay.importance_cap must be a positive number or null, got 0" in found
    assert "algorithm.plugins.r3.ranking.p must be a number in (0, 1], got 1.5" in found
    assert any(f.startswith("algorithm.plugins.r3.replay.kk is not a setting of R3.replay (known: ") for f in found)
    with pytest.raises(ValueError, match="importance_cap"):  # the constructor reads the same schema
        R3(replay={"importance_cap": 0})


def test_reflection_groups_are_counted_shown_and_kept_out_of_the_history():
    r3 = _r3(panels_every_n_steps=10)
    for token in (91, 92):
        r3.history.add("a", _stored(1, False, token))
    reflect = r3.add_prompts([_prompt("a")], _ctx(step=5))[0]
    g = _group("a", [0, 1, 0, 0])
    g.prompt = reflect
    ctx = _ctx(step=5)
    shown = []
    ctx.text = lambda plugin, tag, text: shown.append((tag, text))
    r3.transform_groups([g], ctx)
    assert ctx.metrics["r3/reflection/groups"] == 1 and ctx.metrics["r3/reflection/acc"] == 0.25
    assert len(shown) == 1 and shown[0][0] == "reflection"
    assert "A previous attempt" in shown[0][1] and "r11" in shown[0][1]  # the right response
    assert r3._seen == []  # reflection responses do not enter the history
    r3.transform_groups([g], _ctx(step=9))
    later = _ctx(step=15)
    later.text = lambda plugin, tag, text: shown.append((tag, text))
    r3.transform_groups([g], later)
    assert len(shown) == 2  # at most one panel per 10 steps


def test_groups_dealt_over_ranks_reach_the_history_scored_and_in_one_process_order():
    """Balanced ranks (step/balance.py) moved b from rank 0, which sampled it, to rank 1, and c
    the other way: the rank that scored a group tells it, with its log-probs, and every rank
    commits the step's responses in the step's order, as one process does."""
    import pickle

    def sampled(rank_keys: str, first: int) -> list[Group]:
        made = [_group(k, [1, 0], [[20 + 2 * i, 2], [21 + 2 * i, 2]]) for i, k in enumerate(rank_keys, start=first)]
        for j, g in enumerate(made):
            g.origin, g.index = (0, first + j), first + j  # as balance_groups sets them
        return made

    def scored(groups: list[Group]) -> StepRollouts:
        r = _packed(groups)
        r.old_logp = -torch.arange(2 * len(r), dtype=torch.float32).reshape(len(r), 2) / 10 - sum(
            g.index for g in groups)  # a row's log-probs tell which rank's batch scored it
        return r

    one = _r3()
    everything = sampled("abcd", 0)
    one.transform_groups(everything, _ctx())
    one.commit([one.step_additions(scored(everything), _ctx())], _ctx())
    ranks = [_r3(), _r3()]
    seen = [sampled("ab", 0), sampled("cd", 2)]
    for r3, groups in zip(ranks, seen, strict=True):
        r3.transform_groups(groups, _ctx())
    copy = lambda g: pickle.loads(pickle.dumps(g))  # noqa: E731  (the exchange's all-gather)
    held = [[seen[0][0], copy(seen[1][0])], [copy(seen[0][1]), seen[1][1]]]  # a, c | b, d
    adds = [r3.step_additions(scored(h), _ctx()) for r3, h in zip(ranks, held, strict=True)]
    # each rank tells the groups it holds (rank 1: its own d, then b from rank 0), with their places
    assert [k for k, _ in adds[0]] == ["a", "a", "c", "c"] and [k for k, _ in adds[1]] == ["d", "d", "b", "b"]
    assert all(resp.logprobs is not None for part in adds for _, resp in part)
    for r3 in ranks:
        r3.commit(adds, _ctx())
        assert r3.history.keys() == one.history.keys() == ["a", "b", "c", "d"]
    assert [r.token_ids for k in "abcd" for r in ranks[0].history.responses(k)] == \
        [r.token_ids for k in "abcd" for r in one.history.responses(k)]
    # c's log-probs are those rank 0 scored (its batch a, c: rows 2-3, offset 0 + 2)
    assert ranks[1].history.responses("c")[0].logprobs == pytest.approx((-2.4, -2.5))
