import math
import statistics

import pytest
import torch

from gpo.algo import (
    BatchWhitenedAdvantage,
    GroupNormAdvantage,
    LeaveOneOutAdvantage,
    MeanScaledAdvantage,
    RankAdvantage,
)

ESTIMATORS = [
    GroupNormAdvantage(),
    GroupNormAdvantage(scale="batch"),
    GroupNormAdvantage(scale="none"),
    GroupNormAdvantage(std="sample"),
    LeaveOneOutAdvantage(),
    BatchWhitenedAdvantage(),
    RankAdvantage(),
    MeanScaledAdvantage(),
]


def seq_adv(estimator, rewards, groups, t=3):
    reward = torch.tensor(rewards, dtype=torch.float32)
    group = torch.tensor(groups)
    mask = torch.ones(len(rewards), t)
    adv = estimator(reward, group, mask)
    assert adv.shape == (len(rewards), t)
    return adv[:, 0].tolist()


def test_grpo_group_population_std_hand_worked():
    # group 7: [1, 0] -> mean 0.5, population std 0.5 -> (+0.5/0.5, -0.5/0.5) = (+1, -1)  (2-GRPO)
    # group 3: [3, 1, 2] -> mean 2, population std sqrt((1+1+0)/3) = 0.81650 -> (1.22474, -1.22474, 0)
    adv = seq_adv(GroupNormAdvantage(), [1, 0, 3, 1, 2], [7, 7, 3, 3, 3])
    assert adv == pytest.approx([1, -1, 1.2247449, -1.2247449, 0], abs=1e-6)


def test_grpo_group_sample_std_hand_worked():
    # group [3, 1, 2]: sample std sqrt(2 / 2) = 1 -> (1, -1, 0); group [1, 0]: sample std sqrt(0.5) -> +-0.70711
    adv = seq_adv(GroupNormAdvantage(std="sample"), [1, 0, 3, 1, 2], [7, 7, 3, 3, 3])
    assert adv == pytest.approx([0.7071068, -0.7071068, 1, -1, 0], abs=1e-6)


def test_grpo_batch_scale_divides_by_std_of_all_rewards():
    rewards, groups = [1, 0, 3, 1, 2], [0, 0, 1, 1, 1]
    spread = statistics.pstdev(rewards)  # 1.0198
    means = {0: 0.5, 1: 2.0}
    expected = [(r - means[g]) / spread for r, g in zip(rewards, groups, strict=True)]
    assert seq_adv(GroupNormAdvantage(scale="batch"), rewards, groups) == pytest.approx(expected, abs=1e-6)


def test_dr_grpo_scale_none_is_mean_centring_only():
    # group [0.2, 0.8, 0.5] -> mean 0.5 -> (-0.3, 0.3, 0.0)
    assert seq_adv(GroupNormAdvantage(scale="none"), [0.2, 0.8, 0.5], [1, 1, 1]) == pytest.approx(
        [-0.3, 0.3, 0.0], abs=1e-6
    )


def test_rloo_hand_worked_and_equals_scaled_group_mean():
    # group [1, 0, 0]: baselines (0+0)/2 = 0, (1+0)/2 = 0.5, 0.5 -> advantages (1, -0.5, -0.5)
    # and n/(n-1) (r - mean) = 3/2 * (2/3, -1/3, -1/3) = (1, -0.5, -0.5)
    assert seq_adv(LeaveOneOutAdvantage(), [1, 0, 0], [4, 4, 4]) == pytest.approx([1, -0.5, -0.5], abs=1e-6)
    torch.manual_seed(0)
    reward, group = torch.rand(12), torch.arange(12) // 4
    adv = LeaveOneOutAdvantage()(reward, group, torch.ones(12, 1))[:, 0]
    centred = GroupNormAdvantage(scale="none")(reward, group, torch.ones(12, 1))[:, 0]
    torch.testing.assert_close(adv, centred * 4 / 3)


def test_reinforce_pp_group_centre_then_batch_whiten():
    rewards, groups = [1.0, 0.0, 0.0, 3.0, 1.0, 2.0, 2.0], [0, 0, 0, 1, 1, 1, 2]
    by_group: dict[int, list[float]] = {}
    for r, g in zip(rewards, groups, strict=True):
        by_group.setdefault(g, []).append(r)
    centred = [r - statistics.fmean(by_group[g]) for r, g in zip(rewards, groups, strict=True)]
    mu, sigma = statistics.fmean(centred), statistics.pstdev(centred)
    expected = [(c - mu) / sigma for c in centred]
    assert seq_adv(BatchWhitenedAdvantage(), rewards, groups) == pytest.approx(expected, abs=1e-5)


