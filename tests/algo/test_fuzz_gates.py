"""Fuzz: every ratio gate and loss aggregator is finite, leak-free and true to its gradient formula.

Hypothesis feeds random shapes, masks (empty and full rows), rewards and log-ratios; see strategies.py."""

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from torch import Tensor

from gpo.algo import (
    CISPOGate,
    ClipGate,
    DivergenceMaskGate,
    DROGate,
    GeometricMeanGate,
    RouterShiftGate,
    SequenceClipGate,
    SequenceMean,
    SequenceSum,
    SoftGate,
    TokenMean,
    VESPOGate,
    router_logprobs,
    router_shift_weight,
)
from tests.algo.fuzz_checks import (
    TINY,
    assert_within,
    check_metrics,
    check_padding_never_leaks,
    grad,
    real_log_ratio,
    token_weight,
)
from tests.algo.strategies import (
    AGGREGATORS,
    ALL_GATES,
    CLIP,
    PER_TOKEN_GATES,
    POSITIVE,
    cases,
    fuzz,
    gate_inputs,
    make_case,
    row_splits,
)

# ---------------------------------------------------------------------------------------------- gates


@fuzz(60)
@given(case=st.booleans().flatmap(lambda token_adv: cases(token_adv=token_adv)), gate=ALL_GATES, aggregator=AGGREGATORS)
def test_gate_is_finite_and_padding_never_leaks(case, gate, aggregator):
    loss, metrics = gate(case.logp, case.old_logp, case.adv, case.mask, **gate_inputs(gate, case))
    assert loss.shape == case.mask.shape
    assert torch.isfinite(loss).all() and (loss[case.padding] == 0).all(), loss
    check_metrics(metrics, gate)
    check_padding_never_leaks(aggregator(loss, case.mask), case)


@fuzz(60)
@given(
    gate_case=st.one_of(st.tuples(PER_TOKEN_GATES, cases(token_adv=True)), st.tuples(ALL_GATES, cases())),
    aggregator=AGGREGATORS,
)
def test_every_gate_gives_the_reinforce_gradient_at_ratio_one(gate_case, aggregator):
    # pi == pi_old (and an unchanged router): -A_t times the aggregation weight of token t
    gate, case = gate_case
    loss, _ = gate(case.logp, case.logp.detach(), case.adv, case.mask, **gate_inputs(gate, case, same_router=True))
    expected = -case.adv.double() * token_weight(aggregator, case.mask)
    g = grad(aggregator(loss, case.mask), case.logp).double()
    torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-7 * expected.abs().max().item() + TINY)


@fuzz()
@given(
    case=cases(token_adv=True),
    gate=st.builds(ClipGate, clip_low=CLIP, clip_high=CLIP, dual_clip=st.one_of(st.none(), st.floats(1.5, 10))),
)
def test_clip_gate_passes_no_gradient_where_a_bound_is_active(case, gate):
    loss, metrics = gate(case.logp, case.old_logp, case.adv, case.mask)
    r, a, real = real_log_ratio(case).exp(), case.adv, case.mask.bool()
    low = (a < 0) & (r < 1 - gate.clip_low)
    high = (a > 0) & (r > 1 + gate.clip_high)
    dual = (a < 0) & (r > gate.dual_clip) if gate.dual_clip is not None else torch.zeros_like(real)
    expected = torch.where(low | high | dual | ~real, torch.zeros_like(r), -a * r)
    torch.testing.assert_close(grad(loss.sum(), case.logp), expected)
    tokens = real.sum().clamp_min(1)
    assert metrics["clip/low_frac"].item() == pytest.approx(((low & real).sum() / tokens).item())
    assert metrics["clip/high_frac"].item() == pytest.approx(((high & real).sum() / tokens).item())


@fuzz()
@given(case=cases(token_adv=True), clip_low=CLIP, clip_high=CLIP, above=st.floats(0.0, 10.0))
def test_intellect2_delta_clipping_is_the_dual_clip_at_delta(case, clip_low, clip_high, above):
    # TRL's delta / INTELLECT-2: -min(min(r, delta) A, clip(r, 1 - lo, 1 + hi) A), written in float64, delta >= 1 + hi
    delta = 1 + clip_high + above
    loss, _ = ClipGate(clip_low=clip_low, clip_high=clip_high, dual_clip=delta)(
        case.logp, case.old_logp, case.adv, case.mask
    )
    log_r = real_log_ratio(case).double().requires_grad_(True)
    r, a = log_r.exp(), case.adv.double()
    reference = -torch.minimum(r.clamp(max=delta) * a, r.clamp(1 - clip_low, 1 + clip_high) * a) * case.mask
    torch.testing.assert_close(loss.double(), reference.detach(), rtol=1e-5, atol=1e-6 * (1 + a.abs().max().item()))
    log_ratio = real_log_ratio(case).double()
    far = ((log_ratio - math.log(delta)).abs() > 1e-5) & ((log_ratio - math.log(1 + clip_high)).abs() > 1e-5)
    far &= (log_ratio - math.log(1 - clip_low)).abs() > 1e-5  # off every kink: float32 may pick either side
    expected = torch.autograd.grad(reference.sum(), log_r)[0]  # d/dlogp = d/dlog r
    g = grad(loss.sum(), case.logp).double()
    torch.testing.assert_close(g[far], expected[far], rtol=1e-5, atol=1e-6 * (1 + (a * r).abs().max().item()))


