"""Token masks against hand-worked values and float64 references written row by row."""

import math

import pytest
import torch

from gpo.algo import (
    HighEntropyMask,
    MismatchBandMask,
    OffPolicySequenceMask,
    RolloutCorrection,
    SecondMomentMask,
)

NAN, INF = math.nan, math.inf


def f64(values):
    return torch.tensor(values, dtype=torch.float64)


# ---- off-policy sequence mask (DeepSeek-V3.2) ----------------------------------------------------------------------

# row 0: A = -1, log(pi / pi_old) = (-0.6, -0.4, 0)  -> mean log(pi_old / pi) = 1/3 > 0.3: dropped
# row 1: A = -1, log-ratios (-0.3, -0.2)            -> 0.25 <= 0.3: kept
# row 2: A = +1, log-ratios (-0.9, -0.9, -0.9)      -> 0.9 > 0.3 but a positive advantage is never masked
# row 3: empty completion
OPSM_MASK = [[1, 1, 1], [1, 1, 0], [1, 1, 1], [0, 0, 0]]
OPSM_LOG_RATIO = [[-0.6, -0.4, 0.0], [-0.3, -0.2, NAN], [-0.9, -0.9, -0.9], [NAN, NAN, NAN]]
OPSM_ADV = [-1.0, -1.0, 1.0, 0.0]


def opsm_inputs(adv_rows=None):
    mask = f64(OPSM_MASK)
    old = torch.full((4, 3), -2.0, dtype=torch.float64).masked_fill(mask == 0, -INF)
    logp = old + f64(OPSM_LOG_RATIO)  # NaN / -inf on padding
    adv = f64(adv_rows) if adv_rows is not None else f64(OPSM_ADV)[:, None] * mask
    return mask, {"logp": logp, "old_logp": old, "adv": adv}


def test_off_policy_sequence_mask_hand_worked():
    mask, inputs = opsm_inputs()
    keep, metrics = OffPolicySequenceMask(threshold=0.3)(mask, **inputs)
    assert keep.dtype == torch.bool and not keep.requires_grad
    expected = [[0, 0, 0], [1, 1, 0], [1, 1, 1], [0, 0, 0]]
    assert keep.tolist() == [[bool(v) for v in row] for row in expected]
    assert metrics["mask/off_policy_frac"].item() == pytest.approx(3 / 8)  # row 0's 3 of 8 real tokens
    # mean over the 3 non-empty sequences of their KL estimate: (1/3 + 0.25 + 0.9) / 3
    assert metrics["mask/off_policy_kl_mean"].item() == pytest.approx((1 / 3 + 0.25 + 0.9) / 3)


def test_off_policy_sequence_mask_matches_a_row_by_row_reference():
    gen = torch.Generator().manual_seed(0)
    mask = (torch.rand(6, 5, generator=gen) > 0.3).double()
    old = -torch.rand(6, 5, generator=gen, dtype=torch.float64) * 3
    logp = old + torch.randn(6, 5, generator=gen, dtype=torch.float64) * 0.5
    adv = torch.randn(6, 5, generator=gen, dtype=torch.float64) * mask  # per-token advantages
    keep, _ = OffPolicySequenceMask(threshold=0.1)(mask, logp=logp, old_logp=old, adv=adv)
    for i in range(6):
        real = [t for t in range(5) if mask[i, t] > 0]
        kl = sum(old[i, t].item() - logp[i, t].item() for t in real) / max(1, len(real))
        for t in range(5):
            dropped = t in real and adv[i, t].item() < 0 and kl > 0.1
            assert keep[i, t].item() == (t in real and not dropped), (i, t)


def test_off_policy_sequence_mask_drops_only_the_negative_tokens_of_a_far_sequence():
    # per-token advantages in row 0 (multi-turn): only the tokens with A < 0 go
    mask, inputs = opsm_inputs(adv_rows=[[-1.0, 0.5, -2.0], [-1, -1, 0], [1, 1, 1], [0, 0, 0]])
    keep, _ = OffPolicySequenceMask(threshold=0.3)(mask, **inputs)
    assert keep[0].tolist() == [False, True, False]


