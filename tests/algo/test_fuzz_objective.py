"""Fuzz: the policy objective, KL/entropy terms, rollout correction, weighting and fused log-probs.

Hypothesis feeds random shapes, masks (empty and full rows), rewards and log-ratios; see strategies.py."""

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from torch import Tensor

from gpo.algo import (
    ALGORITHMS,
    AdaptiveEntropy,
    EntropyBonus,
    HighEntropyMask,
    KLPenalty,
    NoGate,
    OverlongFilter,
    ReferenceProbWeight,
    RolloutCorrection,
    TeacherKL,
    TokenMean,
    kl_estimate,
    linear_token_logprobs,
    mismatch_metrics,
    preset,
    token_logprobs,
)
from gpo.algo.objective import PolicyObjective
from tests.algo.fuzz_checks import check_metrics, check_padding_never_leaks, grad, real_log_ratio
from tests.algo.strategies import (
    AGGREGATORS,
    ALL_GATES,
    MAX_TOKENS,
    ROW_MASKS,
    cases,
    fill_padding,
    fuzz,
    gate_inputs,
    make_case,
    row_splits,
    split_rows,
    step_inputs,
)

# ---------------------------------------------------------------------------------------------- policy objective

KL_PENALTIES = st.one_of(
    st.none(),
    st.builds(
        KLPenalty,
        beta=st.sampled_from([0.0, 0.04, 1.0]),
        estimator=st.sampled_from(["k1", "k2", "k3"]),
        placement=st.sampled_from(["loss", "reward"]),
    ),
)
ENTROPY_BONUSES = st.one_of(st.none(), st.builds(EntropyBonus, coef=st.sampled_from([0.0, 0.01, 1.0])))
CORRECTIONS = st.one_of(
    st.none(),
    st.builds(
        RolloutCorrection,
        mode=st.sampled_from(["tis", "mis"]),
        level=st.sampled_from(["token", "sequence"]),
        cap=st.floats(0.5, 5),
    ),
)


@fuzz(40)
@given(
    data=st.data(),
    case=cases(),
    gate=ALL_GATES,
    aggregator=AGGREGATORS,
    kl=KL_PENALTIES,
    entropy=ENTROPY_BONUSES,
    correction=CORRECTIONS,
)
def test_policy_objective_composes_its_parts_and_micro_batches_add_up(
    data, case, gate, aggregator, kl, entropy, correction
):
    objective = PolicyObjective(gate, aggregator, kl=kl, entropy=entropy)
    if objective.kl is not None:  # non-finite padding through the KL term: test_kl_loss_term_gradient_*
        case.logp = fill_padding(case.logp.detach(), case.mask, 30.0).requires_grad_(True)
        case.ref_logp = fill_padding(case.ref_logp, case.mask, -30.0)
    extra = gate_inputs(gate, case)
    weight = correction(case.logp.detach(), case.old_logp, case.mask)[0] if correction else None
    inputs = {"ref_logp": case.ref_logp, "entropy": case.entropy, "weight": weight}
    loss, metrics = objective(case.logp, case.old_logp, case.adv, case.mask, **inputs, **extra)
    check_metrics(metrics, gate)
    check_padding_never_leaks(loss, case)

    # loss = aggregate(w (gate + beta KL - c H))
    per_token, _ = gate(case.logp, case.old_logp, case.adv, case.mask, **extra)
    if objective.kl is not None:
        per_token = per_token + kl.loss_term(case.logp, case.ref_logp, case.mask)[0]
    if objective.entropy is not None:
        per_token = per_token + entropy.loss_term(case.entropy, case.mask)
    weighted = per_token * (1 if weight is None else weight)
    expected = aggregator(weighted, case.mask)
    torch.testing.assert_close(loss, expected)

    # micro-batches with the step's normaliser: the losses and the accumulated gradients add up
    normaliser = aggregator.normaliser(case.mask)
    total, accumulated = torch.zeros(()), torch.zeros_like(case.logp)
    for rows in data.draw(row_splits(case.mask.shape[0])):
        part_inputs = {key: None if value is None else value[rows] for key, value in inputs.items()}
        part, _ = objective(
            case.logp[rows],
            case.old_logp[rows],
            case.adv[rows],
            case.mask[rows],
            normaliser,
            **part_inputs,
            **split_rows(extra, rows),
        )
        total, accumulated = total + part.detach(), accumulated + grad(part, case.logp)
    # float32 rounding of terms that cancel is relative to the terms' size, not to their sum (advantages of 2e5 and
    # -3e5 once summed to 186 with parts 0.05 apart): the bound is the aggregate of the terms' magnitudes, which is
    # the loss's own size when nothing cancels (|aggregate(x)| <= aggregate(|x|))
    magnitude = aggregator(weighted.detach().abs(), case.mask)
    torch.testing.assert_close(total, loss.detach(), rtol=1e-5, atol=1e-5 * (1 + magnitude.item()))
    full = grad(loss, case.logp)
    torch.testing.assert_close(accumulated, full, rtol=1e-5, atol=1e-6 * (1 + full.abs().max().item()))