@fuzz()
@given(case=cases(token_adv=True), beta=POSITIVE)
def test_dro_gradient_is_the_advantage_minus_beta_log_ratio(case, beta):
    loss, metrics = DROGate(beta=beta)(case.logp, case.old_logp, case.adv, case.mask)
    log_ratio = real_log_ratio(case).double()
    expected = -(case.adv.double() - beta * log_ratio) * case.mask
    atol = 1e-6 * (1 + case.adv.abs().max().item() + beta * 20)
    torch.testing.assert_close(grad(loss.sum(), case.logp).double(), expected, rtol=1e-5, atol=atol)
    penalty = (0.5 * beta * log_ratio**2 * case.mask).sum() / case.mask.sum().clamp_min(1)
    assert metrics["dro/penalty_mean"].item() == pytest.approx(penalty.item(), rel=1e-5, abs=1e-6)


@fuzz()
@given(case=cases(token_adv=True), gate=st.builds(CISPOGate, clip_low=CLIP, clip_high=CLIP))
def test_cispo_gradient_is_the_clipped_weight_on_every_token(case, gate):
    loss, _ = gate(case.logp, case.old_logp, case.adv, case.mask)
    weight = real_log_ratio(case).exp().clamp(1 - gate.clip_low, 1 + gate.clip_high)
    torch.testing.assert_close(grad(loss.sum(), case.logp), -weight * case.adv * case.mask)


@fuzz()
@given(case=cases(token_adv=True), gate=st.builds(SoftGate, tau_pos=POSITIVE, tau_neg=POSITIVE))
def test_soft_gate_gradient_is_the_sech_squared_weight(case, gate):
    loss, _ = gate(case.logp, case.old_logp, case.adv, case.mask)
    r, a = real_log_ratio(case).double().exp(), case.adv.double()
    tau = torch.where(a > 0, gate.tau_pos, gate.tau_neg)
    expected = -a * torch.cosh(tau * (r - 1) / 2) ** -2 * r * case.mask
    # float32's sigmoid saturates: its s (1 - s) is off by about 1e-7 absolute
    assert_within(grad(loss.sum(), case.logp), expected, 1e-5 * expected.abs() + 1e-6 * (a * r).abs())


@fuzz()
@given(case=cases(), clip_low=CLIP, clip_high=CLIP)
def test_sequence_clip_gate_drops_whole_sequences_outside_the_band(case, clip_low, clip_high):
    gate = SequenceClipGate(clip_low=clip_low, clip_high=clip_high)
    loss, _ = gate(case.logp, case.old_logp, case.adv, case.mask)
    g = grad(SequenceMean()(loss, case.mask), case.logp).double()
    lengths = case.mask.sum(-1).double()
    s = (real_log_ratio(case).double().sum(-1) / lengths.clamp_min(1)).exp()  # [B]
    a = case.seq_adv.double()
    clipped = ((a > 0) & (s > 1 + clip_high)) | ((a < 0) & (s < 1 - clip_low))
    # -d/dlogp_t of (1/G) sum_i s_i A_i is -A_i s_i / (|o_i| G) on unclipped sequences
    expected = torch.where(clipped, 0.0, -a * s / lengths.clamp_min(1) / (lengths > 0).sum().clamp_min(1))
    at_a_bound = torch.isclose(s, torch.tensor(1 + clip_high, dtype=s.dtype), rtol=1e-4) | torch.isclose(
        s, torch.tensor(1 - clip_low, dtype=s.dtype), rtol=1e-4
    )
    rows = ~at_a_bound  # float32 and float64 may disagree on which side of a bound s lies
    torch.testing.assert_close(g[rows], (expected[:, None] * case.mask)[rows], rtol=1e-4, atol=TINY)
    # GSPO-token with a constant advantage per sequence: the same value, clipping and gradient
    token_gate = SequenceClipGate(clip_low=clip_low, clip_high=clip_high, per_token_advantage=True)
    token_loss, _ = token_gate(case.logp, case.old_logp, case.adv, case.mask)
    torch.testing.assert_close(token_loss, loss)
    torch.testing.assert_close(grad(SequenceMean()(token_loss, case.mask), case.logp).double(), g, rtol=1e-5, atol=TINY)


