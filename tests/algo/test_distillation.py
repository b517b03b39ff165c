"""On-policy distillation: the teacher's per-token signal, hand-worked and against the exact reverse-KL gradient."""

import math

import pytest
import torch

from gpo.algo import NoGate, TeacherKL, TokenMean
from gpo.algo.objective import PolicyObjective


def test_teacher_kl_hand_worked():
    # token 0: log pi = -1, log pi_teacher = -0.5 -> k = -0.5; token 1: log pi = -0.2, teacher -1.2 -> k = 1.0
    # A = 1 on both; coef 2: added A - 2k = (2, -1); replace: 2 (teacher - student) = -2k = (1, -2)
    # token 2 is padding (NaN in both log-probs): 0
    logp = torch.tensor([[-1.0, -0.2, math.nan]], requires_grad=True)
    teacher = torch.tensor([[-0.5, -1.2, math.nan]])
    adv, mask = torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    added, metrics = TeacherKL(coef=2.0)(adv, logp, mask, teacher_logp=teacher)
    torch.testing.assert_close(added, torch.tensor([[2.0, -1.0, 0.0]]))
    assert metrics["distill/reverse_kl"].item() == pytest.approx(0.25)  # (-0.5 + 1.0) / 2
    replaced, _ = TeacherKL(coef=2.0, replace=True)(adv, logp, mask, teacher_logp=teacher)
    torch.testing.assert_close(replaced, torch.tensor([[1.0, -2.0, 0.0]]))
    assert not added.requires_grad and not replaced.requires_grad  # stop-gradient: a signal, not a loss


def test_pure_distillation_descends_the_exact_reverse_kl():
    # on-policy, every token of a 6-token vocabulary enumerated with its probability: the objective's gradient
    # w.r.t. the logits is coef * grad KL(pi || pi_teacher)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, generator=gen, dtype=torch.float64).requires_grad_(True)
    teacher = torch.randn(6, generator=gen, dtype=torch.float64).log_softmax(-1)
    logp = logits.log_softmax(-1)[None]  # [1, V]: each "token" is one vocabulary entry
    prob = logp.detach().exp()
    objective = PolicyObjective(NoGate(), TokenMean(), distill=TeacherKL(coef=0.7, replace=True))
    # weight each entry by its probability through the sample weight, and undo TokenMean's 1/V
    loss, _ = objective(logp, logp.detach(), torch.zeros(1, 6), torch.ones(1, 6), teacher_logp=teacher[None],
                        weight=6 * prob)  # fmt: skip
    (g,) = torch.autograd.grad(loss, logits)
    p = logits.log_softmax(-1)
    kl = (p.exp() * (p - teacher)).sum()
    torch.testing.assert_close(g, 0.7 * torch.autograd.grad(kl, logits)[0])


def test_teacher_kl_refuses_a_non_positive_coef():
    with pytest.raises(ValueError, match="coef=0"):
        TeacherKL(coef=0)
