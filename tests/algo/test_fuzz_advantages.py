"""Fuzz: advantage estimators and reward mixers keep their documented invariants.

Hypothesis feeds random shapes, masks (empty and full rows), rewards and log-ratios; see strategies.py."""

import itertools

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from torch import Tensor

from gpo.algo import (
    BatchWhitenedAdvantage,
    EnvEventOutcomeBlend,
    GroupNormAdvantage,
    GroupNormalizedSum,
    LeaveOneOutAdvantage,
    MeanScaledAdvantage,
    RankAdvantage,
    RewardMixer,
    WeightedSum,
)
from tests.algo.fuzz_checks import (
    EPS,
    group_size,
    groups,
    resolvable,
    sequence_values,
)
from tests.algo.strategies import (
    cases,
    f32,
    floats32,
    fuzz,
    group_constant_rewards,
)

# ---------------------------------------------------------------------------------------------- advantages

ESTIMATORS = [
    GroupNormAdvantage(),
    GroupNormAdvantage(std="sample"),
    GroupNormAdvantage(scale="batch"),
    GroupNormAdvantage(scale="none"),
    LeaveOneOutAdvantage(),
    BatchWhitenedAdvantage(),
    BatchWhitenedAdvantage(std="sample"),
    RankAdvantage(),
    MeanScaledAdvantage(),
]


def describe(part) -> str:
    return f"{type(part).__name__}({','.join(f'{k}={v}' for k, v in vars(part).items())})"


@pytest.mark.parametrize("estimator", ESTIMATORS, ids=describe)
@fuzz()
@given(case=cases())
def test_advantage_is_a_finite_sequence_value_on_real_tokens_only(estimator, case):
    adv = estimator(case.reward, case.group, case.mask)
    assert adv.shape == case.mask.shape and adv.dtype == torch.float32
    assert torch.isfinite(adv).all(), adv
    seq = sequence_values(estimator, case.reward, case.group)
    assert torch.equal(adv, seq[:, None] * case.mask), "not the sequence value broadcast, zero on padding"
    # group ids are only labels: the contiguous labels give the same advantages
    assert torch.equal(estimator(case.reward, torch.tensor(case.labels), case.mask), adv)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("std", ["population", "sample"])
@fuzz()
@given(case=cases())
def test_group_norm_matches_its_formula(scale, std, case):
    adv = sequence_values(GroupNormAdvantage(scale=scale, std=std, eps=EPS), case.reward, case.group).double()
    r, unbiased = case.reward.double(), std == "sample"
    batch_spread = r.std(unbiased=unbiased) if len(r) > 1 else r.new_zeros(())
    for rows in groups(case.labels):
        x, a = r[rows], adv[rows]
        if len(rows) == 1:
            assert a.item() == 0, "a group of one has no baseline"
            continue
        spread = {"group": x.std(unbiased=unbiased), "batch": batch_spread, "none": torch.tensor(1.0)}[scale]
        scope = x if scale == "group" else r
        if spread == 0 or (x == x[0]).all() or not resolvable(spread, scope) or EPS / 2 <= spread <= 2 * EPS:
            continue  # all-equal groups: test_all_equal_groups_get_exactly_zero
        expected = (x - x.mean()) / spread if spread > EPS else torch.zeros_like(x)
        atol = 1e-6 * (1 + x.abs().max() / spread)
        torch.testing.assert_close(a, expected, rtol=1e-5, atol=atol)
        if scale == "group" and spread > EPS:
            assert abs(a.mean()) <= atol, "group-normalised advantages must have zero mean in the group"
            torch.testing.assert_close(
                a.std(unbiased=unbiased), torch.tensor(1.0, dtype=torch.float64), rtol=1e-4, atol=0
            )


@fuzz()
@given(case=cases())
def test_leave_one_out_is_n_over_n_minus_one_times_mean_centred(case):
    loo = sequence_values(LeaveOneOutAdvantage(), case.reward, case.group).double()
    centred = sequence_values(GroupNormAdvantage(scale="none"), case.reward, case.group).double()
    n = group_size(case.labels)
    assert (loo[n == 1] == 0).all(), "a group of one gets zero advantage"
    expected = torch.where(n > 1, n / (n - 1).clamp_min(1) * centred, torch.zeros_like(centred))
    torch.testing.assert_close(loo, expected, rtol=1e-5, atol=1e-6 * (1 + case.reward.abs().max().item()))


@pytest.mark.parametrize("std", ["population", "sample"])
@fuzz()
@given(case=cases())
def test_batch_whitened_advantage_has_zero_mean_and_unit_std(std, case):
    adv = sequence_values(BatchWhitenedAdvantage(std=std), case.reward, case.group).double()
    r, unbiased = case.reward.double(), std == "sample"
    centred = r - torch.stack([r[rows].mean() for rows in groups(case.labels)])[torch.tensor(case.labels)]
    spread = centred.std(unbiased=unbiased) if len(r) > 1 else r.new_zeros(())
    if spread > 2 * EPS and resolvable(spread, r):
        atol = 1e-6 * (1 + r.abs().max() / spread)
        torch.testing.assert_close(adv, (centred - centred.mean()) / spread, rtol=1e-5, atol=atol)
        assert abs(adv.mean()) <= atol * len(r)
        torch.testing.assert_close(
            adv.std(unbiased=unbiased), torch.tensor(1.0, dtype=torch.float64), rtol=1e-4, atol=0
        )