@fuzz()
@given(case=cases(), clip_low=CLIP, clip_high=CLIP)
def test_geometric_mean_gate_gives_clipped_tokens_no_gradient(case, clip_low, clip_high):
    gate = GeometricMeanGate(clip_low=clip_low, clip_high=clip_high)
    loss, metrics = gate(case.logp, case.old_logp, case.adv, case.mask)
    g = grad(SequenceMean()(loss, case.mask), case.logp).double()
    log_ratio, real = real_log_ratio(case), case.mask.bool()
    positive = (case.seq_adv > 0)[:, None]
    high, low = positive & (log_ratio > clip_high) & real, ~positive & (log_ratio < -clip_low) & real
    kept = torch.where(positive, log_ratio.clamp(max=clip_high), log_ratio.clamp(min=-clip_low)).double()
    lengths = case.mask.sum(-1).double().clamp_min(1)
    geomean = ((kept * case.mask).sum(-1) / lengths).exp()
    scale = -case.seq_adv.double() * geomean / lengths / (case.mask.sum(-1) > 0).sum().clamp_min(1)
    expected = torch.where(high | low | ~real, 0.0, scale[:, None])
    torch.testing.assert_close(g, expected, rtol=1e-4, atol=TINY)
    tokens = real.sum().clamp_min(1)
    assert metrics["clip/high_frac"].item() == pytest.approx((high.sum() / tokens).item())
    assert metrics["clip/low_frac"].item() == pytest.approx((((case.seq_adv < 0)[:, None] & low).sum() / tokens).item())


@fuzz()
@given(
    case=cases(), gate=st.builds(VESPOGate, k_pos=POSITIVE, lambda_pos=POSITIVE, k_neg=POSITIVE, lambda_neg=POSITIVE)
)
def test_vespo_gradient_is_the_kernel_weight_times_reinforce(case, gate):
    loss, _ = gate(case.logp, case.old_logp, case.adv, case.mask)
    log_w = real_log_ratio(case).double().sum(-1).clamp(-60, 60)  # [B]
    non_negative = case.seq_adv >= 0
    k = torch.where(non_negative, gate.k_pos, gate.k_neg).double()
    lam = torch.where(non_negative, gate.lambda_pos, gate.lambda_neg).double()
    phi = log_w.exp() ** k * torch.exp(lam * (1 - log_w.exp()))  # W^k exp(lambda (1 - W))
    expected = -phi[:, None] * case.adv.double()
    assert_within(grad(loss.sum(), case.logp), expected, 1e-4 * expected.abs())


@fuzz()
@given(
    case=cases(token_adv=True),
    gate=st.builds(
        DivergenceMaskGate,
        mode=st.sampled_from(["binary_tv", "binary_kl", "topk_tv", "topk_kl"]),
        threshold=st.floats(1e-3, 1.0),
    ),
)
def test_divergence_gate_drops_only_far_tokens_pushed_further(case, gate):
    extra = gate_inputs(gate, case)
    loss, metrics = gate(case.logp, case.old_logp, case.adv, case.mask, **extra)
    real = case.mask.bool()
    div = gate.divergence(case.logp.detach(), case.old_logp, extra.get("topk_logp"), extra.get("old_topk_logp"))
    # a divergence: never negative (up to float32 rounding when p == q)
    assert div.shape == case.mask.shape and (div[real] >= -1e-6).all(), div
    if gate.kind == "tv":
        assert (div[real] <= 1 + 1e-6).all(), div
    if gate.mode == "binary_tv":  # TV of the bins {token, rest} is |p - q|
        p, q = case.logp.detach().double().exp(), case.old_logp.double().exp()
        torch.testing.assert_close(div[real].double(), (p - q).abs()[real], rtol=1e-5, atol=1e-6)
    log_ratio, a = real_log_ratio(case), case.adv
    pushing_out = ((a > 0) & (log_ratio > 0)) | ((a < 0) & (log_ratio < 0))
    dropped = (div > gate.threshold) & pushing_out & real
    expected = torch.where(dropped | ~real, torch.zeros_like(a), -a * log_ratio.exp())
    torch.testing.assert_close(grad(loss.sum(), case.logp), expected)
    assert metrics["dppo/masked_frac"].item() == pytest.approx((dropped.sum() / real.sum().clamp_min(1)).item())


