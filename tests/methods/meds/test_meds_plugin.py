"""The MEDS plug-in over hand-built steps: sizes, penalties, modes, checkpoints, stage resets."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import pytest
import torch

from medsrl.data.example import Prompt
from medsrl.methods.meds.plugin import Meds
from medsrl.plugins.base import StepContext
from medsrl.step.metrics import PhaseTimer
from medsrl.step.rollouts import StepRollouts


def _prompt(key: str) -> Prompt:
    return Prompt(key=key, text=f"<{key}>", problem=f"problem {key}", answer="1", source="t")


class HandMadeStep(NamedTuple):
    rollouts: StepRollouts
    features: torch.Tensor  # [B, D], one per response: what the scoring forward would have read


class HandMadeReader:
    """Stands in for the plug-in's ``AnswerFeatureReader`` after the scoring forward: ``finish``
    gives the step's features, every response with one."""

    def __init__(self, features: torch.Tensor) -> None:
        self.features = features

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.features, torch.arange(len(self.features))


def _step(step: int, groups: list[tuple[str, list[tuple[np.ndarray, bool]]]], stage: str = "A",
          answers: list[str] | None = None) -> HandMadeStep:
    """One step: per group (prompt key, [(feature, correct), ...]); every response has a feature
    and the extracted answer ``answers[i]`` (default "1")."""
    prompts, gids, feats, acc = [], [], [], []
    for g, (key, responses) in enumerate(groups):
        prompts.append(_prompt(key))
        for f, ok in responses:
            gids.append(g)
            feats.append(f)
            acc.append(1.0 if ok else 0.0)
    answers = answers or ["1"] * len(acc)
    acc_t = torch.tensor(acc)
    r = StepRollouts(
        step=step, stage=stage, prompts=prompts, group_ids=torch.tensor(gids),
        response_ids=[[0]] * len(acc), response_text=["r"] * len(acc), finish_reason=["stop"] * len(acc),
        grades=[SimpleNamespace(extracted=a) for a in answers], source=["sampled"] * len(acc), packed=None,
        acc=acc_t, reward=acc_t.clone(), scores=acc_t.clone(),
    )
    return HandMadeStep(r, torch.tensor(np.stack(feats), dtype=torch.float32))


def _plugin(tmp_path, refit="sync", reset_on_stage_change=False, **settings):
    """A MEDS plug-in fed hand-made features (every response has one) instead of a forward
    (``_run`` gives it a :class:`HandMadeReader`)."""
    settings = {"panels_every_n_steps": 0, "snapshot_every_n_steps": 0, "mixed_groups_only": False, **settings}
    memory = {"refit": refit, "reset_on_stage_change": reset_on_stage_change}
    plugin = Meds(memory=memory, snapshot_dir=str(tmp_path), **settings)
    plugin.store.open()
    return plugin


def _run(plugin: Meds, step: HandMadeStep, ctx: StepContext | None = None) -> torch.Tensor:
    """One step through the plug-in's hooks, in the module's order, as one rank; the scoring
    forward's features come from the plug-in's reader, here a hand-made one."""
    rollouts = step.rollouts
    ctx = ctx or StepContext(rollouts.step, rollouts.stage, PhaseTimer(), len(rollouts.prompts),
                             run_dir=plugin.snapshot_dir)  # as rank 0
    plugin.enter_stage(rollouts.stage)  # what before_scoring does before the reader begins
    plugin.reader = HandMadeReader(step.features)
    plugin.after_scoring(rollouts, ctx)
    plugin.shape_rewards(rollouts, ctx)
    plugin.commit([plugin.step_additions(rollouts, ctx)], ctx)
    return rollouts.scores


def _ctx(rollouts: StepRollouts) -> StepContext:
    return StepContext(rollouts.step, rollouts.stage, PhaseTimer(), len(rollouts.prompts))


def _blob(center: list[float], n: int, rng, scale: float = 0.01) -> list[np.ndarray]:
    c = np.asarray(center, dtype=np.float32)
    return [c + scale * rng.standard_normal(c.shape).astype(np.float32) for _ in range(n)]


