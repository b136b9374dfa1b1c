import math

import pytest
import torch

from medsrl.algo import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    compute_advantages,
    gdpo_advantages,
    group_advantages,
    register_advantage,
    rloo_advantages,
)
from medsrl.algo.advantages import ADVANTAGE_OPTIONS


def test_single_group_hand_computed():
    # scores [1,0,0,1]: mean .5; unbiased var = 4*.25/3 = 1/3, std = .5774
    # adv = +-.5 / .5774 = +-0.8660
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.long))
    a = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a]), atol=1e-5, rtol=0)
    assert abs(a - 0.8660) < 1e-4


def test_uses_unbiased_std():
    # [2,0] : mean 1, unbiased std = sqrt(2) (biased would be 1) -> adv +-1/sqrt(2)
    adv = group_advantages(torch.tensor([2.0, 0.0]), torch.tensor([3, 3]), eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0]) / math.sqrt(2))


def test_ragged_shuffled_groups_and_size_one():
    # group 7: [1,0,1] mean 2/3, var = (1/9+4/9+1/9)/2 = 1/3 -> std .5774
    #   adv: (1/3)/.5774 = .5774, (-2/3)/.5774 = -1.1547
    # group 42: [5,3] mean 4, std sqrt(2) -> +-0.7071
    # group -1: [9] size one -> 0
    scores = torch.tensor([1.0, 5.0, 9.0, 0.0, 3.0, 1.0])
    gids = torch.tensor([7, 42, -1, 7, 42, 7])
    adv = group_advantages(scores, gids)
    s = math.sqrt(1 / 3)
    expected = torch.tensor([(1 / 3) / s, 1 / math.sqrt(2), 0.0, (-2 / 3) / s, -1 / math.sqrt(2),
                             (1 / 3) / s])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


def test_matches_per_group_reference_on_random_permutation():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(30, generator=g)
    gids = torch.tensor([0] * 8 + [1] * 5 + [2] * 16 + [3])[torch.randperm(30, generator=g)] * 11
    adv = group_advantages(scores, gids)
    for gid in gids.unique():
        sel = gids == gid
        x = scores[sel]
        ref = (x - x.mean()) / (x.std() + 1e-6) if x.numel() > 1 else torch.zeros(1)
        torch.testing.assert_close(adv[sel], ref)


def test_dr_grpo_no_std():
    # group 0: [1,0,0,1] -> +-.5 ; group 1: [3,1] mean 2 -> +-1
    adv = group_advantages(torch.tensor([1.0, 3.0, 0.0, 0.0, 1.0, 1.0]),
                           torch.tensor([0, 1, 0, 0, 0, 1]), norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, 1.0, -0.5, -0.5, 0.5, -1.0]))


def test_uniform_group_gives_zero_not_nan():
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0]))
    assert torch.equal(adv, torch.zeros(3))


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))


# ---------------------------------------------------------------- RLOO


def test_rloo_hand_computed_ragged_and_size_one():
    # group 0: [1,0,0,1] mean .5, n=4: 4/3 * (+-.5) = +-2/3
    #   (check row 0 directly: 1 - mean(0,0,1) = 1 - 1/3 = 2/3)
    # group 5: [2,0,1]: 2 - mean(0,1) = 1.5 ; 0 - mean(2,1) = -1.5 ; 1 - mean(2,0) = 0
    # group 9: [7] size one -> 0
    scores = torch.tensor([1.0, 2.0, 0.0, 7.0, 0.0, 0.0, 1.0, 1.0])
    gids = torch.tensor([0, 5, 0, 9, 5, 0, 5, 0])
    adv = rloo_advantages(scores, gids)
    expected = torch.tensor([2 / 3, 1.5, -2 / 3, 0.0, -1.5, -2 / 3, 0.0, 2 / 3])
    torch.testing.assert_close(adv, expected)


def test_rloo_integer_scores_and_shape_check():
    # [1,0] -> 1 - 0 = 1, 0 - 1 = -1
    adv = rloo_advantages(torch.tensor([1, 0]), torch.tensor([4, 4]))
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError):
        rloo_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))


# ---------------------------------------------------------------- GDPO