@fuzz()
@given(case=cases())
def test_rank_advantage_depends_only_on_the_order_within_each_group(case):
    adv = sequence_values(RankAdvantage(), case.reward, case.group)
    assert ((adv >= -1) & (adv <= 1)).all(), adv
    for rows in groups(case.labels):
        assert abs(adv[rows].sum()) <= 1e-5, "ranks are centred within each group"
        for i, j in itertools.permutations(rows.tolist(), 2):
            if case.reward[i] < case.reward[j]:
                assert adv[i] < adv[j]
            if case.reward[i] == case.reward[j]:
                assert adv[i] == adv[j]
    # replace each reward by its dense rank in the batch: a monotone map that keeps every tie
    dense = torch.unique(case.reward, return_inverse=True)[1].float()
    assert torch.equal(sequence_values(RankAdvantage(), dense, case.group), adv)
    torch.testing.assert_close(sequence_values(RankAdvantage(), -case.reward, case.group), -adv)


@fuzz()
@given(case=cases())
def test_mean_scaled_advantage_matches_its_formula_and_its_guard(case):
    adv = sequence_values(MeanScaledAdvantage(eps=EPS), case.reward, case.group).double()
    r = case.reward.double()
    for rows in groups(case.labels):
        x, a = r[rows], adv[rows]
        mean = x.mean()
        if mean <= EPS:
            assert (a == 0).all(), "a group mean at or below eps (zero or negative) gives zero advantage"
            continue
        if not resolvable(mean, x):
            continue  # a mean lost in float32 rounding of the values
        atol = 1e-6 * (1 + x.abs().max() / mean)
        torch.testing.assert_close(a, (x - mean) / mean, rtol=1e-5, atol=atol)
        assert abs((a * mean).sum()) <= atol * mean * len(rows), "the centred rewards sum to zero in the group"


EQUAL_REWARD_PARTS = [
    pytest.param(GroupNormAdvantage(), id="group_norm"),
    pytest.param(GroupNormAdvantage(std="sample"), id="group_norm_sample"),
    pytest.param(GroupNormAdvantage(scale="batch"), id="group_norm_batch"),
    pytest.param(GroupNormAdvantage(scale="none"), id="group_norm_none"),
    pytest.param(LeaveOneOutAdvantage(), id="leave_one_out"),
    pytest.param(BatchWhitenedAdvantage(), id="batch_whitened"),
    pytest.param(RankAdvantage(), id="rank"),
    pytest.param(MeanScaledAdvantage(), id="mean_scaled"),
    pytest.param(GroupNormalizedSum(), id="group_normalized_sum_mixer"),
]


@pytest.mark.parametrize("part", EQUAL_REWARD_PARTS)
@fuzz()
@given(reward_group=group_constant_rewards())
@example(reward_group=(f32([100.7] * 3 + [0.0] * 3), torch.tensor([0, 0, 0, 1, 1, 1])))
def test_all_equal_groups_get_exactly_zero(part, reward_group):
    reward, group = reward_group
    # for the mixer: a reward constant within a group contributes 0 there
    mixer = isinstance(part, RewardMixer)
    values = part(reward[:, None], group) if mixer else sequence_values(part, reward, group)
    assert torch.equal(values, torch.zeros_like(values)), values.tolist()


# ---------------------------------------------------------------------------------------------- mixers, shaping


@st.composite
def scores(draw, columns: int | None = None) -> tuple[Tensor, Tensor, list[int]]:
    case = draw(cases())
    k = columns or draw(st.integers(1, 4))
    scale = draw(st.sampled_from([1.0, 1e6, 1e-8]))
    values = [[draw(floats32(-1, 1)) * scale for _ in range(k)] for _ in case.labels]
    return f32(values), case.group, case.labels


@fuzz()
@given(data=scores(), weights=st.data())
def test_weighted_sum_and_blend_are_the_weighted_sum(data, weights):
    values, group, _ = data
    w = weights.draw(st.lists(st.floats(-2, 2), min_size=values.shape[1], max_size=values.shape[1]))
    out = WeightedSum(weights=w)(values, group)
    assert out.shape == (values.shape[0],) and torch.isfinite(out).all()
    expected = values.double() @ torch.tensor(w, dtype=torch.float64)
    atol = 1e-6 * (values.abs().sum(-1).max().item() * 2 + 1e-30)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=atol)
    if values.shape[1] == 3:
        torch.testing.assert_close(EnvEventOutcomeBlend(env=w[0], event=w[1], outcome=w[2])(values, group), out)
    else:
        with pytest.raises(ValueError, match="3 score columns"):
            EnvEventOutcomeBlend()(values, group)


@fuzz()
@given(data=scores(), weights=st.data())
def test_group_normalized_sum_is_the_weighted_sum_of_group_normalised_columns(data, weights):
    values, group, labels = data
    w = weights.draw(st.lists(st.floats(-2, 2), min_size=values.shape[1], max_size=values.shape[1]))
    out = GroupNormalizedSum(weights=w, eps=EPS)(values, group)
    assert out.shape == (values.shape[0],) and torch.isfinite(out).all()
    columns = [sequence_values(GroupNormAdvantage(eps=EPS), values[:, k], group) for k in range(values.shape[1])]
    expected = sum(wk * col.double() for wk, col in zip(w, columns, strict=True))
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    for rows in groups(labels):
        assert abs(out[rows].double().sum()) <= 1e-4 * len(rows) * (1 + sum(map(abs, w))) * max(
            1, float(columns[0].abs().max())
        )
