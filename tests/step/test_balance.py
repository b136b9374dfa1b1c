"""Balanced ranks (``step/balance.py``): the partition of hand-made token counts, the deal of a
step's groups over ranks, its exchange on gloo ranks, and the step's order the plug-ins commit in."""

from __future__ import annotations

import itertools
import pickle

import pytest

from gloo_ranks import on_gloo_ranks
from medsrl.data.example import Prompt
from medsrl.reward.grader import GradeResult
from medsrl.rollout.base import RolloutBatch
from medsrl.step.balance import (
    InStepOrder,
    balance_groups,
    deal,
    equal_size_partition,
    group_tokens,
    imbalance,
    in_step_order,
    num_updates,
)
from medsrl.step.rollouts import Group
from medsrl.step.schedule import UpdateSchedule


def _loads(weights, sets):
    return [sum(weights[i] for i in s) for s in sets]


def _check_partition(weights, sets, parts):
    assert len(sets) == parts
    assert sorted(i for s in sets for i in s) == list(range(len(weights)))  # each index once
    assert max(map(len, sets)) - min(map(len, sets)) <= 1
    assert all(s == sorted(s) for s in sets)


def test_equal_size_partition_of_hand_made_counts():
    # 6 groups over 2 ranks: the contiguous halves are 900 / 300 tokens; balanced, 3 each
    weights = [400, 300, 200, 100, 100, 100]
    sets = equal_size_partition(weights, 2)
    _check_partition(weights, sets, 2)
    assert sorted(_loads(weights, sets)) == [600, 600]
    assert sets == [[0, 3, 5], [1, 2, 4]]  # ties by index: the same sets on every rank
    # 5 over 2: sizes 3 and 2; 16 / 14 (the fillers keep the sizes, never a part's weight)
    weights = [8, 7, 6, 5, 4]
    sets = equal_size_partition(weights, 2)
    _check_partition(weights, sets, 2)
    assert sorted(_loads(weights, sets)) == [14, 16]
    # fewer items than parts, none, one part
    assert equal_size_partition([5, 3], 4) == [[0], [1], [], []]
    assert equal_size_partition([], 3) == [[], [], []]
    assert equal_size_partition([3, 1, 2], 1) == [[0, 1, 2]]
    with pytest.raises(ValueError):
        equal_size_partition([1], 0)