@pytest.mark.parametrize("name", ALGORITHMS)
@fuzz(15)
@given(case=cases())
def test_every_preset_runs_end_to_end_without_leaking_padding(name, case):
    algo = preset(name).parts(max_new_tokens=MAX_TOKENS)
    adv = algo.advantage(case.reward, case.group, case.mask)
    loss, metrics = algo.gate(case.logp, case.old_logp, adv, case.mask, **gate_inputs(algo.gate, case))
    check_metrics(metrics, algo.gate)
    check_padding_never_leaks(algo.aggregator(loss, case.mask), case)


# ---------------------------------------------------------------------------------------------- regularizers


ESTIMATORS = ["k1", "k2", "k3", "k3+"]


@pytest.mark.parametrize("estimator", ESTIMATORS)
@fuzz()
@given(case=cases())
def test_kl_estimates_follow_their_formulas(estimator, case):
    real = case.mask.bool()
    logp = case.logp[real]
    ref = case.ref_logp[real]
    k = kl_estimate(logp, ref, estimator)
    assert k.shape == logp.shape and torch.isfinite(k).all()
    d = (logp.detach() - ref).double()
    formula = {"k1": d, "k2": d**2 / 2, "k3": torch.expm1(-d) + d, "k3+": torch.expm1(-d) + d}[estimator]
    torch.testing.assert_close(k.double(), formula, rtol=1e-5, atol=1e-5)
    if estimator != "k1":
        assert (k >= 0).all(), "k2 and k3 are never negative"
    slope = {"k1": torch.ones_like(d), "k2": d, "k3": 1 - torch.exp(-d), "k3+": d}[estimator]  # d k / d logp
    if len(logp):
        torch.testing.assert_close(grad(k.sum(), case.logp)[real].double(), slope, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("estimator", ESTIMATORS)
@fuzz()
@given(case=cases(), bound=st.floats(0.05, 20))
def test_a_bounded_estimate_is_clamped_and_flat_past_the_bound_except_k3_plus(estimator, case, bound):
    real = case.mask.bool()
    k = kl_estimate(case.logp[real], case.ref_logp[real], estimator, bound)
    d = (case.logp.detach() - case.ref_logp).double()[real]
    free = {"k1": d, "k2": d**2 / 2, "k3": torch.expm1(-d) + d, "k3+": torch.expm1(-d) + d}[estimator]
    torch.testing.assert_close(k.double(), free.clamp(-bound, bound), rtol=1e-5, atol=1e-5)
    slope = {"k1": torch.ones_like(d), "k2": d, "k3": 1 - torch.exp(-d), "k3+": d}[estimator]
    if estimator != "k3+":
        slope = torch.where(free.abs() > bound, 0.0, slope)
    far = (free.abs() - bound).abs() > 1e-4 * (1 + bound)  # float32 may land on either side of the bound
    if len(d):
        g = grad(k.sum(), case.logp)[real].double()
        torch.testing.assert_close(g[far], slope[far], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("estimator", ESTIMATORS)
@fuzz()
@given(case=cases(), beta=st.floats(0.01, 2))
def test_importance_corrected_term_is_the_ratio_times_the_estimate(estimator, case, beta):
    penalty = KLPenalty(beta=beta, estimator=estimator, importance_corrected=True)
    case.logp = fill_padding(case.logp.detach(), case.mask, math.nan).requires_grad_(True)
    term, metrics = penalty.loss_term(case.logp, case.ref_logp, case.mask, old_logp=case.old_logp)
    check_metrics(metrics)
    check_padding_never_leaks(term.sum(), case)
    real = case.mask.bool()
    # in float64 from the float32 inputs, as the corrected term computes them: near r (k + slope) = 0 (k2 at d = -2)
    # a float32 difference is off by 1e-3 relative
    logp = case.logp.detach().double()
    d = (logp - case.ref_logp.double())[real]
    r = (logp - case.old_logp.double()).exp()[real]
    k = {"k1": d, "k2": d**2 / 2, "k3": torch.expm1(-d) + d, "k3+": torch.expm1(-d) + d}[estimator]
    slope = {"k1": torch.ones_like(d), "k2": d, "k3": 1 - torch.exp(-d), "k3+": d}[estimator]
    torch.testing.assert_close(term.double()[real], beta * r * k, rtol=1e-4, atol=1e-5)
    # d (r k) / d logp = r k + r dk/dlogp; for k3 that is r d, the importance-weighted true-KL gradient
    expected = beta * r * (k + slope)
    torch.testing.assert_close(grad(term.sum(), case.logp)[real].double(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("estimator", ESTIMATORS)
@fuzz()
@given(case=cases(), beta=st.floats(0, 2))
def test_kl_penalty_terms_are_masked_and_finite(estimator, case, beta):
    penalty = KLPenalty(beta=beta, estimator=estimator)
    term, metrics = penalty.loss_term(case.logp, case.ref_logp, case.mask)
    real = case.mask.bool()
    assert term.shape == case.mask.shape and torch.isfinite(term).all() and (term[~real] == 0).all()
    torch.testing.assert_close(term[real], beta * kl_estimate(case.logp[real], case.ref_logp[real], estimator))
    check_metrics(metrics)
    reward = penalty.reward_penalty(case.logp, case.ref_logp, case.mask)
    assert reward.shape == (case.mask.shape[0],) and torch.isfinite(reward).all() and not reward.requires_grad
    torch.testing.assert_close(reward, -term.detach().sum(-1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("estimator", ESTIMATORS)
@fuzz()
@given(case=cases())
@example(case=make_case(mask=[[1.0, 0.0]], logp=[[-1.0, math.nan]], old_logp=[[-1.5, -1.0]]))
def test_kl_loss_term_gradient_never_leaks_padding(estimator, case):
    term, _ = KLPenalty(beta=0.1, estimator=estimator).loss_term(case.logp, case.ref_logp, case.mask)
    check_padding_never_leaks(term.sum(), case)


@fuzz()
@given(case=cases(), coef=st.floats(0, 2))
def test_entropy_bonus_is_minus_coef_times_entropy_on_real_tokens(case, coef):
    term = EntropyBonus(coef=coef).loss_term(case.entropy, case.mask)
    real = case.mask.bool()
    assert torch.isfinite(term).all() and (term[~real] == 0).all() and (term <= 0).all()
    torch.testing.assert_close(term[real], -coef * case.entropy[real])


def trl_adaptive_entropy(entropies, target, step, initial, low, high):
    """The coefficient TRL applies at each step, written as TRL's trainer writes it (float64)."""
    coef, last, applied = initial, math.inf, []
    for entropy in entropies:
        applied.append(coef if last <= target else 0.0)
        coef = min(coef + step, high) if entropy <= target else max(coef - step, low)
        last = entropy
    return applied


@fuzz()
@given(
    entropies=st.lists(st.floats(0, 5), max_size=30),
    target=st.floats(0.1, 4),
    step=st.floats(1e-3, 0.2),
    bounds=st.tuples(st.floats(0, 0.5), st.floats(0, 0.5), st.floats(0, 0.5)).map(sorted),
)
def test_adaptive_entropy_applies_the_coefficient_trl_would(entropies, target, step, bounds):
    low, initial, high = bounds
    bonus = EntropyBonus(adaptive=AdaptiveEntropy(target=target, step=step, initial_coef=initial, min_coef=low,
                                                  max_coef=high))  # fmt: skip
    applied = []
    for entropy in entropies:
        applied.append(bonus.current)
        assert low <= bonus.adaptive.value <= high
        bonus.observe(entropy)
    assert applied == pytest.approx(trl_adaptive_entropy(entropies, target, step, initial, low, high))


KL_CONTROLS = st.builds(
    KLPenalty,
    beta=st.sampled_from([0.04, 1.0]),
    estimator=st.sampled_from(ESTIMATORS),
    importance_corrected=st.booleans(),
    bound=st.sampled_from([None, 10.0, 0.5]),
)


@fuzz(40)
@given(
    data=st.data(),
    case=st.booleans().flatmap(lambda token_adv: cases(token_adv=token_adv)),
    gate=ALL_GATES,
    aggregator=AGGREGATORS,
    masks=st.lists(ROW_MASKS, max_size=3),
    kl=st.one_of(st.none(), KL_CONTROLS),
    distill=st.one_of(st.none(), st.builds(TeacherKL, coef=st.floats(0.1, 2), replace=st.booleans())),
)
def test_policy_objective_with_masks_and_distillation_composes_and_micro_batches_add_up(
    data, case, gate, aggregator, masks, kl, distill
):
    objective = PolicyObjective(gate, aggregator, kl=kl, masks=masks, distill=distill)
    if objective.kl is not None:  # non-finite padding through the KL term: test_importance_corrected_term_*
        case.logp = fill_padding(case.logp.detach(), case.mask, 30.0).requires_grad_(True)
        case.ref_logp = fill_padding(case.ref_logp, case.mask, -30.0)
    extra, fixed = gate_inputs(gate, case), step_inputs(case)
    mask, step_metrics = objective.step_mask(case.mask, case.adv, **fixed)
    assert ((mask == 0) | (case.mask == 1)).all(), "a step mask only removes tokens"
    inputs = {"ref_logp": case.ref_logp, **fixed}  # every step input, as the trainer hands them to each pass
    loss, metrics = objective(case.logp, case.old_logp, case.adv, mask, **inputs, **extra)
    check_metrics({**step_metrics, **metrics}, gate)
    check_padding_never_leaks(loss, case)

    # loss = aggregate(gate over the kept tokens of A' + beta KL over the mask), over the step-masked normaliser
    adv = case.adv if distill is None else distill(case.adv, case.logp, mask, teacher_logp=fixed["teacher_logp"])[0]
    pass_inputs = {"logp": case.logp.detach(), "old_logp": case.old_logp, "adv": adv, **fixed}
    kept = mask
    for token_mask in objective.update_masks:
        keep, _ = token_mask(kept, **{name: pass_inputs[name] for name in token_mask.requires})
        kept = kept * keep
    per_token, _ = gate(case.logp, case.old_logp, adv, kept, **extra)
    if objective.kl is not None:
        per_token = per_token + kl.loss_term(case.logp, case.ref_logp, mask, old_logp=case.old_logp)[0]
    torch.testing.assert_close(loss, aggregator(per_token, mask))

    # per-row masks and step masks: micro-batches with the step's normaliser add up to the whole
    normaliser = aggregator.normaliser(mask)
    total, accumulated = torch.zeros(()), torch.zeros_like(case.logp)
    for rows in data.draw(row_splits(case.mask.shape[0])):
        part, _ = objective(
            case.logp[rows], case.old_logp[rows], case.adv[rows], mask[rows], normaliser,
            **{key: value[rows] for key, value in inputs.items()}, **split_rows(extra, rows),
        )  # fmt: skip
        total, accumulated = total + part.detach(), accumulated + grad(part, case.logp)
    scale = 1e-5 * (1 + loss.detach().abs())
    torch.testing.assert_close(total, loss.detach(), rtol=1e-5, atol=scale.item())
    full = grad(loss, case.logp)
    torch.testing.assert_close(accumulated, full, rtol=1e-5, atol=1e-6 * (1 + full.abs().max().item()))


@fuzz()
@given(case=cases(), gate=ALL_GATES, aggregator=AGGREGATORS, quantile=st.floats(0, 1))
def test_high_entropy_mask_in_the_objective_never_leaks_padding(case, gate, aggregator, quantile):
    objective = PolicyObjective(gate, aggregator, masks=[HighEntropyMask(quantile=quantile)])
    loss, metrics = objective(case.logp, case.old_logp, case.adv, case.mask, entropy=case.entropy,
                              **gate_inputs(gate, case))  # fmt: skip
    check_metrics(metrics, gate)
    check_padding_never_leaks(loss, case)


# ---------------------------------------------------------------------------------------------- correction, weighting


@fuzz()
@given(
    case=cases(),
    mode=st.sampled_from(["tis", "mis"]),
    level=st.sampled_from(["token", "sequence"]),
    cap=st.floats(0.1, 10),
)
def test_rollout_correction_weight_is_a_masked_constant_in_its_band(case, mode, level, cap):
    weight, metrics = RolloutCorrection(mode=mode, level=level, cap=cap)(case.logp, case.old_logp, case.mask)
    real = case.mask.bool()
    assert weight.shape == case.mask.shape and not weight.requires_grad
    assert torch.isfinite(weight).all() and (weight[~real] == 0).all()
    check_metrics(metrics)
    diff = real_log_ratio(case).double()  # log(pi_train / pi_rollout)
    if level == "sequence":
        diff = diff.sum(-1, keepdim=True).expand_as(diff)
    w = diff.exp()
    expected = w.clamp(max=cap) if mode == "tis" else w * (w <= cap)  # MIS keeps w where it is within the cap
    near_cap = (diff - math.log(cap)).abs() < 1e-4  # float32 may round either way at the cap
    keep = real & ~near_cap
    torch.testing.assert_close(weight.double()[keep], (expected * case.mask)[keep], rtol=1e-4, atol=1e-6)


@fuzz()
@given(case=cases())
def test_mismatch_metrics_are_ordered_and_non_negative(case):
    metrics = mismatch_metrics(case.logp, case.old_logp, case.mask)
    check_metrics(metrics)
    assert metrics["mismatch/abs_diff_max"] >= metrics["mismatch/abs_diff_mean"] - 1e-6
    assert metrics["mismatch/abs_diff_mean"] >= 0 and metrics["mismatch/kl"] >= 0
    real = case.mask.bool()
    d = (case.old_logp - case.logp.detach()).double()[real]  # rollout - train
    expected = (torch.expm1(-d) + d).mean().item() if len(d) else 0.0
    assert metrics["mismatch/kl"].item() == pytest.approx(expected, rel=1e-4, abs=1e-6)


@fuzz()
@given(case=cases(), data=st.data(), dtype=st.sampled_from([torch.float32, torch.bool, torch.int64]))
def test_overlong_filter_zeroes_exactly_the_truncated_rows(case, data, dtype):
    truncated = torch.tensor(data.draw(st.lists(st.booleans(), min_size=len(case.labels), max_size=len(case.labels))))
    mask = case.mask.to(dtype)
    out = OverlongFilter()(mask, truncated=truncated)
    assert out.shape == mask.shape and out.dtype == dtype
    assert (out[truncated] == 0).all() and torch.equal(out[~truncated], mask[~truncated])


@fuzz()
@given(case=cases(token_adv=True))
def test_reference_prob_weight_shrinks_the_advantage_towards_zero(case):
    adv = fill_padding(case.adv, case.mask, math.nan)
    objective = PolicyObjective(NoGate(), TokenMean(), token_weights=[ReferenceProbWeight()])
    out = objective.weigh(adv, case.mask, ref_logp=case.ref_logp)
    real = case.mask.bool()
    assert torch.isfinite(out).all() and (out[~real] == 0).all()
    expected = case.adv.double() * (1 - case.ref_logp.double().exp())
    torch.testing.assert_close(out.double()[real], expected[real], rtol=1e-5, atol=1e-6)
    assert (out.abs() <= case.adv.abs()).all() and (out * case.adv >= 0).all()


# ---------------------------------------------------------------------------------------------- logprobs


def naive_logprobs(logits: Tensor, tokens: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    full = torch.log_softmax(logits.double() / temperature, dim=-1)
    index = tokens if tokens.dim() == logits.dim() else tokens[..., None]
    logp = full.gather(-1, index)
    return (logp if tokens.dim() == logits.dim() else logp[..., 0]), -(full.exp() * full).sum(-1)


@fuzz(60)
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 6), st.integers(2, 12)),
    topk=st.one_of(st.none(), st.integers(1, 3)),
    with_bias=st.booleans(),
    with_entropy=st.booleans(),
    fused=st.booleans(),
    temperature=st.floats(0.3, 2.0),
    chunk_size=st.one_of(st.none(), st.integers(1, 5)),
    scale=st.sampled_from([0.1, 1.0, 3.0]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_chunked_logprobs_match_a_naive_float64_log_softmax(
    shape, topk, with_bias, with_entropy, fused, temperature, chunk_size, scale, dtype, seed
):
    rows, positions, hidden_size, vocab = shape
    gen = torch.Generator().manual_seed(seed)
    hidden = (scale * torch.randn(rows, positions, hidden_size, generator=gen)).to(dtype).requires_grad_(True)
    weight = torch.randn(vocab, hidden_size, generator=gen).to(dtype).requires_grad_(True)
    bias = torch.randn(vocab, generator=gen).to(dtype).requires_grad_(True) if with_bias else None
    k = min(topk, vocab) if topk else None
    index_shape = (rows, positions, k) if k else (rows, positions)
    tokens = torch.randint(0, vocab, index_shape, generator=gen)
    options = {"temperature": temperature, "with_entropy": with_entropy, "chunk_size": chunk_size}
    if fused:
        out = linear_token_logprobs(hidden, weight, tokens, bias=bias, **options)
    else:
        out = token_logprobs(torch.nn.functional.linear(hidden, weight, bias), tokens, **options)
    logits = torch.nn.functional.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
    ref_logp, ref_entropy = naive_logprobs(logits, tokens, temperature)
    assert out.logp.shape == tokens.shape and out.logp.dtype == torch.float32
    torch.testing.assert_close(out.logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
    leaves = [x for x in (hidden, weight, bias) if x is not None]
    g = torch.randn(index_shape, generator=gen, dtype=torch.float64)
    fused_value, ref_value = (out.logp.double() * g).sum(), (ref_logp * g).sum()
    if with_entropy:
        assert out.entropy.shape == (rows, positions)
        torch.testing.assert_close(out.entropy.double(), ref_entropy, rtol=1e-5, atol=1e-4)
        g_entropy = torch.randn(rows, positions, generator=gen, dtype=torch.float64)
        fused_value, ref_value = (
            fused_value + (out.entropy.double() * g_entropy).sum(),
            ref_value + (ref_entropy * g_entropy).sum(),
        )
    else:
        assert out.entropy is None
    for fused_grad, ref_grad in zip(
        torch.autograd.grad(fused_value, leaves), torch.autograd.grad(ref_value, leaves), strict=True
    ):
        torch.testing.assert_close(fused_grad.double(), ref_grad.double(), rtol=1e-4, atol=1e-4)