def test_first_visit_only_fills_memory_then_sizes_give_the_penalty(tmp_path):
    rng = np.random.default_rng(0)
    mem = _plugin(tmp_path)
    e1, e2 = [1, 0, 0, 0], [0, 1, 0, 0]
    step0 = _step(0, [("k", [(f, False) for f in _blob(e1, 4, rng) + _blob(e2, 2, rng)])])
    scores0 = _run(mem, step0)
    assert torch.equal(scores0, torch.zeros(6))  # empty memory: size 0, no penalty
    assert mem.store.memory.num_entries() == 6
    labels = mem.store.labels_for("k", False).labels
    assert sorted(np.bincount(labels[labels >= 0]).tolist()) == [2, 4]  # two clusters

    queries = [(_blob(e1, 1, rng)[0], False), (_blob(e2, 1, rng)[0], False), (_blob(e1, 1, rng)[0], True)]
    step1 = _step(1, [("k", queries)])
    scores1 = _run(mem, step1)
    torch.testing.assert_close(step1.rollouts.terms["meds"], scores1 - step1.rollouts.reward)  # GDPO's "meds" term
    # near the 4-blob: 0.1 * ln(5); near the 2-blob: 0.1 * ln(3); the right answer: untouched
    assert scores1[0].item() == pytest.approx(-0.1 * math.log(5), abs=1e-6)
    assert scores1[1].item() == pytest.approx(-0.1 * math.log(3), abs=1e-6)
    assert scores1[2].item() == 1.0
    assert mem.store.memory.num_entries() == 9  # 8 wrong + 1 right, stored apart


def test_penalty_cap_and_noise_policy(tmp_path):
    rng = np.random.default_rng(1)
    mem = _plugin(tmp_path, alpha=1.0, beta=0.5)
    _run(mem, _step(0, [("k", [(f, False) for f in _blob([1, 0, 0], 4, rng)])]))
    s = _run(mem, _step(1, [("k", [(_blob([1, 0, 0], 1, rng)[0], False)])]))
    assert s[0].item() == pytest.approx(-0.5)  # 1.0 * ln(5) = 1.61, capped at beta = 0.5

    spread = [np.eye(6, dtype=np.float32)[i] for i in range(6)]  # orthogonal: all noise
    for noise_is_cluster, expected in [(True, -0.1 * math.log(7)), (False, 0.0)]:
        mem = _plugin(tmp_path / str(noise_is_cluster), clustering={"noise_is_cluster": noise_is_cluster})
        _run(mem, _step(0, [("n", [(f, False) for f in spread])]))
        s = _run(mem, _step(1, [("n", [(np.ones(6, np.float32), False)])]))
        assert s[0].item() == pytest.approx(expected, abs=1e-6)


def test_single_mode_counts_the_whole_history(tmp_path):
    rng = np.random.default_rng(2)
    mem = _plugin(tmp_path, clustering={"mode": "single"})
    _run(mem, _step(0, [("k", [(f, False) for f in _blob([1, 0], 3, rng) + _blob([0, 1], 2, rng)])]))
    s = _run(mem, _step(1, [("k", [(np.array([1, 0], np.float32), False)])]))
    assert s[0].item() == pytest.approx(-0.1 * math.log(6), abs=1e-6)


def test_right_target_divides_by_one_plus_penalty(tmp_path):
    rng = np.random.default_rng(3)
    mem = _plugin(tmp_path, target="right")
    _run(mem, _step(0, [("k", [(f, True) for f in _blob([1, 0, 0], 4, rng)])]))
    s = _run(mem, _step(1, [("k", [(_blob([1, 0, 0], 1, rng)[0], True), (np.ones(3, np.float32), False)])]))
    assert s[0].item() == pytest.approx(1.0 / (1.0 + 0.1 * math.log(5)), abs=1e-6)
    assert s[1].item() == 0.0  # wrong ones are not targeted


def _random_steps(seed: int, steps: int) -> list[list[tuple[str, list[tuple[np.ndarray, bool]]]]]:
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((3, 8)).astype(np.float32)
    out = []
    for _ in range(steps):
        groups = []
        for key in ["a", "b", "c"]:
            resp = [(centers[rng.integers(3)] + 0.05 * rng.standard_normal(8).astype(np.float32),
                     bool(rng.random() < 0.3)) for _ in range(6)]
            groups.append((key, resp))
        out.append(groups)
    return out