def test_equal_size_partition_is_near_the_best_on_random_counts():
    import random

    rng = random.Random(0)
    for _ in range(30):
        n, parts = rng.randint(4, 8), 2
        weights = [rng.randint(50, 2000) for _ in range(n)]
        sets = equal_size_partition(weights, parts)
        _check_partition(weights, sets, parts)
        best = min(max(sum(weights[i] for i in c), sum(weights) - sum(weights[i] for i in c))
                   for c in itertools.combinations(range(n), n // 2))
        assert max(_loads(weights, sets)) <= 1.1 * best
        assert equal_size_partition(weights, parts) == sets  # the same on every call (every rank)


def test_deal_balances_a_dapo_fill():
    # after DAPO's fill (step order: round 0's a, b on rank 0 and c, d on rank 1, then the last
    # round's e, f): batch_share gave both of round 1's groups to rank 0, 4 groups against 2
    tokens = [500, 520, 480, 510, 900, 880]
    holder = [0, 0, 1, 1, 0, 0]
    rank_of = deal(tokens, holder, world=2, updates=1)
    assert [rank_of.count(r) for r in (0, 1)] == [3, 3]
    assert imbalance(tokens, holder, 2) > 1.3
    assert imbalance(tokens, rank_of, 2) < 1.01  # 1,900 / 1,890 tokens
    assert sum(r != h for r, h in zip(rank_of, holder, strict=True)) == 1  # only the 900-token group travels
    # a balanced step stays as it is: nothing moves
    even = [100, 100, 100, 100]
    assert deal(even, [0, 0, 1, 1], world=2, updates=1) == [0, 0, 1, 1]
    # one process: everything on rank 0
    assert deal(tokens, [0] * 8, world=1, updates=3) == [0] * 8


def test_deal_balances_each_update_and_keeps_counts_within_one():
    # 10 groups, 3 per update: 4 updates (groups k, k+4, k+8); 3 ranks
    tokens = [100, 900, 300, 700, 500, 200, 800, 400, 600, 1000]
    updates = num_updates(10, 3)
    assert updates == 4
    rank_of = deal(tokens, [0, 0, 0, 0, 1, 1, 1, 2, 2, 2], world=3, updates=updates)
    counts = [rank_of.count(r) for r in range(3)]
    assert max(counts) - min(counts) <= 1
    for k in range(updates):  # each update's groups spread over the ranks, at most one more each
        per_rank = [sum(1 for i in range(k, 10, updates) if rank_of[i] == r) for r in range(3)]
        assert max(per_rank) - min(per_rank) <= 1


def test_deal_on_random_steps_is_within_slack_of_karmarkar_karp_and_keeps_counts():
    import random

    rng = random.Random(1)
    for _ in range(40):
        world, n = rng.randint(2, 5), rng.randint(0, 24)
        updates = num_updates(n, rng.choice([None, 2, 3, 5]))
        tokens = [rng.randint(20, 3000) for _ in range(n)]
        holder = sorted(rng.randrange(world) for _ in range(n))
        rank_of = deal(tokens, holder, world, updates)
        assert deal(tokens, holder, world, updates) == rank_of  # deterministic
        counts = [rank_of.count(r) for r in range(world)]
        assert max(counts) - min(counts) <= 1
        for k in range(updates):
            members = list(range(k, n, updates))
            loads = [sum(tokens[i] for i in members if rank_of[i] == r) for r in range(world)]
            per_rank = [sum(rank_of[i] == r for i in members) for r in range(world)]
            assert max(per_rank) - min(per_rank) <= 1
            kk = _loads([tokens[i] for i in members], equal_size_partition([tokens[i] for i in members], world))
            assert max(loads) <= max(kk) + 0.02 * sum(loads) / world + 1e-9
        assert deal(tokens, rank_of, world, updates) == rank_of  # dealt once, nothing moves again


def test_update_schedule_by_global_index_is_one_process_schedule():
    # 7 groups, 2 per update: 4 updates; one process takes group i in update i mod 4
    (one,) = [UpdateSchedule([7], 0, per_update=2, micro_batch_size=2)]
    expected = [m.tolist() for m in one.mini_batches]
    assert expected == [[0, 4], [1, 5], [2, 6], [3]]
    # dealt over 2 ranks: rank 0 holds global 0, 3, 4, 6 and rank 1 holds 1, 2, 5 (ascending)
    held = [[0, 3, 4, 6], [1, 2, 5]]
    plans = [UpdateSchedule([4, 3], r, per_update=2, micro_batch_size=2, global_index=held[r]) for r in (0, 1)]
    for k in range(4):
        got = sorted(held[r][j] for r in (0, 1) for j in plans[r].mini_batches[k].tolist())
        assert got == expected[k]


def _group(key: str, origin, lengths: list[int], prompt_len: int = 3) -> Group:
    n = len(lengths)
    ids = [[7] * length for length in lengths]
    batch = RolloutBatch([0] * n, [[1] * prompt_len] * n, ids, [key] * n, ["stop"] * n)
    grades = [GradeResult(float(i % 2), "1", True) for i in range(n)]
    return Group(Prompt(key, key, key, "1", "t"), batch, grades, ["sampled"] * n, origin=origin)


# round 0: 6 prompts over 3 ranks (2 each, short responses); DAPO's round 1 kept 3 long groups,
# all on rank 0 (the first of the round in rank order): rank 0 holds 3 more groups than the others
ROUND0 = {0: [("a", 10), ("b", 12)], 1: [("c", 11), ("d", 9)], 2: [("e", 10), ("f", 13)]}
ROUND1 = {0: [("g", 40), ("h", 38), ("i", 42)], 1: [], 2: []}


def _rank_groups(rank: int) -> list[Group]:
    mine = [_group(k, (0, 2 * rank + j), [t, t + 1]) for j, (k, t) in enumerate(ROUND0[rank])]
    return mine + [_group(k, (1, j), [t, t]) for j, (k, t) in enumerate(ROUND1[rank])]


def _balance_on_rank(rank: int) -> dict:
    groups = _rank_groups(rank)
    before = sum(group_tokens(g) for g in groups)
    batch, metrics = balance_groups(groups, per_update=None)
    return {
        "keys": [g.prompt.key for g in batch],
        "index": [g.index for g in batch],
        "rows": [[len(r) for r in g.rollout.response_ids] for g in batch],
        "tokens": sum(group_tokens(g) for g in batch),
        "before": before,
        "metrics": metrics,
    }


@pytest.mark.slow
def test_balance_moves_whole_groups_so_the_ranks_tokens_are_even(tmp_path):
    out = on_gloo_ranks(_balance_on_rank, tmp_path, world=3)
    # the step's order: round 0 in prompt order, then round 1 (one process's order)
    order = ["a", "b", "c", "d", "e", "f", "g", "h", "i"]
    everything = sorted((i, k) for r in out for i, k in zip(r["index"], r["keys"], strict=True))
    assert everything == list(enumerate(order))  # every group on exactly one rank, with its place
    for r in out:
        assert r["index"] == sorted(r["index"])  # held in the step's order
        assert len(r["keys"]) == 3  # counts stay equal
        for key, rows in zip(r["keys"], r["rows"], strict=True):  # whole groups: both rows
            assert len(rows) == 2 and key in order
    before, after = [r["before"] for r in out], [r["tokens"] for r in out]
    assert sum(before) == sum(after)
    assert max(before) / (sum(before) / 3) > 1.5  # rank 0 had the long round
    assert max(after) / (sum(after) / 3) < 1.1
    m = out[0]["metrics"]
    assert all(r["metrics"] == m for r in out)  # every rank made the same deal
    assert m["rank_token_imbalance"] == pytest.approx(max(after) / (sum(after) / 3))
    assert m["rank_token_imbalance_before"] == pytest.approx(max(before) / (sum(before) / 3))
    assert m["rank_moved_groups"] >= 2


def test_one_process_keeps_its_groups_in_the_steps_order():
    groups = _rank_groups(0)
    shuffled = [groups[3], groups[0], groups[4], groups[1], groups[2]]  # made in another order
    batch, metrics = balance_groups(shuffled, per_update=2)
    assert [g.prompt.key for g in batch] == ["a", "b", "g", "h", "i"]
    assert [g.index for g in batch] == [0, 1, 2, 3, 4]
    assert metrics == {"rank_token_imbalance": 1.0, "rank_token_imbalance_before": 1.0, "rank_moved_groups": 0.0}
    # groups without an origin (made outside _sample): kept in the order given
    plain = [_group("x", None, [3]), _group("y", None, [1])]
    assert [g.prompt.key for g in balance_groups(plain, per_update=None)[0]] == ["x", "y"]


def test_additions_commit_in_the_steps_order_whichever_rank_made_them():
    # one process would add a0, a1, b0, c0; rank 0 now holds a and c, rank 1 holds b
    r0 = InStepOrder(["a0", "a1", "c0"], [(0, 0, 0), (0, 0, 1), (0, 2, 0)])
    r1 = InStepOrder(["b0"], [(0, 1, 0)])
    assert in_step_order([r0, r1]) == ["a0", "a1", "b0", "c0"]
    back = pickle.loads(pickle.dumps(r0))  # what the host's all-gather does to it
    assert back == r0 and back.keys == r0.keys
    assert in_step_order([back, r1]) == ["a0", "a1", "b0", "c0"]
    # a rank without places (or a plain list): rank order, as before
    assert in_step_order([r0, ["z"]]) == ["a0", "a1", "c0", "z"]
    assert in_step_order([InStepOrder(["q"], [None]), r1]) == ["q", "b0"]
    with pytest.raises(ValueError):
        InStepOrder(["a"], [])