# ---- M2PO second-moment mask --------------------------------------------------------------------------------------

# d = log pi_train - log pi_rollout over the 6 real tokens of a 2 x 4 batch (padding NaN):
#   d   = 0.5, -0.1, 0.3, 0.0 | 0.2, -0.05
#   d^2 = 0.25, 0.01, 0.09, 0 | 0.04, 0.0025; sum 0.3925, mean 0.0654167
# sorted d^2: 0.25, 0.09, 0.04, 0.01, 0.0025, 0; means of the rest after dropping k of them:
#   k=1: 0.1425 / 5 = 0.0285; k=2: 0.0525 / 4 = 0.013125; k=3: 0.0125 / 3 = 0.0041667; k=4: 0.0025 / 2 = 0.00125; k=5: 0
M2_MASK = [[1, 1, 1, 1], [1, 1, 0, 0]]
M2_D = [[0.5, -0.1, 0.3, 0.0], [0.2, -0.05, NAN, NAN]]


def m2_inputs(d=M2_D, mask=M2_MASK):
    rollout = torch.full((len(mask), len(mask[0])), -1.0, dtype=torch.float64)
    return f64(mask), {"train_logp": rollout + f64(d), "rollout_logp": rollout}


@pytest.mark.parametrize(
    ("bound", "dropped"),
    [
        (0.07, []),  # the mean 0.0654 is already within: nothing dropped
        (0.04, [(0, 0)]),  # drop d = 0.5: 0.0285 <= 0.04
        (0.02, [(0, 0), (0, 2)]),  # then d = 0.3: 0.013125
        (0.001, [(0, 0), (0, 2), (1, 0), (0, 1), (1, 1)]),  # only the d = 0 token is left
    ],
)
def test_second_moment_mask_drops_the_fewest_largest_tokens(bound, dropped):
    mask, inputs = m2_inputs()
    keep, metrics = SecondMomentMask(bound=bound)(mask, **inputs)
    expected = mask.bool().clone()
    for i, t in dropped:
        expected[i, t] = False
    assert torch.equal(keep, expected)
    assert metrics["mask/m2"].item() == pytest.approx(0.3925 / 6)
    assert metrics["mask/m2_frac"].item() == pytest.approx(len(dropped) / 6)
    kept_d2 = {0.07: 0.3925 / 6, 0.04: 0.0285, 0.02: 0.013125, 0.001: 0.0}[bound]
    assert metrics["mask/m2_kept"].item() == pytest.approx(kept_d2, abs=1e-7)


def test_second_moment_mask_matches_a_greedy_float64_reference():
    gen = torch.Generator().manual_seed(1)
    mask = (torch.rand(5, 7, generator=gen) > 0.25).double()
    d = torch.randn(5, 7, generator=gen, dtype=torch.float64) * 0.3
    keep, _ = SecondMomentMask(bound=0.03)(mask, train_logp=d - 1, rollout_logp=torch.full_like(d, -1.0))
    # greedy by hand: remove the largest d^2 one at a time while the mean of the rest is above the bound
    tokens = sorted(((d[i, t].item() ** 2, i, t) for i in range(5) for t in range(7) if mask[i, t] > 0), reverse=True)
    kept = list(tokens)
    while kept and sum(x for x, _, _ in kept) / len(kept) > 0.03:
        kept.pop(0)
    assert {(i, t) for _, i, t in kept} == {(i, t) for i in range(5) for t in range(7) if keep[i, t]}