def test_rank_advantage_ties_and_monotone_invariance():
    # group [0.1, 5, 5, -3]: ascending ranks -3 -> 0, 0.1 -> 1, the two 5s share (2 + 3) / 2 = 2.5
    # A = 2 rank / (n - 1) - 1 = (2/3 - 1, 5/3 - 1, 5/3 - 1, -1) = (-1/3, 2/3, 2/3, -1)
    rewards = [0.1, 5.0, 5.0, -3.0]
    assert seq_adv(RankAdvantage(), rewards, [0] * 4) == pytest.approx([-1 / 3, 2 / 3, 2 / 3, -1], abs=1e-6)
    squashed = [math.tanh(r) * 7 + 1 for r in rewards]  # monotone map of the rewards
    assert seq_adv(RankAdvantage(), squashed, [0] * 4) == pytest.approx([-1 / 3, 2 / 3, 2 / 3, -1], abs=1e-6)


@pytest.mark.parametrize("estimator", ESTIMATORS, ids=lambda e: type(e).__name__ + getattr(e, "scale", ""))
def test_all_equal_rewards_and_singletons_give_zero(estimator):
    # group 0 all equal (0.1 is not exact in binary: the mean may differ from each value by rounding),
    # group 1 a single completion
    adv = seq_adv(estimator, [0.1, 0.1, 0.1, 0.7], [0, 0, 0, 1])
    assert all(math.isfinite(a) for a in adv)
    assert adv[:3] == pytest.approx([0, 0, 0], abs=1e-6)
    assert adv[3] == pytest.approx(0, abs=1e-6)


@pytest.mark.parametrize("estimator", ESTIMATORS, ids=lambda e: type(e).__name__ + getattr(e, "scale", ""))
def test_whole_batch_all_equal_is_zero_not_nan(estimator):
    adv = seq_adv(estimator, [2.0] * 6, [0, 0, 0, 1, 1, 1])
    assert adv == [0.0] * 6


@pytest.mark.parametrize("estimator", ESTIMATORS, ids=lambda e: type(e).__name__ + getattr(e, "scale", ""))
def test_group_ids_need_not_be_contiguous_or_sorted(estimator):
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0, 2.0, 0.5])
    group = torch.tensor([42, 9, 9, 42, 9, 42])
    order = torch.tensor([1, 2, 4, 0, 3, 5])  # sorted by group
    mask = torch.ones(6, 2)
    shuffled = estimator(rewards, group, mask)
    sorted_ = estimator(rewards[order], torch.tensor([0, 0, 0, 1, 1, 1]), mask)
    torch.testing.assert_close(shuffled[order], sorted_)


@pytest.mark.parametrize("estimator", ESTIMATORS, ids=lambda e: type(e).__name__ + getattr(e, "scale", ""))
def test_advantage_broadcast_over_tokens_and_zero_on_padding(estimator):
    reward = torch.tensor([1.0, 0.0, 0.5, 0.2])
    group = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]])  # row 2: empty completion
    adv = estimator(reward, group, mask)
    assert adv.dtype == torch.float32
    assert torch.all(adv[mask == 0] == 0)
    for row in (0, 3):
        assert torch.all(adv[row, mask[row].bool()] == adv[row, 0])


def test_invalid_choices_list_the_valid_ones():
    with pytest.raises(ValueError, match="'group', 'batch', 'none'"):
        GroupNormAdvantage(scale="global")
    with pytest.raises(ValueError, match="'population', 'sample'"):
        GroupNormAdvantage(std="biased")


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        # group of two, rewards (1, 0) and (0.3, 0.3):
        (GroupNormAdvantage(), [1, -1, 0, 0]),  # population std 0.5 -> +-1 (2-GRPO)
        (GroupNormAdvantage(std="sample"), [0.7071068, -0.7071068, 0, 0]),  # sample std sqrt(0.5)
        (GroupNormAdvantage(scale="none"), [0.5, -0.5, 0, 0]),
        (LeaveOneOutAdvantage(), [1, -1, 0, 0]),  # r_i - r_j
        (RankAdvantage(), [1, -1, 0, 0]),
        (MeanScaledAdvantage(), [1, -1, 0, 0]),  # (1 - 0.5) / 0.5 = 1, (0 - 0.5) / 0.5 = -1; (0.3, 0.3) centred 0
        # centred (0.5, -0.5, 0, 0): batch mean 0, population std sqrt((0.25 + 0.25) / 4) = 0.35355
        (BatchWhitenedAdvantage(), [1.4142136, -1.4142136, 0, 0]),
    ],
    ids=lambda x: type(x).__name__ if not isinstance(x, list) else "",
)
def test_groups_of_two(estimator, expected):
    assert seq_adv(estimator, [1.0, 0.0, 0.3, 0.3], [0, 0, 1, 1]) == pytest.approx(expected, abs=1e-6)


