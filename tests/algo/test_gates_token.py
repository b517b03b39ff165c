"""Token-level gates against float64 references written token by token, for value and gradient."""

import math

import pytest
import torch

from gpo.algo import CISPOGate, ClipGate, DROGate, NoGate, SequenceMean, SoftGate, TokenMean


def grad_of(loss_sum, logp):
    (grad,) = torch.autograd.grad(loss_sum, logp, retain_graph=True)
    return grad


def reference_token_loss(batch, term):
    """Sum over real tokens of ``term(logp_t, old_logp_t, A)``, built one scalar at a time."""
    total = torch.zeros((), dtype=torch.float64)
    for i, positions in batch.rows():
        for t in positions:
            total = total + term(batch.logp[i, t], batch.old_logp[i, t], batch.seq_adv[i].item())
    return total


def check_against_reference(gate, batch, term):
    loss, metrics = gate(batch.logp, batch.old_logp, batch.adv, batch.mask)
    assert loss.shape == batch.logp.shape
    assert torch.all(loss[batch.mask == 0] == 0)
    ref = reference_token_loss(batch, term)
    torch.testing.assert_close(loss.sum(), ref)
    torch.testing.assert_close(grad_of(loss.sum(), batch.logp), grad_of(ref, batch.logp))
    return loss, metrics


def test_no_gate_is_minus_logp_times_advantage(batch):
    check_against_reference(NoGate(), batch, lambda lp, old, a: -a * lp)


def test_clip_gate_value_and_gradient(batch):
    lo, hi = 0.2, 0.28

    def term(lp, old, a):
        r = torch.exp(lp - old)
        return -torch.minimum(r * a, torch.clamp(r, 1 - lo, 1 + hi) * a)

    loss, metrics = check_against_reference(ClipGate(clip_low=lo, clip_high=hi), batch, term)
    # Hand-derived gradient: d loss_t / d logp_t = -A r_t where the unclipped branch is active, else 0.
    r = torch.exp(batch.logp - batch.old_logp).detach()
    a = batch.adv
    active = ((a > 0) & (r < 1 + hi)) | ((a < 0) & (r > 1 - lo))
    expected = torch.where(active & (batch.mask > 0), -a * r, torch.zeros_like(r))
    torch.testing.assert_close(grad_of(loss.sum(), batch.logp), expected)
    # low-clipped tokens (A < 0, r < 0.8): row 1 log-ratios -0.3 and -0.9, row 4 -0.45 -> 3 of 15 real tokens
    assert metrics["clip/low_frac"].item() == pytest.approx(3 / 15)
    # high-clipped (A > 0, r > 1.28): row 0 log-ratio 0.35 -> 1 of 15
    assert metrics["clip/high_frac"].item() == pytest.approx(1 / 15)


def test_dual_clip_bounds_negative_advantage_objective(batch):
    lo, hi, c = 0.2, 0.2, 3.0

    def term(lp, old, a):
        r = torch.exp(lp - old)
        obj = torch.minimum(r * a, torch.clamp(r, 1 - lo, 1 + hi) * a)
        return -(torch.maximum(obj, torch.tensor(c * a, dtype=torch.float64)) if a < 0 else obj)

    loss, metrics = check_against_reference(ClipGate(clip_low=lo, clip_high=hi, dual_clip=c), batch, term)
    # row 4 token 0 has r = exp(1.3) = 3.669 > 3 with A = -1.2: its objective is pinned at 3 * -1.2 = -3.6
    assert loss[4, 0].item() == pytest.approx(3.6)
    assert grad_of(loss.sum(), batch.logp)[4, 0].item() == 0
    assert metrics["clip/dual_frac"].item() == pytest.approx(1 / 15)


@pytest.mark.parametrize("delta", [1.28, 3.0, 10.0])
def test_intellect2_two_sided_clip_is_the_dual_clip_with_c_delta(batch, delta):
    # INTELLECT-2 / TRL: -min(min(r, delta) A, clip(r, 1 - lo, 1 + hi) A), for delta >= 1 + hi
    lo, hi = 0.2, 0.28

    def term(lp, old, a):
        r = torch.exp(lp - old)
        return -torch.minimum(torch.clamp(r, max=delta) * a, torch.clamp(r, 1 - lo, 1 + hi) * a)

    loss, _ = check_against_reference(ClipGate(clip_low=lo, clip_high=hi, dual_clip=delta), batch, term)
    # row 4 token 0: r = e^1.3 = 3.669, A = -1.2; above delta = 3 the objective is pinned at 3 * -1.2, no gradient
    if delta == 3.0:
        assert loss[4, 0].item() == pytest.approx(3.6)
        assert grad_of(loss.sum(), batch.logp)[4, 0].item() == 0


def test_dro_gate_value_and_gradient(batch):
    beta = 0.5

    def term(lp, old, a):
        return -(a * lp - beta / 2 * (lp - old) ** 2)

    loss, metrics = check_against_reference(DROGate(beta=beta), batch, term)
    # Hand-derived gradient: -(A - beta log r) on real tokens, however far the ratio is: nothing is clipped
    log_r = (batch.logp - batch.old_logp).detach()
    expected = -(batch.adv - beta * log_r) * batch.mask
    torch.testing.assert_close(grad_of(loss.sum(), batch.logp), expected)
    # row 4 token 0: log r = 1.3, A = -1.2 -> gradient -(-1.2 - 0.65) = 1.85: pushed down harder than REINFORCE's 1.2
    assert grad_of(loss.sum(), batch.logp)[4, 0].item() == pytest.approx(1.85)
    # penalty mean over the 15 real tokens: beta / 2 * mean(log r^2), the log-ratios listed in conftest
    log_ratios = [0.05, 0.35, -0.3, 0.1, -0.3, 0.35, -0.05, 0.8, -0.9, 0.1, 0.2, -0.2, 1.3, -0.45, 0.02]
    assert metrics["dro/penalty_mean"].item() == pytest.approx(0.25 * sum(x * x for x in log_ratios) / 15)


