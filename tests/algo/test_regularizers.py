import math

import pytest
import torch

from gpo.algo import EntropyBonus, KLPenalty, kl_estimate


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
        (lambda: KLPenalty(estimator="k4"), "'k1', 'k2', 'k3'"),
        (lambda: KLPenalty(placement="advantage"), "'loss' or 'reward'"),
        (lambda: EntropyBonus(coef=-0.1), "coef=-0.1"),
    ],
)
def test_invalid_settings_are_refused(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()
