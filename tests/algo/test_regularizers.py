import math

import pytest
import torch

from gpo.algo import AdaptiveEntropy, EntropyBonus, KLPenalty, kl_estimate


def test_kl_estimators_hand_worked():
    # d = log pi - log pi_ref = 0.5: k1 = 0.5; k2 = 0.125; k3 = e^-0.5 - 1 + 0.5 = 0.106531
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(-0.5) - 0.5)


def test_kl_estimator_gradients():
    # d/d logp: k1 -> 1, k2 -> d, k3 -> 1 - e^-d
    d = torch.tensor([-0.7, 0.0, 0.4], dtype=torch.float64)
    for estimator, expected in (("k1", torch.ones(3)), ("k2", d), ("k3", 1 - torch.exp(-d))):
        logp = d.clone().requires_grad_(True)
        kl_estimate(logp, torch.zeros(3, dtype=torch.float64), estimator).sum().backward()
        torch.testing.assert_close(logp.grad, expected.to(torch.float64))


def test_k1_and_k3_are_unbiased_for_the_true_kl():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    true_kl = (p * (p / q).log()).sum().item()  # 0.2212
    samples = torch.multinomial(p, 400_000, replacement=True, generator=gen)
    logp, ref = p.log()[samples], q.log()[samples]
    for estimator in ("k1", "k3"):
        assert kl_estimate(logp, ref, estimator).mean().item() == pytest.approx(true_kl, abs=3e-3)
    assert torch.all(kl_estimate(logp, ref, "k3") >= 0)