def test_background_refits_give_the_same_penalties_as_sync(tmp_path):
    steps = _random_steps(4, 5)
    results = {}
    for mode in ["sync", "background"]:
        mem = _plugin(tmp_path / mode, refit=mode)
        results[mode] = [_run(mem, _step(i, g)).clone() for i, g in enumerate(steps)]
        mem.teardown(None, None, "fit")
    for a, b in zip(results["sync"], results["background"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any((s < 0).any() for s in results["sync"])  # shaping did act


def test_checkpoint_round_trip_restores_memory_and_next_penalties(tmp_path):
    steps = _random_steps(5, 4)
    mem = _plugin(tmp_path / "a", refit="background")
    for i, g in enumerate(steps[:3]):
        _run(mem, _step(i, g))
    path = tmp_path / "state.pt"
    torch.save(mem.state_dict(), path)  # what Lightning puts in the checkpoint
    expected = _run(mem, _step(3, steps[3])).clone()
    mem.teardown(None, None, "fit")

    mem2 = _plugin(tmp_path / "b", refit="background")
    mem2.load_state_dict(torch.load(path))
    saved = torch.load(path)["memory"]["entries"]  # loads with weights_only=True
    assert len(saved) == mem2.store.memory.num_keys() == 6
    for e in saved:  # the memory came back exactly
        got = mem2.store.memory.get(e["key"], e["correct"])
        np.testing.assert_array_equal(got.features, e["features"].numpy())
        np.testing.assert_array_equal(got.steps, e["steps"].numpy())
        np.testing.assert_array_equal(got.labels, e["labels"].numpy())
        assert got.fitted_upto == e["fitted_upto"]
    got = _run(mem2, _step(3, steps[3]))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    mem2.teardown(None, None, "fit")


def test_reset_on_stage_change_and_atomic_snapshot(tmp_path):
    rng = np.random.default_rng(6)
    mem = _plugin(tmp_path, reset_on_stage_change=True, snapshot_every_n_steps=1)
    _run(mem, _step(0, [("k", [(f, False) for f in _blob([1, 0], 3, rng)])], stage="A"))
    snap = np.load(tmp_path / "memory" / "memory.npz")
    assert len(snap.files) > 0
    assert mem.store.memory.num_entries() == 3
    s = _run(mem, _step(1, [("k", [(np.array([1, 0], np.float32), False)])], stage="B"))
    assert s[0].item() == 0.0  # memory was reset at the stage change: an empty store again
    assert mem.store.memory.num_entries() == 1


def test_mixed_groups_only_skips_groups_whose_answers_are_all_alike(tmp_path):
    """The reference never sees all-right / all-wrong groups (DAPO drops them); without dynamic
    sampling that is mixed_groups_only=true: such groups are neither shaped nor remembered."""
    rng = np.random.default_rng(7)
    for mixed_only, entries in [(True, 2), (False, 5)]:
        mem = _plugin(tmp_path / str(mixed_only), mixed_groups_only=mixed_only)
        mixed = ("m", [(_blob([1, 0], 1, rng)[0], False), (_blob([0, 1], 1, rng)[0], True)])
        all_wrong = ("w", [(f, False) for f in _blob([1, 0], 3, rng)])
        _run(mem, _step(0, [mixed, all_wrong]))
        assert mem.store.memory.num_entries() == entries


def test_state_key_names_the_plugin():
    plugin = Meds()
    plugin.name = "meds_a"
    assert plugin.state_key == "plugin:meds_a"


def test_answer_mode_sizes_a_response_by_the_earlier_count_of_its_answer(tmp_path):
    """The answer-keyed memory (study v3's D1 bound): the answer given 4 times before costs
    ln(5), the one given once ln(2), a new one nothing, whatever the features say."""
    rng = np.random.default_rng(8)
    mem = _plugin(tmp_path, clustering={"mode": "answer"})
    first = [(f, False) for f in _blob([1, 0], 5, rng)] + [(np.array([0, 1], np.float32), True)]
    _run(mem, _step(0, [("k", first)], answers=["14", "14", "14", "14", "9", "11"]))
    assert mem.answer_counts == {"k": {"14": 4, "9": 1}}  # wrong answers only
    queries = [(f, False) for f in _blob([1, 0], 3, rng)]
    s = _run(mem, _step(1, [("k", queries)], answers=["9", "14", "23"]))
    expected = [-0.1 * math.log(2), -0.1 * math.log(5), 0.0]
    torch.testing.assert_close(s, torch.tensor(expected), atol=1e-6, rtol=0)
    assert mem.answer_counts["k"] == {"14": 5, "9": 2, "23": 1}


def test_answer_counts_survive_a_checkpoint_and_a_stage_reset(tmp_path):
    mem = _plugin(tmp_path, clustering={"mode": "answer"}, reset_on_stage_change=True)
    _run(mem, _step(0, [("k", [(np.array([1.0, 0.0], np.float32), False)] * 2)], answers=["3", "3"]))
    state = torch.load(_saved(mem.state_dict(), tmp_path), weights_only=True)
    mem2 = _plugin(tmp_path / "b", clustering={"mode": "answer"}, reset_on_stage_change=True)
    mem2.load_state_dict(state)
    assert mem2.answer_counts == {"k": {"3": 2}} and mem2.digest() == mem.digest()
    _run(mem2, _step(1, [("k", [(np.array([1.0, 0.0], np.float32), False)])], stage="B", answers=["5"]))
    assert mem2.answer_counts == {"k": {"5": 1}}


def _saved(state, tmp_path):
    path = tmp_path / "state.pt"
    torch.save(state, path)
    return path


def test_gate_figures_are_logged_on_a_hand_made_step(tmp_path):
    """Store: answer "14" x3 in one tight blob, "9" x2 in another. The next visit's wrong
    responses: "14" twice (size 3), "9" once (size 2), and one right one."""
    rng = np.random.default_rng(9)
    mem = _plugin(tmp_path, clustering={"min_cluster_size": 2})
    e1, e2 = [1, 0, 0], [0, 1, 0]
    _run(mem, _step(0, [("k", [(f, False) for f in _blob(e1, 3, rng) + _blob(e2, 2, rng)])],
                    answers=["14", "14", "14", "9", "9"]))
    step = _step(1, [("k", [(_blob(e1, 1, rng)[0], False), (_blob(e1, 1, rng)[0], False),
                            (_blob(e2, 1, rng)[0], False), (np.array([0, 0, 1], np.float32), True)])],
                 answers=["14", "14", "9", "5"])
    ctx = _ctx(step.rollouts)
    _run(mem, step, ctx)
    m = ctx.metrics
    assert m["meds/gate/g1_distinct_penalty_groups"] == 1.0
    on_top = 2 * math.log(4) / (2 * math.log(4) + math.log(3))  # "14": 2 of the 3 wrong responses
    assert m["meds/gate/g3_group_top_answer_excess"] == pytest.approx(on_top - 2 / 3)  # one group
    assert m["meds/gate/g4_size_recurrence_corr"] == pytest.approx(1.0)
    assert -step.rollouts.scores[2].item() == pytest.approx(0.1 * math.log(3), abs=1e-6)
    assert m["meds/clusters_per_key"] >= 1.0 and 0.0 <= m["meds/noise_fraction"] <= 1.0


def test_advantage_placement_subtracts_the_penalty_after_normalisation(tmp_path):
    """Under ``placement=advantage`` the scores stay as graded and a wrong response's advantage
    loses its penalty; gate G2 measures the change against the unshaped advantages."""
    from medsrl.algo.advantages import group_advantages

    rng = np.random.default_rng(10)
    mem = _plugin(tmp_path, placement="advantage", alpha=1.0)
    mem._algo = SimpleNamespace(advantage="grpo", advantage_options={})
    _run(mem, _step(0, [("k", [(f, False) for f in _blob([1, 0], 3, rng)])]))
    step = _step(1, [("k", [(_blob([1, 0], 1, rng)[0], False), (_blob([1, 0], 1, rng)[0], False),
                            (np.array([0, 1], np.float32), True)])])
    rollouts = step.rollouts
    rollouts.packed = SimpleNamespace(response_mask=torch.ones(3, 4))
    ctx = _ctx(rollouts)
    _run(mem, step, ctx)
    assert torch.equal(rollouts.scores, rollouts.reward)  # nothing before normalisation
    raw = group_advantages(rollouts.scores, rollouts.group_ids)
    shaped = mem.shape_advantages(rollouts, raw, ctx)
    pen = math.log(4)  # size 3, alpha 1, cap 2
    torch.testing.assert_close(shaped, raw - torch.tensor([pen, pen, 0.0]), atol=1e-6, rtol=0)
    m = ctx.metrics
    assert m["meds/gate/g2_advantage_rewritten"] > 0.5
    # both wrong responses carry one penalty: all of the change is the common part, none targets
    assert m["meds/gate/g2_common"] == pytest.approx(m["meds/gate/g2_advantage_rewritten"])
    assert m["meds/gate/g2_targeted"] == 0.0
    assert m["meds/gate/g5_rewarded_errors"] == 0.0 and m["meds/gate/g6_correct_advantage_loss"] == 0.0
    with pytest.raises(ValueError, match="placement=advantage"):
        Meds(placement="advantage", target="right")


def test_store_figures_are_the_same_with_background_and_sync_refits(tmp_path):
    """``clusters_per_key`` and ``noise_fraction`` come from the labels shaping read (which wait
    for a running re-fit), so two runs of a seed log the same values."""
    steps = _random_steps(11, 6)
    logged = {}
    for mode in ["sync", "background"]:
        mem = _plugin(tmp_path / mode, refit=mode)
        logged[mode] = []
        for i, g in enumerate(steps):
            step = _step(i, g)
            ctx = _ctx(step.rollouts)
            _run(mem, step, ctx)
            logged[mode].append({k: v for k, v in ctx.metrics.items()
                                 if "clusters" in k or "noise" in k or "gate" in k})
        mem.teardown(None, None, "fit")
    assert logged["sync"] == logged["background"]
    assert any("meds/clusters_per_key" in m for m in logged["sync"])


def test_dedup_counts_every_copy_but_clusters_the_distinct_rows(tmp_path):
    """Three identical wrong responses of one step are one point for HDBSCAN (noise alone) and
    for the vote, and three responses in the count of the noise they fall in."""
    rng = np.random.default_rng(12)
    e1, b, c = (np.eye(6, dtype=np.float32)[i] for i in range(3))
    rows = [(e1, False)] * 3 + [(f, False) for f in _blob(b, 3, rng) + _blob(c, 3, rng)]
    for dedup, copies_are_noise in ((False, False), (True, True)):
        mem = _plugin(tmp_path / str(dedup), clustering={"dedup": dedup})
        _run(mem, _step(0, [("k", rows)]))
        labels = mem.store.labels_for("k", False).labels
        assert (labels[:3] == -1).all() == copies_are_noise and len(set(labels[:3].tolist())) == 1
        assert len(set(labels[3:6].tolist())) == 1 and labels[3] != -1
        s = _run(mem, _step(1, [("k", [(_blob(b, 1, rng)[0], False)])]))
        assert s[0].item() == pytest.approx(-0.1 * math.log(4), abs=1e-6)  # a cluster of 3


def test_rows_of_groups_dealt_over_ranks_enter_the_memory_in_one_process_order(tmp_path):
    """Balanced ranks (step/balance.py) dealt groups a, c to rank 0 and b, d to rank 1: their
    commits still add the rows in the step's order, a, b, c, d, as one process does."""
    rng = np.random.default_rng(0)
    spec = {k: list(zip(_blob([float(i), 1.0], 2, rng), [True, False], strict=True)) for i, k in enumerate("abcd")}

    def step_of(keys: str, index: list[int]) -> HandMadeStep:
        made = _step(0, [(k, spec[k]) for k in keys])
        made.rollouts.group_index = index
        return made

    def entries(plugin: Meds) -> list[tuple[str, bool]]:
        return [(e["key"], e["correct"]) for e in plugin.state_dict()["memory"]["entries"]]

    one = _plugin(tmp_path / "one")
    _run(one, step_of("abcd", [0, 1, 2, 3]))
    assert entries(one) == [(k, ok) for k in "abcd" for ok in (True, False)]
    ranks = [(_plugin(tmp_path / "r0"), step_of("ac", [0, 2])), (_plugin(tmp_path / "r1"), step_of("bd", [1, 3]))]
    adds = [_additions(plugin, made) for plugin, made in ranks]  # each rank's hooks up to its additions
    for plugin, made in ranks:  # the host's all-gather: every rank commits both, in rank order
        plugin.commit(adds, _ctx(made.rollouts))
        assert entries(plugin) == entries(one)
    for x, y in zip(ranks[1][0].state_dict()["memory"]["entries"], one.state_dict()["memory"]["entries"], strict=True):
        np.testing.assert_array_equal(np.asarray(x["features"]), np.asarray(y["features"]))
    undealt = _plugin(tmp_path / "plain")  # no places (groups not dealt): rank order, a, c, b, d
    parts = [_step(0, [(k, spec[k]) for k in keys]) for keys in ("ac", "bd")]
    undealt.commit([_additions(undealt, made) for made in parts], _ctx(parts[0].rollouts))
    assert [k for k, _ in entries(undealt)][::2] == ["a", "c", "b", "d"]


def _additions(plugin: Meds, made: HandMadeStep):
    """One rank's hooks of a step up to its additions (``_run`` without the commit)."""
    ctx = _ctx(made.rollouts)
    plugin.enter_stage(made.rollouts.stage)
    plugin.reader = HandMadeReader(made.features)
    plugin.after_scoring(made.rollouts, ctx)
    plugin.shape_rewards(made.rollouts, ctx)
    return plugin.step_additions(made.rollouts, ctx)


def _shuffled_step(tmp_path, shuffle: bool, seed: int = 0, step: int = 1) -> torch.Tensor:
    """mode=answer after a step of wrong answers 14 x4, 9 x2, 23 x1: a group whose wrong answers
    14, 9, 23, 5 cost 0.1 ln 5, 0.1 ln 3, 0.1 ln 2, 0, beside a right one, and a second group."""
    mem = _plugin(tmp_path, clustering={"mode": "answer"}, shuffle_penalties=shuffle)
    mem._seed = seed  # what setup reads from the run
    f = np.array([1.0, 0.0], np.float32)
    _run(mem, _step(0, [("k", [(f, False)] * 7), ("j", [(f, False)] * 2)],
                    answers=["14"] * 4 + ["9"] * 2 + ["23"] + ["4", "6"]))
    made = _step(step, [("k", [(f, False)] * 4 + [(f, True)]), ("j", [(f, False)] * 3)],
                 answers=["14", "9", "23", "5", "1", "4", "6", "8"])
    _run(mem, made)
    return -made.rollouts.terms["meds"]


def test_shuffle_penalties_keeps_each_groups_penalties_and_changes_who_carries_them(tmp_path):
    plain = _shuffled_step(tmp_path / "off", shuffle=False)
    expected = [0.1 * math.log(5), 0.1 * math.log(3), 0.1 * math.log(2), 0.0, 0.0,
                0.1 * math.log(2), 0.1 * math.log(2), 0.0]
    torch.testing.assert_close(plain, torch.tensor(expected), atol=1e-6, rtol=0)  # off: nothing changes
    shuffled = _shuffled_step(tmp_path / "on", shuffle=True)
    for rows in (slice(0, 4), slice(5, 8)):  # each group's wrong responses: the same multiset
        torch.testing.assert_close(shuffled[rows].sort().values, plain[rows].sort().values)
    assert shuffled[4] == 0.0  # the right response is not among them
    assert not torch.equal(shuffled[0:4], plain[0:4])  # the assignment moved
    # reproducible from (seed, step): the same again, another draw under another seed or step
    torch.testing.assert_close(_shuffled_step(tmp_path / "again", shuffle=True), shuffled)
    others = [_shuffled_step(tmp_path / f"s{s}", shuffle=True, seed=s, step=t) for s, t in ((1, 1), (0, 2), (2, 1))]
    assert any(not torch.equal(o[0:4], shuffled[0:4]) for o in others)