# Two groups of 3. With u = 1/sqrt(3) = .57735 (the unbiased std of a 0/1 group of 3 with one
# odd one out is sqrt((4/9 + 1/9 + 1/9) / 2) = sqrt(1/3) = u, and its deviations are +-1/3, 2/3):
#   correct [1,0,0 | 1,1,0]: devs [2/3,-1/3,-1/3 | 1/3,1/3,-2/3] / u = [2,-1,-1 | 1,1,-2] * u
#   penalty [0,-.1,0 | -.1,0,0]: devs [.1/3,-.2/3,.1/3 | ...] / (.1 u) = [1,-2,1 | -2,1,1] * u
#     (its raw scale .1 cancels: that is the point of GDPO)
GIDS = torch.tensor([0, 0, 0, 1, 1, 1])
CORRECT = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
PENALTY = torch.tensor([0.0, -0.1, 0.0, -0.1, 0.0, 0.0])


def test_gdpo_hand_computed():
    # sum = [3,-3,0 | -1,2,-1] * u; batch mean 0; sum of squares (9+9+0+1+4+1) u^2 = 24 u^2
    # unbiased batch var = 24/5 u^2, std = sqrt(24/5) u -> whitened = k / sqrt(24/5) = k * .45644
    adv = gdpo_advantages({"correct": CORRECT, "penalty": PENALTY}, GIDS)
    k = torch.tensor([3.0, -3.0, 0.0, -1.0, 2.0, -1.0])
    torch.testing.assert_close(adv, k / math.sqrt(24 / 5), atol=1e-4, rtol=0)
    # GRPO on the summed score [1,-.1,0 | .9,1,0] barely sees the penalty: row 1 and 2 differ by
    # only .1 / std, while GDPO gives row 1 (penalised, wrong) -3 against row 2's 0
    grpo = group_advantages(CORRECT + PENALTY, GIDS)
    assert (grpo[2] - grpo[1]).item() < 0.2 < (adv[2] - adv[1]).item()


def test_gdpo_weights():
    # x = correct + .5 * penalty = [2+.5, -1-1, -1+.5 | 1-1, 1+.5, -2+.5] u
    #   = [2.5,-2,-.5 | 0,1.5,-1.5] u; mean 0; squares 6.25+4+.25+0+2.25+2.25 = 15 u^2
    # unbiased var = 15/5 u^2 = 3 * 1/3 = 1 -> std 1, whitened = x = k * .57735
    adv = gdpo_advantages({"correct": CORRECT, "penalty": PENALTY}, GIDS, weights={"penalty": 0.5})
    k = torch.tensor([2.5, -2.0, -0.5, 0.0, 1.5, -1.5])
    torch.testing.assert_close(adv, k / math.sqrt(3), atol=1e-4, rtol=0)


def test_gdpo_weight_for_missing_term_and_no_terms():
    with pytest.raises(ValueError, match="meds"):
        gdpo_advantages({"correct": CORRECT}, GIDS, weights={"meds": 1.0})
    with pytest.raises(ValueError):
        gdpo_advantages({}, GIDS)


def test_gdpo_term_constant_within_groups_contributes_nothing():
    # format = 1 in group 0, 5 in group 1: zero spread in each group -> normalised to 0 exactly,
    # so the result is the hand-computed two-term one, whatever its weight
    fmt = torch.tensor([1.0, 1.0, 1.0, 5.0, 5.0, 5.0])
    terms = {"correct": CORRECT, "penalty": PENALTY, "format": fmt}
    base = gdpo_advantages({"correct": CORRECT, "penalty": PENALTY}, GIDS)
    torch.testing.assert_close(gdpo_advantages(terms, GIDS), base)
    torch.testing.assert_close(gdpo_advantages(terms, GIDS, weights={"format": 10.0}), base)


def test_gdpo_zero_spread_batch_and_single_row_give_zero():
    # every term constant within its group -> x = 0, std 0 -> 0 / (0 + eps) = 0, not nan
    zero = gdpo_advantages({"a": torch.tensor([1.0, 1.0, 3.0])}, torch.tensor([0, 0, 1]))
    assert torch.equal(zero, torch.zeros(3))
    one = gdpo_advantages({"a": torch.tensor([0.3])}, torch.tensor([2]))
    assert torch.equal(one, torch.zeros(1))