def test_kl_penalty_as_loss_term_and_as_reward_penalty():
    logp = torch.tensor([[-1.0, -2.0, 5.0], [-0.5, 7.0, 7.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    kl = KLPenalty(beta=0.1, estimator="k1")
    term, metrics = kl.loss_term(logp, ref, mask)
    # k1 per real token: 0.5, 0.0 | 0.0 -> beta * k1 = 0.05, 0, 0; padding 0
    torch.testing.assert_close(term, torch.tensor([[0.05, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert metrics["kl/mean"].item() == pytest.approx(0.5 / 3)
    # reward penalty: -beta * sum_t k1 = -0.05 for row 0, 0 for row 1; no gradient
    penalty = kl.reward_penalty(logp, ref, mask)
    torch.testing.assert_close(penalty, torch.tensor([-0.05, 0.0]))
    assert not penalty.requires_grad


def test_entropy_bonus_lowers_loss_with_entropy():
    entropy = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    term = EntropyBonus(coef=0.01).loss_term(entropy, torch.tensor([[1, 0], [1, 1]]))
    torch.testing.assert_close(term, torch.tensor([[-0.01, 0.0], [-0.03, -0.04]]))


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: KLPenalty(beta=-1), "beta=-1"),
        (lambda: KLPenalty(estimator="k4"), "'k1', 'k2', 'k3', 'k3\\+'"),
        (lambda: KLPenalty(placement="reward", importance_corrected=True), "placement='loss'"),
        (lambda: KLPenalty(bound=0), "bound=0"),
        (lambda: EntropyBonus(coef=0.01, adaptive=AdaptiveEntropy(target=1.0)), "set coef: 0"),
        (lambda: AdaptiveEntropy(target=0), "target=0"),
        (lambda: AdaptiveEntropy(target=1.0, step=0), "step=0"),
        (lambda: AdaptiveEntropy(target=1.0, initial_coef=2.0), "initial_coef=2.0"),
        (lambda: KLPenalty(placement="advantage"), "'loss' or 'reward'"),
        (lambda: EntropyBonus(coef=-0.1), "coef=-0.1"),
    ],
)
def test_invalid_settings_are_refused(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()


# ---- KL controls: k3+, the bound, the importance-corrected estimate ------------------------------------------------


def d_and_grad(estimator, d_values, bound=None):
    """``(value, d value / d logp)`` of the estimate at log-ratios ``d`` (float64, reference log-probs 0)."""
    logp = torch.tensor(d_values, dtype=torch.float64, requires_grad=True)
    k = kl_estimate(logp, torch.zeros_like(logp), estimator, bound)
    (g,) = torch.autograd.grad(k.sum(), logp)
    return k.detach(), g


def test_k3_plus_has_the_value_of_k3_and_the_gradient_of_k2():
    # d = 0.5: value e^-0.5 - 1 + 0.5 = 0.106531, gradient d = 0.5 (k3's would be 1 - e^-0.5 = 0.393469)
    # d = -3:  value e^3 - 1 - 3 = 16.085537, gradient -3 (k3's would be 1 - e^3 = -19.085537)
    value, g = d_and_grad("k3+", [0.5, -3.0])
    torch.testing.assert_close(value, torch.tensor([math.exp(-0.5) - 0.5, math.exp(3) - 4], dtype=torch.float64))
    torch.testing.assert_close(g, torch.tensor([0.5, -3.0], dtype=torch.float64))


def test_k3_bound_gradient_on_both_sides_of_the_clamp():
    # k3(d) = 10 at d = -2.6105 and d = 10.99998; inside the bound the gradient is 1 - e^-d, outside 0
    #   d = -2.60: k3 = e^2.6 - 3.6 = 9.8637     -> inside, gradient 1 - e^2.6 = -12.4637
    #   d = -2.62: k3 = e^2.62 - 3.62 = 10.1157  -> clamped to 10, gradient 0
    #   d = 10.5:  k3 = 9.50003                   -> inside, gradient 1 - e^-10.5 = 0.99997
    #   d = 11.5:  k3 = 10.50001                  -> clamped to 10, gradient 0
    value, g = d_and_grad("k3", [-2.60, -2.62, 10.5, 11.5], bound=10.0)
    expected = [math.exp(2.6) - 3.6, 10.0, math.exp(-10.5) + 9.5, 10.0]
    torch.testing.assert_close(value, torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(g, torch.tensor([1 - math.exp(2.6), 0.0, 1 - math.exp(-10.5), 0.0], dtype=torch.float64))
    # k3+ with the bound: the value is clamped, the gradient stays k2's d on both sides (veRL's straight through)
    value, g = d_and_grad("k3+", [-2.60, -2.62, 10.5, 11.5], bound=10.0)
    torch.testing.assert_close(value, torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(g, torch.tensor([-2.60, -2.62, 10.5, 11.5], dtype=torch.float64))
    # and unbounded k3 keeps its gradient past 10
    assert d_and_grad("k3", [-2.62])[1].item() == pytest.approx(1 - math.exp(2.62))


def verl_low_var_kl(logp, ref_logp):
    """veRL's ``kl_penalty_forward(..., "low_var_kl")``, written as veRL writes it."""
    kl = (ref_logp - logp).clamp(-20, 20)
    return (kl.exp() - kl - 1).clamp(-10, 10)


def test_bounded_k3_equals_verl_low_var_kl_in_value_and_gradient():
    d = torch.linspace(-25, 25, 501, dtype=torch.float64)
    d = d[((d + 2.6105).abs() > 1e-3) & ((d - 11.0).abs() > 1e-3)]  # off the two kinks
    for estimator in ("k3", "k3+"):
        value, g = d_and_grad(estimator, d.tolist(), bound=10.0)
        logp = d.clone().requires_grad_(True)
        ref = verl_low_var_kl(logp, torch.zeros_like(d))
        torch.testing.assert_close(value, ref.detach())
        if estimator == "k3":
            torch.testing.assert_close(g, torch.autograd.grad(ref.sum(), logp)[0])
        else:  # veRL's k3+: backward of 0.5 (logp - ref)^2
            torch.testing.assert_close(g, d)


def test_reward_penalty_uses_the_bound():
    # d = -3: k3 = 16.0855 clamped to 10 -> -beta * 10 = -1
    penalty = KLPenalty(beta=0.1, bound=10.0, placement="reward").reward_penalty(
        torch.tensor([[-3.0]]), torch.tensor([[0.0]]), torch.ones(1, 1)
    )
    torch.testing.assert_close(penalty, torch.tensor([-1.0]))


def test_importance_corrected_kl_hand_worked():
    # log pi = -1, log pi_old = -1.2, log pi_ref = -1.5: r = e^0.2 = 1.221403, d = 0.5, k3 = 0.106531
    # value beta r k3 = 0.5 * 0.130118; gradient r (k3 + 1 - e^-d) = r d = 0.610701, times beta
    logp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    term, metrics = KLPenalty(beta=0.5, importance_corrected=True).loss_term(
        logp, torch.tensor([[-1.5]], dtype=torch.float64), torch.ones(1, 1), old_logp=torch.tensor([[-1.2]])
    )
    r, k3 = math.exp(0.2), math.exp(-0.5) - 0.5
    assert term.item() == pytest.approx(0.5 * r * k3)
    assert metrics["kl/mean"].item() == pytest.approx(r * k3)
    assert torch.autograd.grad(term.sum(), logp)[0].item() == pytest.approx(0.5 * r * 0.5)


def exact_expectations(estimator, importance_corrected):
    """Over a 5-token vocabulary, sampled from ``pi_old``: the exact expectation of the loss term and its gradient
    w.r.t. the logits of ``pi``, and the true ``KL(pi || pi_ref)`` with its gradient (all float64)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, generator=gen, dtype=torch.float64).requires_grad_(True)
    old = torch.randn(5, generator=gen, dtype=torch.float64).log_softmax(-1)
    ref = torch.randn(5, generator=gen, dtype=torch.float64).log_softmax(-1)
    logp = logits.log_softmax(-1)
    kl = KLPenalty(beta=1.0, estimator=estimator, importance_corrected=importance_corrected)
    term, _ = kl.loss_term(logp[None], ref[None], torch.ones(1, 5), old_logp=old[None])
    expected = (old.exp() * term[0]).sum()  # E_{o ~ pi_old}[term(o)], every token enumerated
    true_kl = (logp.exp() * (logp - ref)).sum()
    (g,) = torch.autograd.grad(expected, logits, retain_graph=True)
    return expected, g, true_kl, torch.autograd.grad(true_kl, logits)[0]


def test_importance_corrected_k3_is_unbiased_in_value_and_gradient_under_stale_samples():
    value, g, true_kl, true_grad = exact_expectations("k3", importance_corrected=True)
    torch.testing.assert_close(value, true_kl)
    torch.testing.assert_close(g, true_grad)
    # without the correction, neither the value nor the gradient is the KL's: the test can tell them apart
    value, g, true_kl, true_grad = exact_expectations("k3", importance_corrected=False)
    assert abs(value - true_kl) > 1e-2 and (g - true_grad).abs().max() > 1e-2


def test_a_detached_ratio_would_bias_the_gradient_of_the_corrected_kl():
    # why the ratio keeps its gradient: with sg(r) the value is still the KL, the gradient is not
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, generator=gen, dtype=torch.float64).requires_grad_(True)
    old = torch.randn(5, generator=gen, dtype=torch.float64).log_softmax(-1)
    ref = torch.randn(5, generator=gen, dtype=torch.float64).log_softmax(-1)
    logp = logits.log_softmax(-1)
    d = logp - ref
    detached = (old.exp() * (logp - old).exp().detach() * (torch.expm1(-d) + d)).sum()
    true_kl = (logp.exp() * d).sum()
    torch.testing.assert_close(detached, true_kl)
    (g_detached,) = torch.autograd.grad(detached, logits, retain_graph=True)
    (g_true,) = torch.autograd.grad(true_kl, logits)
    assert (g_detached - g_true).abs().max() > 1e-2


def test_importance_corrected_kl_on_policy_has_ratio_one_but_keeps_its_gradient():
    # old = logp.detach(): value k3 itself, gradient r d = d (k2's), not k3's 1 - e^-d
    logp = torch.tensor([[-1.0, -0.2]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -3.0]], dtype=torch.float64)
    term, _ = KLPenalty(beta=1.0, importance_corrected=True).loss_term(
        logp, ref, torch.ones(1, 2), old_logp=logp.detach()
    )
    d = torch.tensor([[0.5, 2.8]], dtype=torch.float64)
    torch.testing.assert_close(term, torch.expm1(-d) + d)
    torch.testing.assert_close(torch.autograd.grad(term.sum(), logp)[0], d)


def test_importance_corrected_kl_needs_old_logp_and_never_leaks_padding():
    penalty = KLPenalty(beta=1.0, importance_corrected=True)
    logp = torch.tensor([[-1.0, math.nan]], requires_grad=True)
    ref, mask = torch.tensor([[-1.5, math.inf]]), torch.tensor([[1.0, 0.0]])
    with pytest.raises(ValueError, match="needs old_logp"):
        penalty.loss_term(logp, ref, mask)
    term, metrics = penalty.loss_term(logp, ref, mask, old_logp=torch.tensor([[-1.2, -math.inf]]))
    (g,) = torch.autograd.grad(term.sum(), logp)
    assert torch.isfinite(term).all() and term[0, 1] == 0 and torch.isfinite(g).all() and g[0, 1] == 0
    assert torch.isfinite(metrics["kl/mean"])


# ---- adaptive entropy ----------------------------------------------------------------------------------------------


def test_adaptive_entropy_rule_hand_worked():
    control = AdaptiveEntropy(target=1.0, step=0.01, initial_coef=0.02, min_coef=0.0, max_coef=0.03)
    assert control.coef == 0.0  # nothing measured yet: no bonus (TRL starts from entropy +inf)
    steps = [  # (entropy measured, c after the update, coefficient applied next)
        (0.8, 0.03, 0.03),  # below target: 0.02 + 0.01 = 0.03
        (0.9, 0.03, 0.03),  # 0.04 capped at max_coef 0.03
        (1.5, 0.02, 0.0),  # above target: c falls to 0.02 and the bonus is off
        (1.0, 0.03, 0.03),  # at the target counts as below
        (2.0, 0.02, 0.0),
        (2.0, 0.01, 0.0),
        (2.0, 0.0, 0.0),
        (2.0, 0.0, 0.0),  # floored at min_coef 0
    ]
    for entropy, value, coef in steps:
        control.update(entropy)
        assert (control.value, control.coef) == (pytest.approx(value), pytest.approx(coef)), entropy


def test_adaptive_entropy_state_round_trips_as_plain_floats():
    control = AdaptiveEntropy(target=0.5, step=0.1)
    for entropy in (0.2, 0.3, 0.9):
        control.update(entropy)
    state = control.state_dict()
    assert all(type(v) is float for v in state.values()) and state == {"value": pytest.approx(0.1), "entropy": 0.9}
    fresh = AdaptiveEntropy(target=0.5, step=0.1)
    fresh.load_state_dict(state)
    for entropy in (0.4, 0.45):
        control.update(entropy)
        fresh.update(entropy)
        assert (fresh.value, fresh.coef) == (control.value, control.coef)


def test_entropy_bonus_uses_the_adaptive_coefficient():
    bonus = EntropyBonus(adaptive=AdaptiveEntropy(target=1.0, step=0.5, max_coef=2.0))
    entropy, mask = torch.tensor([[1.0, 2.0]]), torch.tensor([[1, 0]])
    assert bonus.enabled and not EntropyBonus().enabled
    torch.testing.assert_close(bonus.loss_term(entropy, mask), torch.tensor([[0.0, 0.0]]))  # nothing measured yet
    assert bonus.observe(0.5) == {"entropy/coef": 0.5}  # below target: c = 0 + 0.5, applied
    torch.testing.assert_close(bonus.loss_term(entropy, mask), torch.tensor([[-0.5, 0.0]]))
    assert bonus.observe(3.0) == {"entropy/coef": 0.0}  # above: c = 0, and off
    assert EntropyBonus(coef=0.01).observe(0.5) == {"entropy/coef": 0.01}  # a constant coefficient ignores it