def test_second_moment_mask_ties_at_the_cut_go_by_position_and_a_hopeless_batch_is_dropped_whole():
    # d^2 = 0.09, 0.09, 0: dropping one gives 0.045 <= 0.05; of the tied pair the first position goes
    mask, inputs = m2_inputs(d=[[0.3, -0.3, 0.0]], mask=[[1, 1, 1]])
    keep, _ = SecondMomentMask(bound=0.05)(mask, **inputs)
    assert keep.tolist() == [[False, True, True]]
    # every d^2 = 0.25 > 0.1: no kept set meets the bound, so nothing is kept (AReaL would keep one token)
    mask, inputs = m2_inputs(d=[[0.5, -0.5]], mask=[[1, 1]])
    keep, metrics = SecondMomentMask(bound=0.1)(mask, **inputs)
    assert not keep.any() and metrics["mask/m2_frac"].item() == 1 and metrics["mask/m2_kept"].item() == 0


def test_second_moment_mask_of_an_empty_batch_keeps_nothing_and_reports_zeros():
    mask, inputs = m2_inputs(d=[[NAN, NAN]], mask=[[0, 0]])
    keep, metrics = SecondMomentMask()(mask, **inputs)
    assert not keep.any() and all(v.item() == 0 for v in metrics.values())


# ---- IcePop mismatch band -----------------------------------------------------------------------------------------


def test_mismatch_band_keeps_tokens_whose_trainer_engine_ratio_is_inside():
    # k = pi_train / pi_rollout: 0.45 (out), 0.55 (in), 1, 4.9 (in), 5.2 (out); padding NaN / -inf
    ratios = [[0.45, 0.55, 1.0, 4.9, 5.2, 1.0]]
    mask = f64([[1, 1, 1, 1, 1, 0]])
    rollout = f64([[-2.0] * 6])
    train = (rollout + f64(ratios).log()).masked_fill(mask == 0, NAN)
    keep, metrics = MismatchBandMask(low=0.5, high=5.0)(mask, train_logp=train, rollout_logp=rollout)
    assert keep.tolist() == [[False, True, True, True, False, False]]
    assert metrics["mask/mismatch_frac"].item() == pytest.approx(2 / 5)


def test_mismatch_band_with_token_tis_is_icepop_weight():
    # IcePop: M(k) = k if 0.5 <= k <= 5 else 0, applied to the per-token loss
    gen = torch.Generator().manual_seed(2)
    mask = (torch.rand(4, 6, generator=gen) > 0.2).double()
    rollout = -torch.rand(4, 6, generator=gen, dtype=torch.float64) * 4
    train = rollout + torch.randn(4, 6, generator=gen, dtype=torch.float64)  # ratios e^N(0, 1): many outside
    keep, _ = MismatchBandMask(low=0.5, high=5.0)(mask, train_logp=train, rollout_logp=rollout)
    weight, _ = RolloutCorrection(mode="tis", level="token", cap=5.0)(train, rollout, mask)
    for i in range(4):
        for t in range(6):
            k = math.exp(train[i, t].item() - rollout[i, t].item())
            icepop = k if 0.5 <= k <= 5.0 and mask[i, t] > 0 else 0.0
            assert (keep[i, t] * weight[i, t]).item() == pytest.approx(icepop), (i, t)


# ---- 80/20: the highest-entropy tokens ----------------------------------------------------------------------------