def test_gdpo_reduce_sum_whitens_over_all_ranks():
    # rank 0 holds groups 0,1 (the hand-computed batch), rank 1 holds groups 2,3, whose weighted
    # sums have another spread. The fake all-reduce adds what rank 1 sends (recorded by running
    # rank 1 with an identity reduce_sum) to each of rank 0's sums, in call order.
    terms_0 = {"correct": CORRECT, "penalty": PENALTY}
    gids_0 = GIDS
    terms_1 = {"correct": torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0]),
               "penalty": torch.tensor([0.0, 0.0, -0.5, 0.0, 0.0, -0.5])}
    gids_1 = torch.tensor([2, 2, 3, 3, 3, 3])

    def run_pair():
        sent = {0: [], 1: []}
        for rank, (t, g) in enumerate([(terms_0, gids_0), (terms_1, gids_1)]):
            gdpo_advantages(t, g, reduce_sum=lambda v, r=rank: sent[r].append(v) or v)
        outs = []
        for rank, (t, g) in enumerate([(terms_0, gids_0), (terms_1, gids_1)]):
            other = iter(sent[1 - rank])
            outs.append(gdpo_advantages(t, g, reduce_sum=lambda v, o=other: v + next(o)))
        return sent, outs

    sent, (out_0, out_1) = run_pair()
    assert len(sent[0]) == len(sent[1]) == 3  # sum, sum of squares, count
    assert sent[0][2] == sent[1][2] == 6.0
    whole = gdpo_advantages(
        {k: torch.cat([terms_0[k], terms_1[k]]) for k in terms_0}, torch.cat([gids_0, gids_1])
    )
    torch.testing.assert_close(torch.cat([out_0, out_1]), whole)
    # and the reduction matters: rank 0 alone whitens with its own std
    alone = gdpo_advantages(terms_0, gids_0)
    assert (out_0 - alone).abs().max().item() > 0.05


# ---------------------------------------------------------------- registry


@pytest.fixture
def restore_estimators():
    saved = dict(ADVANTAGE_ESTIMATORS), dict(ADVANTAGE_OPTIONS)
    yield
    for registry, before in zip((ADVANTAGE_ESTIMATORS, ADVANTAGE_OPTIONS), saved, strict=True):
        registry.clear()
        registry.update(before)


def _inputs(reduce_sum=None):
    return AdvantageInputs(
        scores=CORRECT + PENALTY,
        group_ids=GIDS,
        terms={"correct": CORRECT, "penalty": PENALTY},
        response_mask=torch.ones(6, 4),
        reduce_sum=reduce_sum,
    )


def test_registered_estimators_resolve_to_their_functions():
    assert {"grpo", "drgrpo", "rloo", "gdpo", "w_reinforce", "passk"} <= set(ADVANTAGE_ESTIMATORS)
    inp = _inputs()
    s = inp.scores
    torch.testing.assert_close(compute_advantages("grpo", inp), group_advantages(s, GIDS))
    torch.testing.assert_close(
        compute_advantages("drgrpo", inp), group_advantages(s, GIDS, norm_by_std=False)
    )
    torch.testing.assert_close(compute_advantages("rloo", inp), rloo_advantages(s, GIDS))
    torch.testing.assert_close(
        compute_advantages("gdpo", inp, weights={"penalty": 0.5}),
        gdpo_advantages(inp.terms, GIDS, weights={"penalty": 0.5}),
    )


def test_grpo_eps_option_is_forwarded():
    # [2,0]: devs +-1, std sqrt(2); eps=1 -> +-1 / (sqrt(2) + 1) = +-.41421
    inp = AdvantageInputs(torch.tensor([2.0, 0.0]), torch.tensor([0, 0]), {}, torch.ones(2, 1))
    adv = compute_advantages("grpo", inp, eps=1.0)
    a = 1 / (math.sqrt(2) + 1)
    torch.testing.assert_close(adv, torch.tensor([a, -a]))