def test_maxrl_divides_the_centred_reward_by_the_group_mean_hand_worked():
    # group 0 [1, 0, 0, 0]: pass rate 1/4 -> (1 - 0.25) / 0.25 = 3 for the success, (0 - 0.25) / 0.25 = -1 otherwise
    # group 1 [1, 1, 1, 0]: pass rate 3/4 -> 0.25 / 0.75 = 1/3, and -0.75 / 0.75 = -1
    # group 2 [0.5, 0.2]: mean 0.35 -> 0.15 / 0.35 = 3/7, -3/7
    adv = seq_adv(MeanScaledAdvantage(), [1, 0, 0, 0, 1, 1, 1, 0, 0.5, 0.2], [0] * 4 + [1] * 4 + [2] * 2)
    assert adv == pytest.approx([3, -1, -1, -1, 1 / 3, 1 / 3, 1 / 3, -1, 3 / 7, -3 / 7], abs=1e-6)


def test_maxrl_matches_a_float64_reference_and_differs_from_grpo_by_the_spread_over_the_mean():
    torch.manual_seed(1)
    reward, group = torch.rand(24), torch.arange(24) % 6
    adv = seq_adv(MeanScaledAdvantage(), reward.tolist(), group.tolist())
    grpo = seq_adv(GroupNormAdvantage(), reward.tolist(), group.tolist())
    for g in range(6):
        rows = [i for i in range(24) if group[i] == g]
        values = [float(reward[i]) for i in rows]
        mean = math.fsum(values) / len(values)
        spread = statistics.pstdev(values)
        for i, r in zip(rows, values, strict=True):
            assert adv[i] == pytest.approx((r - mean) / mean, rel=1e-5, abs=1e-6)
            assert adv[i] == pytest.approx(grpo[i] * spread / mean, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize(
    ("rewards", "why"),
    [
        ([0.0, 0.0, 0.0], "all wrong: mean 0, no signal"),
        ([-1.0, 0.0, 0.5], "negative mean -1/6 would flip every sign"),
        ([2e-7, 0.0, 1e-7], "mean 1e-7 <= eps: float noise would become advantages (1, -1, 0)"),
    ],
)
def test_maxrl_group_mean_at_or_below_eps_gives_zero(rewards, why):
    assert seq_adv(MeanScaledAdvantage(), rewards, [0, 0, 0]) == [0.0, 0.0, 0.0], why
    # above eps the rule applies: [6e-6, 0, 0] has mean 2e-6 -> (4e-6 / 2e-6, -1, -1) = (2, -1, -1)
    assert seq_adv(MeanScaledAdvantage(eps=1e-6), [6e-6, 0.0, 0.0], [0] * 3) == pytest.approx([2, -1, -1], rel=1e-5)


def test_maxrl_refuses_a_negative_eps():
    with pytest.raises(ValueError, match="eps=-1"):
        MeanScaledAdvantage(eps=-1)


def test_group_norm_default_eps_is_1e_6_so_small_but_real_spreads_are_normalised():
    """GRPO A_i = (r_i - mean_g) / std_g; the default eps (1e-6) zeroes only spreads at or below 1e-6."""
    # group 0: rewards (0, 1e-4): population std 5e-5 > 1e-6 -> (-1, +1); group 1: (0.3, 0.3 + 1e-7): std 5e-8 -> 0
    reward = torch.tensor([0.0, 1e-4, 0.3, 0.3 + 1e-7], dtype=torch.float64)
    adv = GroupNormAdvantage()(reward, torch.tensor([0, 0, 1, 1]), torch.ones(4, 1))[:, 0]
    assert adv.tolist() == pytest.approx([-1.0, 1.0, 0.0, 0.0], abs=1e-6)
    assert GroupNormAdvantage().eps == 1e-6
