"""Fuzz: token masks keep a subset of the real tokens, never read padding, and follow their formulas.

Hypothesis feeds random shapes, masks (empty and full rows), advantages, log-ratios and entropies; see strategies.py."""

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from gpo.algo import HighEntropyMask, MismatchBandMask, OffPolicySequenceMask, SecondMomentMask
from tests.algo.fuzz_checks import check_metrics
from tests.algo.strategies import TOKEN_MASKS, cases, fuzz, step_inputs


def mask_inputs(token_mask, case) -> dict:
    given_ = {"logp": case.logp.detach(), "old_logp": case.old_logp, "adv": case.adv, "entropy": case.entropy}
    given_ |= step_inputs(case)
    return {name: given_[name] for name in token_mask.requires}


@fuzz(60)
@given(case=st.booleans().flatmap(lambda token_adv: cases(token_adv=token_adv)), token_mask=TOKEN_MASKS)
def test_a_mask_keeps_a_subset_of_the_real_tokens_whatever_the_padding_holds(case, token_mask):
    keep, metrics = token_mask(case.mask, **mask_inputs(token_mask, case))
    assert keep.shape == case.mask.shape and keep.dtype == torch.bool and not keep.requires_grad
    assert not keep[case.padding].any()
    check_metrics(metrics)


@fuzz()
@given(case=cases(token_adv=True), threshold=st.floats(1e-3, 2.0))
def test_off_policy_sequence_mask_matches_its_formula(case, threshold):
    keep, _ = OffPolicySequenceMask(threshold=threshold)(case.mask, **mask_inputs(OffPolicySequenceMask, case))
    real = case.mask.bool()
    log_ratio = torch.where(real, case.old_logp.double() - case.logp.detach().double(), 0.0)
    kl = log_ratio.sum(-1) / case.mask.sum(-1).clamp_min(1)  # [B] in float64
    rows = (kl - threshold).abs() > 1e-5  # float32 and float64 may disagree right at the threshold
    expected = real & ~((case.adv < 0) & (kl > threshold)[:, None])
    assert torch.equal(keep[rows], expected[rows])


@fuzz()
@given(case=cases(), bound=st.floats(1e-4, 1.0))
def test_second_moment_mask_keeps_the_most_it_can_within_the_bound(case, bound):
    inputs = mask_inputs(SecondMomentMask, case)
    keep, metrics = SecondMomentMask(bound=bound)(case.mask, **inputs)
    d2 = (inputs["train_logp"].double() - inputs["rollout_logp"].double()) ** 2
    kept, dropped = d2[keep], d2[case.mask.bool() & ~keep]
    if len(kept):
        assert kept.mean() <= bound * (1 + 1e-12), "the kept second moment is within the bound"
    if len(kept) and len(dropped):
        assert dropped.min() >= kept.max(), "only the most extreme tokens are dropped"
    if len(dropped):  # minimal: keeping one more (the mildest dropped) would break the bound
        assert (kept.sum() + dropped.min()) / (len(kept) + 1) > bound * (1 - 1e-12)
    assert math.isclose(metrics["mask/m2_frac"].item() * case.mask.sum().item(), len(dropped), abs_tol=1e-3)


@fuzz()
@given(case=cases(), low=st.floats(0.05, 1.0), high=st.floats(1.0, 20.0))
def test_mismatch_band_keeps_exactly_the_tokens_inside(case, low, high):
    inputs = mask_inputs(MismatchBandMask, case)
    keep, _ = MismatchBandMask(low=low, high=high)(case.mask, **inputs)
    log_k = (inputs["train_logp"].double() - inputs["rollout_logp"].double()).nan_to_num(0.0)
    far = ((log_k - math.log(low)).abs() > 1e-5) & ((log_k - math.log(high)).abs() > 1e-5)
    expected = case.mask.bool() & (log_k >= math.log(low)) & (log_k <= math.log(high))
    assert torch.equal(keep[far], expected[far])


@fuzz()
@given(case=cases(), quantile=st.floats(0.0, 1.0))
def test_high_entropy_mask_keeps_the_top_entropies(case, quantile):
    keep, metrics = HighEntropyMask(quantile=quantile)(case.mask, entropy=case.entropy)
    real = case.mask.bool()
    kept, dropped = case.entropy[keep], case.entropy[real & ~keep]
    if len(kept) and len(dropped):
        assert kept.min() > dropped.max(), "every kept token is more uncertain than every dropped one"
    if real.any():
        assert len(kept) >= 1, "at least the most uncertain token stays"
        # at least the top fraction stays (ties and interpolation may keep a few more)
        assert len(kept) >= math.floor(quantile * (real.sum().item() - 1)) + 1 - 1e-9
        assert metrics["mask/entropy_threshold"] <= kept.min()