def test_gdpo_estimator_uses_inputs_reduce_sum():
    calls = []
    compute_advantages("gdpo", _inputs(reduce_sum=lambda v: calls.append(v) or v))
    assert len(calls) == 3


def test_unknown_estimator_lists_valid_names_sorted():
    with pytest.raises(ValueError, match="'ppo'") as e:
        compute_advantages("ppo", _inputs())
    assert ", ".join(sorted(ADVANTAGE_ESTIMATORS)) in str(e.value)
    assert "drgrpo, gdpo, grpo, passk, rloo, w_reinforce" in str(e.value)


def test_bad_option_names_estimator_and_config_key():
    """Checked at start, against the options the estimator registered, not at its first call."""
    from medsrl.algo.settings import AlgorithmConfig

    # Dr.GRPO has no std, so no eps
    with pytest.raises(ValueError, match=r"algorithm.advantage_options.eps is not a setting of advantage 'drgrpo'"):
        AlgorithmConfig(advantage="drgrpo", advantage_options={"eps": 1e-6})
    with pytest.raises(ValueError, match=r"algorithm.advantage_options.weight is not a setting of advantage 'gdpo' "
                                         r"\(known: eps, weights\)"):
        AlgorithmConfig(advantage="gdpo", advantage_options={"weight": {"penalty": 0.5}})  # typo of weights
    assert AlgorithmConfig(advantage="gdpo", advantage_options={"weights": {"penalty": 0.5}}).advantage == "gdpo"


def test_type_error_inside_estimator_is_not_blamed_on_options(restore_estimators):
    @register_advantage("broken")
    def broken(inputs):
        return inputs.scores + "x"  # TypeError from the estimator's own code

    with pytest.raises(TypeError):
        compute_advantages("broken", _inputs())


def test_register_and_duplicate(restore_estimators):
    @register_advantage("twice")
    def twice(inputs, *, factor=2.0):
        return inputs.scores * factor

    torch.testing.assert_close(compute_advantages("twice", _inputs(), factor=3.0),
                               (CORRECT + PENALTY) * 3.0)
    original = ADVANTAGE_ESTIMATORS["grpo"]
    with pytest.raises(ValueError, match="grpo"):
        register_advantage("grpo")(twice)
    assert ADVANTAGE_ESTIMATORS["grpo"] is original


def test_advantage_change_fraction_by_hand():
    """One group of 4 (rewards 1, 0, 0, 0), GRPO: base advantages (x - 0.25) / std, std of
    (1, 0, 0, 0) with ddof 1 = 0.5: 1.5, -0.5, -0.5, -0.5. A MEDS-like penalty of 0.5 on the last
    wrong response (scores 1, 0, 0, -0.5): mean 0.125, std 0.6292 (ddof 1): 1.3908, -0.1987,
    -0.1987, -0.9934. Responses of 2, 1, 1 and 2 tokens: the mean |change| per token is
    (2 x 0.1092 + 0.3013 + 0.3013 + 2 x 0.4934) / 6 = 0.3013, the mean |base| (2 x 1.5 + 0.5 +
    0.5 + 2 x 0.5) / 6 = 0.8333: 0.3616."""
    from medsrl.algo import advantage_change_fraction

    groups = torch.zeros(4, dtype=torch.long)
    base = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), groups)
    shaped = group_advantages(torch.tensor([1.0, 0.0, 0.0, -0.5]), groups)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0], [1.0, 1.0]])
    assert base.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    assert shaped.tolist() == pytest.approx([1.3908, -0.1987, -0.1987, -0.9934], abs=1e-4)
    assert advantage_change_fraction(shaped, base, mask) == pytest.approx(0.3616, abs=1e-3)
    assert advantage_change_fraction(base, base, mask) == 0.0
    # token-level shaped advantages (an entropy bonus) against sequence-level base ones
    bonus = shaped[:, None] + torch.tensor([[0.1, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    assert advantage_change_fraction(bonus, base, mask) == pytest.approx((0.3013 * 6 - 0.1) / 6 / 0.8333, abs=1e-3)
    zero = torch.zeros(4)
    assert advantage_change_fraction(zero, zero, mask) == 0.0
    assert math.isnan(advantage_change_fraction(shaped, zero, mask))