def linear_quantile(values, q):
    """numpy's default ("linear") quantile, by hand."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


@pytest.mark.parametrize(
    ("quantile", "kept"),
    [
        # real entropies 0.1, 2.0, 0.5 | 3.0, 1.0 (and NaN padding); sorted 0.1, 0.5, 1.0, 2.0, 3.0
        (0.4, [2.0, 3.0]),  # threshold at 0.6: position 2.4 -> 1.0 + 0.4 * (2.0 - 1.0) = 1.4
        (1.0, [0.1, 2.0, 0.5, 3.0, 1.0]),  # threshold the minimum: all kept
        (0.0, [3.0]),  # threshold the maximum: the most uncertain token only
    ],
)
def test_high_entropy_mask_keeps_the_top_quantile_of_the_real_tokens(quantile, kept):
    entropy = f64([[0.1, 2.0, 0.5], [3.0, 1.0, NAN]])
    mask = f64([[1, 1, 1], [1, 1, 0]])
    keep, metrics = HighEntropyMask(quantile=quantile)(mask, entropy=entropy)
    assert sorted(entropy[keep].tolist()) == sorted(kept) and not keep[1, 2]
    assert metrics["mask/entropy_threshold"].item() == pytest.approx(
        linear_quantile([0.1, 2.0, 0.5, 3.0, 1.0], 1 - quantile)
    )
    assert metrics["mask/entropy_kept_frac"].item() == pytest.approx(len(kept) / 5)


def test_high_entropy_mask_matches_the_hand_quantile_on_random_entropies():
    gen = torch.Generator().manual_seed(4)
    mask = (torch.rand(6, 9, generator=gen) > 0.3).double()
    entropy = torch.rand(6, 9, generator=gen, dtype=torch.float64) * 5
    keep, _ = HighEntropyMask(quantile=0.2)(mask, entropy=entropy)
    real = [entropy[i, t].item() for i in range(6) for t in range(9) if mask[i, t] > 0]
    threshold = linear_quantile(real, 0.8)
    expected = (entropy >= threshold) & mask.bool()
    assert torch.equal(keep, expected)


# ---- the contract -------------------------------------------------------------------------------------------------


def test_masks_say_whether_they_read_the_current_policy():
    assert OffPolicySequenceMask(threshold=0.5).per_update and HighEntropyMask().per_update
    assert not SecondMomentMask().per_update and not MismatchBandMask().per_update
    assert SecondMomentMask.requires == MismatchBandMask.requires == {"train_logp", "rollout_logp"}


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: OffPolicySequenceMask(threshold=0), "threshold=0"),
        (lambda: SecondMomentMask(bound=-1), "bound=-1"),
        (lambda: MismatchBandMask(low=1.5), "0 < low <= 1 <= high"),
        (lambda: MismatchBandMask(high=0.9), "0 < low <= 1 <= high"),
        (lambda: HighEntropyMask(quantile=1.2), "quantile=1.2"),
    ],
)
def test_invalid_settings_are_refused(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_second_moment_mask_bound_is_inclusive_when_the_rest_mean_equals_it_exactly():
    """M2PO cut: fewest largest d^2 dropped so that mean_kept d^2 <= bound (inclusive, the documented departure)."""
    # d = 1, 0.5, 0.5 (exact in binary): d^2 = 1, 0.25, 0.25. Dropping the d = 1 token leaves mean (0.25 + 0.25) / 2
    # = 0.25 == bound: inclusive keeps the other two. A strict "<" finds no kept set at all and drops all three.
    rollout = f64([[-1.0, -1.0, -1.0]])
    train = rollout + f64([[1.0, 0.5, -0.5]])
    keep, metrics = SecondMomentMask(bound=0.25)(f64([[1, 1, 1]]), train_logp=train, rollout_logp=rollout)
    assert keep.tolist() == [[False, True, True]]
    assert metrics["mask/m2_kept"].item() == 0.25
    assert metrics["mask/m2_frac"].item() == pytest.approx(1 / 3)


def test_mismatch_band_default_is_icepops_half_to_five():
    """IcePop band by default: keep iff 0.5 <= pi_train / pi_rollout <= 5 (the docstring's and TRL's [0.5, 5])."""
    # ratios 0.45 (out of [0.5, 5], but inside a looser [0.4, 5]), 0.55 (in), 4.9 (in), 5.2 (out)
    rollout = f64([[-2.0] * 4])
    train = rollout + f64([[0.45, 0.55, 4.9, 5.2]]).log()
    keep, _ = MismatchBandMask()(f64([[1, 1, 1, 1]]), train_logp=train, rollout_logp=rollout)
    assert keep.tolist() == [[False, True, True, False]]