@fuzz(10)
@given(case=cases())
@example(case=make_case(mask=[[1.0]], logp=[[-0.5]], old_logp=[[0.0]], seq_adv=[1.0]))
def test_divergence_kl_metric_is_finite(case):
    _, metrics = DivergenceMaskGate(mode="binary_kl", threshold=0.1)(case.logp, case.old_logp, case.adv, case.mask)
    assert torch.isfinite(metrics["dppo/divergence_mean"])


@fuzz()
@given(
    case=cases(),
    gate=st.builds(
        RouterShiftGate, top_k=st.integers(1, 4), gamma_min=st.floats(0.01, 1.0), clip_low=CLIP, clip_high=CLIP
    ),
)
def test_router_shift_gate_weights_lie_in_their_band_and_reduce_to_gmpo(case, gate):
    extra = gate_inputs(gate, case)
    gamma = router_shift_weight(extra["router_logp"], extra["old_router_logp"], gate.top_k, gate.gamma_min)
    assert gamma.shape == case.mask.shape and not gamma.requires_grad
    real = gamma[case.mask.bool()]
    assert ((real >= gate.gamma_min) & (real <= 1)).all(), real
    # an unchanged router gives gamma = 1 and RSPO is GMPO
    same = gate_inputs(gate, case, same_router=True)
    assert (
        router_shift_weight(same["router_logp"], same["old_router_logp"], gate.top_k, 0.01)[case.mask.bool()] == 1
    ).all()
    rspo, _ = gate(case.logp, case.old_logp, case.adv, case.mask, **same)
    gmpo, _ = GeometricMeanGate(clip_low=gate.clip_low, clip_high=gate.clip_high)(
        case.logp, case.old_logp, case.adv, case.mask
    )
    torch.testing.assert_close(rspo, gmpo)


@fuzz()
@given(
    layers=st.integers(1, 3),
    rows=st.integers(1, 4),
    positions=st.integers(1, 5),
    experts=st.integers(1, 6),
    seed=st.integers(0, 99),
)
def test_router_logprobs_stacks_normalised_layers(layers, rows, positions, experts, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = [10 * torch.randn(rows * positions, experts, generator=gen) for _ in range(layers)]
    out = router_logprobs(logits, rows)
    assert out.shape == (layers, rows, positions, experts)
    torch.testing.assert_close(out.logsumexp(-1), torch.zeros(layers, rows, positions), atol=1e-5, rtol=0)
    torch.testing.assert_close(out[-1].reshape(-1, experts), logits[-1].log_softmax(-1))


# ---------------------------------------------------------------------------------------------- aggregators


def aggregate_float64(aggregator, x: Tensor, mask: Tensor) -> float:
    """The aggregator's docstring formula, one row at a time, in float64."""
    real = [x[i][mask[i] > 0].double() for i in range(mask.shape[0])]
    non_empty = [row for row in real if len(row)]
    if isinstance(aggregator, TokenMean):
        return sum(row.sum().item() for row in real) / max(1, sum(len(row) for row in real))
    if isinstance(aggregator, SequenceMean):
        return sum(row.mean().item() for row in non_empty) / max(1, len(non_empty))
    if isinstance(aggregator, SequenceSum):
        return sum(row.sum().item() for row in non_empty) / max(1, len(non_empty))
    return sum(row.sum().item() for row in real) / (mask.shape[0] * aggregator.max_length)


@fuzz(60)
@given(case=cases(), aggregator=AGGREGATORS)
def test_aggregator_matches_its_formula_and_ignores_padding(case, aggregator):
    per_token = case.ref_logp.clone().requires_grad_(True)  # [-25, 0] on real tokens, NaN/inf/30 on padding
    value = aggregator(per_token, case.mask)
    assert value.shape == () and torch.isfinite(value)
    assert value.item() == pytest.approx(aggregate_float64(aggregator, case.ref_logp, case.mask), rel=1e-5, abs=1e-5)
    g = grad(value, per_token)
    torch.testing.assert_close(g.double(), token_weight(aggregator, case.mask))


@fuzz(60)
@given(data=st.data(), case=cases(), aggregator=AGGREGATORS)
def test_aggregator_split_is_additive_over_micro_batches(data, case, aggregator):
    x, mask = case.ref_logp, case.mask
    parts = data.draw(row_splits(mask.shape[0]))
    normaliser = aggregator.normaliser(mask)
    assert torch.equal(sum(aggregator.normaliser(mask[rows]) for rows in parts), normaliser)
    numerator = sum(aggregator.numerator(x[rows], mask[rows]) for rows in parts)
    torch.testing.assert_close(numerator, aggregator.numerator(x, mask), rtol=1e-5, atol=1e-4)
    total = sum(aggregator(x[rows], mask[rows], normaliser) for rows in parts)
    torch.testing.assert_close(total, aggregator(x, mask), rtol=1e-5, atol=1e-5)
