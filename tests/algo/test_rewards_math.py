"""Reward mixers, shaping and token weighting."""

import pytest
import torch

from gpo.algo import (
    DuplicatePenalty,
    EnvEventOutcomeBlend,
    GroupNormalizedSum,
    ReferenceProbWeight,
    SoftOverlongPunishment,
    WeightedSum,
    overlong_filter,
)

SCORES = torch.tensor([[1.0, 10.0], [0.0, 30.0], [1.0, 20.0], [0.0, 20.0]])
GROUP = torch.tensor([0, 0, 1, 1])


def test_weighted_sum_hand_worked():
    # 1*0.5 + 10*0.1 = 1.5; 0 + 3 = 3; 0.5 + 2 = 2.5; 0 + 2 = 2
    reward = WeightedSum(weights=[0.5, 0.1])(SCORES, GROUP)
    torch.testing.assert_close(reward, torch.tensor([1.5, 3.0, 2.5, 2.0]))
    torch.testing.assert_close(WeightedSum()(SCORES, GROUP), SCORES.sum(-1))


def test_gdpo_normalises_each_reward_within_its_group():
    # group 0: reward 0 is (1, 0) -> (+1, -1); reward 1 is (10, 30) -> (-1, +1)
    # group 1: reward 0 is (1, 0) -> (+1, -1); reward 1 is (20, 20) -> constant -> (0, 0)
    # weights (1, 0.5): (1 - 0.5, -1 + 0.5, 1 + 0, -1 + 0)
    reward = GroupNormalizedSum(weights=[1.0, 0.5])(SCORES, GROUP)
    torch.testing.assert_close(reward, torch.tensor([0.5, -0.5, 1.0, -1.0]))


def test_gdpo_keeps_the_low_variance_reward_that_a_plain_sum_drowns():
    # in group 1 the 0/1 correctness decides everything under GDPO; the plain sum is dominated by the 10x scale
    plain = WeightedSum()(SCORES, GROUP)
    assert plain[1] > plain[0]  # raw sum prefers the wrong answer in group 0
    gdpo = GroupNormalizedSum()(SCORES, GROUP)
    assert gdpo[0] == gdpo[1] == 0  # the two signals cancel exactly once both are on the same scale


def test_env_event_outcome_blend():
    scores = torch.tensor([[1.0, 0.5, 0.0], [0.0, 1.0, 1.0]])
    reward = EnvEventOutcomeBlend(env=1.0, event=0.2, outcome=0.5)(scores, torch.tensor([0, 0]))
    torch.testing.assert_close(reward, torch.tensor([1.1, 0.7]))
    with pytest.raises(ValueError, match="3 score columns"):
        EnvEventOutcomeBlend()(SCORES, GROUP)


def test_mixer_weight_count_must_match():
    with pytest.raises(ValueError, match="3 weights for 2 reward columns"):
        WeightedSum(weights=[1, 2, 3])(SCORES, GROUP)


def test_soft_overlong_punishment_piecewise():
    # L_max = 10, L_cache = 4: safe up to 6; ramp (6 - |y|) / 4; -1 past 10
    penalty = SoftOverlongPunishment(max_length=10, cache_length=4)(torch.tensor([3, 6, 7, 8, 10, 11]))
    torch.testing.assert_close(penalty, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    with pytest.raises(ValueError, match="cache_length=12"):
        SoftOverlongPunishment(max_length=10, cache_length=12)


def test_duplicate_penalty_within_groups_only():
    tokens = torch.tensor([[5, 6, 0], [5, 6, 0], [5, 7, 0], [5, 6, 0], [5, 6, 9], [5, 6, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 0]])
    group = torch.tensor([0, 0, 0, 0, 1, 1])
    # group 0: rows 1 and 3 repeat row 0; row 2 differs. group 1: row 4 is longer, row 5 first of its kind there
    penalty = DuplicatePenalty(penalty=-0.5)(tokens, mask, group)
    torch.testing.assert_close(penalty, torch.tensor([0.0, -0.5, 0.0, -0.5, 0.0, 0.0]))


def test_duplicate_penalty_ignores_padding_contents():
    tokens = torch.tensor([[5, 6, 1], [5, 6, 2]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    torch.testing.assert_close(DuplicatePenalty()(tokens, mask, torch.tensor([0, 0])), torch.tensor([0.0, -1.0]))


def test_overlong_filter_drops_truncated_rows():
    mask = torch.ones(3, 4)
    filtered = overlong_filter(mask, torch.tensor([False, True, False]))
    torch.testing.assert_close(filtered, torch.tensor([[1.0] * 4, [0.0] * 4, [1.0] * 4]))


def test_reference_prob_weight_hand_worked():
    # pi_ref = 0.9 -> weight 0.1; pi_ref = 0.25 -> 0.75
    adv = torch.tensor([[2.0, 2.0, 2.0]])
    ref_logp = torch.tensor([[0.9, 0.25, 0.5]]).log()
    weighted = ReferenceProbWeight()(adv, ref_logp, torch.tensor([[1, 1, 0]]))
    torch.testing.assert_close(weighted, torch.tensor([[0.2, 1.5, 0.0]]))
