"""The distributed bookkeeping of an update, with two ranks played by one process."""

from __future__ import annotations

import torch

from medsrl.step.schedule import UpdateSchedule

LENGTHS = torch.arange(1, 9), torch.tensor([3, 9, 1, 4, 7, 2, 8, 5])  # prompt, response per packed row


def _plans(counts, per_update, mb=2, sharded=False, gathered=None, max_tokens=None):
    """One schedule per rank; collectives faked: sums and gathers over both ranks' values."""
    plans = []
    for rank in range(len(counts)):
        plans.append(UpdateSchedule(
            counts, rank, per_update=per_update, micro_batch_size=mb, sharded=sharded, max_tokens=max_tokens,
            reduce_sum=lambda v: v * len(counts),  # every rank reports the same value here
            gather=lambda v: gathered if gathered is not None else [v] * len(counts),
        ))
    return plans


def test_every_update_takes_a_strided_share_of_each_ranks_groups():
    # 5 groups, two per update: 3 updates; rank 0 holds groups 0-2, rank 1 groups 3-4 (local 0-1)
    r0, r1 = _plans([3, 2], per_update=2)
    assert [m.tolist() for m in r0.mini_batches] == [[0], [1], [2]]
    assert [m.tolist() for m in r1.mini_batches] == [[0], [1], []]
    whole = _plans([3, 2], per_update=None)
    assert [m.tolist() for m in whole[0].mini_batches] == [[0, 1, 2]]
    assert [m.tolist() for m in whole[1].mini_batches] == [[0, 1]]
    (one,) = _plans([5], per_update=2)  # one process: the same strided order
    assert [m.tolist() for m in one.mini_batches] == [[0, 3], [1, 4], [2]]
    assert _plans([0], per_update=2)[0].mini_batches == []


def test_with_8_ranks_of_64_groups_every_mini_batch_has_rows_on_every_rank():
    """The paper's 7B run: 512 prompts on 8 ranks, 16 prompts a mini-batch. Cut as ranges of global
    groups, each of the 32 mini-batches had rows on exactly one rank (the other seven ran idle
    passes); strided, each rank holds 2 groups of every one of them."""
    counts = [64] * 8
    plans = _plans(counts, per_update=16)
    assert {len(p.mini_batches) for p in plans} == {32}
    for k in range(32):
        assert [len(p.mini_batches[k]) for p in plans] == [2] * 8
    # and together they are the mini-batches of one process holding all 512 groups
    (one,) = _plans([512], per_update=16)
    for k in range(32):
        ranks = sorted(64 * r + g for r, p in enumerate(plans) for g in p.mini_batches[k].tolist())
        assert ranks == one.mini_batches[k].tolist()
    assert sorted(g for m in one.mini_batches for g in m.tolist()) == list(range(512))


def test_rows_of_a_mini_batch_and_its_global_totals():
    (plan,) = _plans([2], per_update=1)
    group_ids = torch.tensor([0, 0, 1, 1, 1])
    assert plan.rows(group_ids, torch.tensor([1])).tolist() == [2, 3, 4]
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert plan.totals(mask) == (3.0, 2.0)  # one process: its own 3 tokens, 2 sequences
    (a, _) = _plans([1, 1], per_update=None)
    assert a.totals(mask) == (6.0, 4.0)  # the fake reduce doubles: two ranks alike


def test_ddp_passes_are_this_ranks_own_with_weight_one():
    (plan,) = _plans([1], per_update=None, mb=2)
    passes = plan.micro_batches(torch.tensor([5, 6, 7]), *LENGTHS)
    assert [(p.tolist(), w) for p, w in passes] == [([5, 6], 1.0), ([7], 1.0)]
    assert plan.micro_batches(torch.tensor([], dtype=torch.long), *LENGTHS) == []


def test_a_token_budget_cuts_sorted_rows_and_fsdp_still_pads_to_the_busiest_rank():
    # rows 1..6: prompt+response 2+9, 3+1, 4+4, 5+7, 6+2, 7+8; longest first, budget 30 padded
    # tokens: 6 and 4 (2 x (7+8)), then 1 and 3 (2 x (4+9); 5 would make 3 x (6+9)), then 5 and 2
    (plan,) = _plans([1], per_update=None, mb=4, max_tokens=30)
    passes = plan.micro_batches(torch.arange(1, 7), *LENGTHS)
    assert [(p.tolist(), w) for p, w in passes] == [([4, 6], 1.0), ([1, 3], 1.0), ([2, 5], 1.0)]
    sharded = _plans([1, 1], per_update=None, mb=4, sharded=True, gathered=[1, 3], max_tokens=30)[0]
    passes = sharded.micro_batches(torch.tensor([2, 3]), *LENGTHS)
    assert [(p.tolist(), w) for p, w in passes] == [([2, 3], 2.0), ([0], 0.0), ([0], 0.0)]


def test_fsdp_pads_to_the_busiest_rank_with_zero_weight_passes_and_weights_by_world_size():
    # this rank has 1 micro-batch of work, the other rank 3: run 3, two of them weight 0
    plan = _plans([1, 1], per_update=None, mb=2, sharded=True, gathered=[1, 3])[0]
    passes = plan.micro_batches(torch.tensor([4, 5]), *LENGTHS)
    assert [(p.tolist(), w) for p, w in passes] == [([4, 5], 2.0), ([0], 0.0), ([0], 0.0)]


def test_a_flag_on_any_rank_counts():
    flags = {True: 1.0, False: 0.0}
    plan = UpdateSchedule([1, 1], 0, per_update=None, micro_batch_size=1,
                          reduce_sum=lambda v: v + flags[True])  # the other rank saw a bad loss
    assert plan.any_rank(False)
    calm = UpdateSchedule([1], 0, per_update=None, micro_batch_size=1, reduce_sum=lambda v: v)
    assert not calm.any_rank(False) and calm.any_rank(True)
