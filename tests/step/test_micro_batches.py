import pytest
import torch

from medsrl.step.micro_batches import padding_fraction, plan_micro_batches


def _cover(batches, rows):
    return sorted(torch.cat(batches).tolist()) == sorted(rows.tolist())


def test_without_a_budget_rows_are_cut_in_order():
    rows = torch.arange(7)
    lengths = torch.ones(7, dtype=torch.long)
    got = plan_micro_batches(rows, lengths, lengths, max_rows=3)
    assert [b.tolist() for b in got] == [[0, 1, 2], [3, 4, 5], [6]]


def test_a_token_budget_groups_rows_of_similar_length_and_keeps_their_order():
    prompt = torch.full((6,), 2, dtype=torch.long)
    resp = torch.tensor([10, 1, 9, 2, 8, 1])
    # longest first: 0 (12), 2 (11), 4 (10), 3 (4), 1 (3), 5 (3); budget 24 tokens:
    # [0, 2] is 2 x 12; 4 would make it 3 x 12; [4, 3] is 2 x 10; 1 would make it 3 x 10
    got = plan_micro_batches(torch.arange(6), prompt, resp, max_rows=8, max_tokens=24)
    assert [b.tolist() for b in got] == [[0, 2], [3, 4], [1, 5]]
    for b in got:  # no micro-batch over budget unless it is one row
        assert len(b) == 1 or len(b) * int(prompt[b].max() + resp[b].max()) <= 24
    assert padding_fraction(got, prompt, resp) < padding_fraction([torch.arange(6)], prompt, resp)


def test_budget_respects_max_rows_and_a_row_longer_than_the_budget_runs_alone():
    prompt = torch.ones(5, dtype=torch.long)
    resp = torch.tensor([100, 1, 1, 1, 1])
    got = plan_micro_batches(torch.arange(5), prompt, resp, max_rows=2, max_tokens=10)
    assert [b.tolist() for b in got] == [[0], [1, 2], [3, 4]]


def test_plans_a_subset_of_rows_by_their_own_lengths():
    prompt = torch.ones(10, dtype=torch.long)
    resp = torch.arange(10)
    rows = torch.tensor([9, 2, 5, 7])
    got = plan_micro_batches(rows, prompt, resp, max_rows=4, max_tokens=20)
    assert _cover(got, rows)
    # rows keep the order they were given in: 9 before 7
    assert [b.tolist() for b in got] == [[9, 7], [2, 5]]


def test_padding_fraction_counts_slots_per_micro_batch():
    prompt = torch.tensor([2, 2, 2])
    resp = torch.tensor([4, 2, 0])
    # one micro-batch: 3 rows x 6 wide = 18 slots, 12 real
    assert padding_fraction([torch.arange(3)], prompt, resp) == pytest.approx(1 - 12 / 18)
    assert padding_fraction([torch.tensor([0]), torch.tensor([1]), torch.tensor([2])], prompt, resp) == 0.0
    assert padding_fraction([], prompt, resp) == 0.0


def test_bad_limits_are_refused():
    one = torch.ones(1, dtype=torch.long)
    with pytest.raises(ValueError, match="max_rows"):
        plan_micro_batches(torch.arange(1), one, one, max_rows=0)
    with pytest.raises(ValueError, match="max_tokens"):
        plan_micro_batches(torch.arange(1), one, one, max_rows=1, max_tokens=0)
