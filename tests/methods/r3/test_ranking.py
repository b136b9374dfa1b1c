"""SERR on small entropy tables, numbers worked by hand."""

import pytest
import torch

from medsrl.methods.r3.length_bonus import length_bonus
from medsrl.methods.r3.ranking import (
    answer_span_mask,
    dominance_counts,
    entropy_profile,
    ranking_order,
    ranking_rewards,
)

# 4 responses of 5 tokens; p = 0.2 -> top max(1, floor(1.0)) = 1 entropy = the max
TABLE = torch.tensor([
    [0.1, 0.1, 0.1, 0.1, 2.0],  # peak 2.0, global 0.48
    [0.5, 0.5, 0.5, 0.5, 1.0],  # peak 1.0, global 0.60
    [0.2, 0.2, 0.2, 0.2, 0.2],  # peak 0.2, global 0.20
    [1.0, 1.0, 1.0, 1.0, 1.5],  # peak 1.5, global 1.10
])
FULL = torch.ones_like(TABLE)


def test_profile_peak_and_global():
    peak, glob = entropy_profile(TABLE, FULL, p=0.2)
    assert peak.tolist() == pytest.approx([2.0, 1.0, 0.2, 1.5])
    assert glob.tolist() == pytest.approx([0.48, 0.6, 0.2, 1.1])
    # p = 0.4 -> the top 2 entropies
    peak2, _ = entropy_profile(TABLE, FULL, p=0.4)
    assert peak2.tolist() == pytest.approx([1.05, 0.75, 0.2, 1.25])


def test_profile_ignores_padding_and_empty_rows():
    ent = torch.tensor([[3.0, 1.0, 2.0, 9.0, 9.0], [5.0, 5.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    peak, glob = entropy_profile(ent, mask, p=0.5)  # floor(1.5) = 1 token
    assert peak.tolist() == pytest.approx([3.0, 0.0])
    assert glob.tolist() == pytest.approx([2.0, 0.0])


def test_dominance_counts_order_and_rewards():
    peak, glob = entropy_profile(TABLE, FULL, p=0.2)
    # row 0 beats rows 1 and 3 (higher peak, lower global); row 2 has the lower global, not the
    # higher peak; nobody else beats anyone
    assert dominance_counts(peak, glob).tolist() == [2, 0, 0, 0]
    # ties at S = 0 broken by lower global entropy: row 2 (0.2), row 1 (0.6), row 3 (1.1)
    assert ranking_order(peak, glob) == [0, 2, 1, 3]
    # rank r of N = 4 gets 0.5 * (1 - r / 3)
    assert ranking_rewards(peak, glob, r_max=0.5).tolist() == pytest.approx([0.5, 1 / 6, 1 / 3, 0.0])


def test_equal_peaks_do_not_dominate():
    peak = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)
    glob = torch.tensor([0.3, 0.1, 0.2], dtype=torch.float64)
    assert dominance_counts(peak, glob).tolist() == [0, 0, 0]
    assert ranking_order(peak, glob) == [1, 2, 0]
    assert ranking_rewards(peak, glob, r_max=1.0).tolist() == pytest.approx([0.0, 1.0, 0.5])


def test_full_ties_keep_the_original_order():
    peak = torch.tensor([1.0, 1.0], dtype=torch.float64)
    glob = torch.tensor([0.5, 0.5], dtype=torch.float64)
    assert ranking_rewards(peak, glob, r_max=0.5).tolist() == [0.5, 0.0]


def test_n_equals_1_and_2():
    one = ranking_rewards(torch.tensor([0.7]), torch.tensor([0.1]), r_max=0.5)
    assert one.tolist() == [0.5]
    # N = 2: row 1 beats row 0 (peak 2 > 1, global 0.1 < 0.4) -> rank 0, the whole R_max
    two = ranking_rewards(torch.tensor([1.0, 2.0]), torch.tensor([0.4, 0.1]), r_max=0.5)
    assert two.tolist() == [0.0, 0.5]


def test_bad_p():
    with pytest.raises(ValueError, match="p must be in"):
        entropy_profile(TABLE, FULL, p=0.0)


def test_answer_span_mask_reads_the_graded_span_or_the_whole_response():
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float32)
    out = answer_span_mask(mask, [2, None, 2, 0])
    assert out.tolist() == [[0, 0, 1, 1, 0],  # the answer after the reasoning
                            [1, 1, 1, 0, 0],  # never closed: read whole
                            [1, 1, 0, 0, 0],  # nothing after the tag: read whole
                            [1, 1, 1, 1, 1]]  # no reasoning tag in use
    assert mask[0].tolist() == [1, 1, 1, 1, 0]  # not modified in place


def test_length_bonus_of_correct_answers():
    bonus = length_bonus(torch.tensor([0, 16384, 40000, 100]), torch.tensor([True, True, True, False]), 32768)
    assert bonus.tolist() == [1.0, 0.5, 0.0, 0.0]
    with pytest.raises(ValueError, match="max_length"):
        length_bonus(torch.tensor([1]), torch.tensor([True]), 0)