def test_dro_gate_hand_worked_single_token():
    # log pi = -1, log pi_old = -1.5, A = 2, beta = 0.5: loss = -(2 * -1 - 0.25 * 0.5^2) = 2.0625
    # gradient -(A - beta log r) = -(2 - 0.5 * 0.5) = -1.75
    logp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    loss, _ = DROGate(beta=0.5)(
        logp, torch.tensor([[-1.5]], dtype=torch.float64), torch.tensor([[2.0]]), torch.ones(1, 1)
    )
    assert loss.item() == pytest.approx(2.0625)
    assert grad_of(loss.sum(), logp).item() == pytest.approx(-1.75)


def test_cispo_keeps_every_token_with_a_clipped_constant_weight(batch):
    lo, hi = 0.2, 0.28

    def term(lp, old, a):
        w = min(max(math.exp((lp - old).item()), 1 - lo), 1 + hi)  # a Python float: no gradient path
        return -w * a * lp

    loss, _ = check_against_reference(CISPOGate(clip_low=lo, clip_high=hi), batch, term)
    grad = grad_of(loss.sum(), batch.logp)
    # no token with non-zero advantage is dropped: the gradient is -w A with w in [0.8, 1.28]
    real = (batch.mask > 0) & (batch.adv != 0)
    assert torch.all(grad[real] != 0)
    w = -grad[real] / batch.adv[real]
    assert torch.all((w >= 0.8 - 1e-12) & (w <= 1.28 + 1e-12))


def test_soft_gate_value_gradient_and_unit_weight_at_ratio_one(batch):
    tp, tn = 1.0, 1.05

    def term(lp, old, a):
        tau = tp if a > 0 else tn
        r = torch.exp(lp - old)
        return -(4 / tau) * torch.sigmoid(tau * (r - 1)) * a

    loss, _ = check_against_reference(SoftGate(tau_pos=tp, tau_neg=tn), batch, term)
    # Hand-derived gradient: -A * sech^2(tau (r - 1) / 2) * r
    r = torch.exp(batch.logp - batch.old_logp).detach()
    tau = torch.where(batch.adv > 0, tp, tn)
    expected = -batch.adv * (1 / torch.cosh(tau * (r - 1) / 2)) ** 2 * r * batch.mask
    torch.testing.assert_close(grad_of(loss.sum(), batch.logp), expected)


@pytest.mark.parametrize(
    "gate", [NoGate(), ClipGate(), CISPOGate(), SoftGate(), ClipGate(dual_clip=2.0), DROGate(beta=0.5)]
)
def test_on_policy_gradient_is_reinforce(gate, batch):
    # at ratio 1 every token gate reduces to the REINFORCE gradient -A grad log pi
    old = batch.logp.detach()
    loss, _ = gate(batch.logp, old, batch.adv, batch.mask)
    expected = -batch.adv * batch.mask
    torch.testing.assert_close(grad_of(loss.sum(), batch.logp), expected)


@pytest.mark.parametrize("gate", [NoGate(), ClipGate(), CISPOGate(), SoftGate(), DROGate(beta=0.5)])
def test_nan_on_padding_never_leaks(gate, batch):
    logp = batch.logp.detach().clone()
    logp[batch.mask == 0] = float("nan")
    logp.requires_grad_(True)
    old = batch.old_logp.clone()
    old[batch.mask == 0] = float("-inf")
    loss, metrics = gate(logp, old, batch.adv, batch.mask)
    for agg in (TokenMean(), SequenceMean()):
        value = agg(loss, batch.mask)
        assert torch.isfinite(value)
        (grad,) = torch.autograd.grad(value, logp, retain_graph=True)
        assert torch.all(torch.isfinite(grad)) and torch.all(grad[batch.mask == 0] == 0)
    assert all(torch.isfinite(v) for v in metrics.values())


def test_ratio_metrics_over_real_tokens_only(batch):
    _, metrics = ClipGate()(batch.logp, batch.old_logp, batch.adv, batch.mask)
    real = torch.tensor(  # log-ratios of the real tokens, listed one by one
        [
            v
            for row, m in zip((batch.logp - batch.old_logp).detach(), batch.mask, strict=True)
            for v, k in zip(row, m, strict=True)
            if k > 0
        ]
    )
    assert metrics["ratio/max"].item() == pytest.approx(math.exp(1.3))
    assert metrics["ratio/min"].item() == pytest.approx(math.exp(-0.9))
    assert metrics["ratio/mean"].item() == pytest.approx(real.exp().mean().item())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clip_low": -0.3}, "does not contain 1"),
        ({"clip_high": -0.1}, "does not contain 1"),
        ({"clip_low": 1.5}, "below 0"),
        ({"dual_clip": 0.9}, "must be > 1"),
    ],
)
def test_clip_gate_refuses_empty_trust_regions(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClipGate(**kwargs)


def test_dro_gate_refuses_a_non_positive_beta():
    with pytest.raises(ValueError, match="beta=0"):
        DROGate(beta=0)


def test_soft_gate_refuses_non_positive_temperature():
    with pytest.raises(ValueError, match="tau_neg=0"):
        SoftGate(tau_neg=0)
