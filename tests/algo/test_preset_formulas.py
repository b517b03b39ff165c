"""Each preset end to end, as ``--model.algorithm NAME`` builds it with its defaults: rewards -> advantages -> gate ->
aggregation, loss and gradient against the papers' formulas written out here token by token in float64 (the objectives
as the survey article named in docs/algorithms.md writes them, GRPO's plain policy gradient and the defaults as flat
GRPO configs have them). The parts' own tests pin each part; these pin how the presets put them together: which
advantage, which std convention, which clip distances, which normaliser. Two groups of unequal size, completions of
unequal length with garbage on the padding, advantages of both signs and log-ratios up to 0.7, so every clip range is
crossed on some token."""

import math
import statistics

import pytest
import torch

from gpo.algo import CISPO, DAPO, GMPO, GRPO, GSPO, RLOO, SAPO, DrGRPO, ReinforcePP
from gpo.algo.objective import PolicyObjective

REWARDS = [1.0, 0.0, 0.5, 1.0, 2.0, -1.0, 0.3]
GROUPS = [0, 0, 0, 0, 1, 1, 1]
LENGTHS = [4, 5, 2, 3, 1, 5, 4]
WIDTH = 5
OLD_LOGP = [
    [-1.2, -0.5, -2.0, -0.9, -1.4],
    [-0.3, -1.7, -2.5, -0.8, -1.1],
    [-0.6, -3.0, -0.2, -0.7, -0.9],
    [-2.2, -0.4, -1.3, -1.0, -0.5],
    [-0.9, -1.6, -0.3, -2.8, -1.9],
    [-1.1, -0.2, -0.6, -1.5, -0.4],
    [-0.7, -2.1, -1.8, -0.3, -1.2],
]
LOG_RATIO = [
    [0.05, 0.45, -0.35, 0.10, 0.00],
    [-0.30, 0.35, -0.05, 0.70, -0.60],
    [0.60, -0.50, 0.00, 0.00, 0.00],
    [0.20, -0.25, 0.15, 0.00, 0.00],
    [0.55, 0.00, 0.00, 0.00, 0.00],
    [-0.60, -0.70, -0.50, -0.55, -0.65],
    [-0.20, 0.55, -0.10, 0.05, 0.00],
]
PADDING = 9.0  # log-probs and log-ratios on padding: nothing of them may reach the loss or its gradient


def step_tensors():
    """(logp [B, T] requiring grad, old_logp, mask) in float64, with ``PADDING`` on the padded tokens."""
    mask = torch.tensor([[1.0] * n + [0.0] * (WIDTH - n) for n in LENGTHS], dtype=torch.float64)
    old = torch.where(mask.bool(), torch.tensor(OLD_LOGP, dtype=torch.float64), PADDING)
    ratio = torch.where(mask.bool(), torch.tensor(LOG_RATIO, dtype=torch.float64), PADDING)
    return (old + ratio).requires_grad_(True), old, mask


def gpo_loss(algorithm, logp, old, mask):
    """The preset's loss as the learner computes it: advantages from the rewards, then the objective, its normaliser
    taken over the whole batch."""
    parts = algorithm.parts()
    reward, group = torch.tensor(REWARDS, dtype=torch.float64), torch.tensor(GROUPS)
    adv = parts.advantage(reward, group, mask).to(torch.float64)
    objective = PolicyObjective(parts.gate, parts.aggregator)
    loss, _ = objective(logp, old, adv, mask, parts.aggregator.normaliser(mask))
    return loss


# ---- advantages, one number per completion, from the rewards ------------------------------------------------------


def group_of(i):
    return [REWARDS[j] for j in range(len(REWARDS)) if GROUPS[j] == GROUPS[i]]


def group_normalised(i):
    """GRPO: ``(r_i - mean) / std`` within the group, population std."""
    rewards = group_of(i)
    return (REWARDS[i] - statistics.fmean(rewards)) / statistics.pstdev(rewards)


def group_centred(i):
    """Dr. GRPO: ``r_i - mean`` within the group."""
    return REWARDS[i] - statistics.fmean(group_of(i))


def leave_one_out(i):
    """RLOO: ``r_i`` minus the mean of the group's other rewards."""
    others = group_of(i)
    others.remove(REWARDS[i])
    return REWARDS[i] - statistics.fmean(others)


def batch_whitened(i):
    """REINFORCE++: the group-centred reward whitened over the whole batch (population std)."""
    centred = [group_centred(j) for j in range(len(REWARDS))]
    return (centred[i] - statistics.fmean(centred)) / statistics.pstdev(centred)


# ---- objectives: what each completion contributes, from its tokens ----------------------------------------------


def tokens(logp, old, i):
    """Completion ``i``'s (log pi, log pi_old) pairs, its padding left out."""
    return [(logp[i, t], old[i, t]) for t in range(LENGTHS[i])]


def clipped(ratio, a, low, high):
    return torch.minimum(ratio * a, ratio.clamp(1 - low, 1 + high) * a)


def reinforce_sum(logp, old, i, a):
    """``sum_t A log pi_t``: the plain GRPO loss of flat GRPO configs, ``-log_probs * advantage``."""
    return sum(a * lp for lp, _ in tokens(logp, old, i))


def ppo_clip_sum(low, high):
    """``sum_t min(r_t A, clip(r_t, 1 - low, 1 + high) A)``, DAPO's token terms."""
    return lambda logp, old, i, a: sum(clipped(torch.exp(lp - lo), a, low, high) for lp, lo in tokens(logp, old, i))


def cispo_sum(logp, old, i, a):
    """``sum_t sg(clip(r_t, 0.6, 1.5)) A log pi_t`` (CISPO's clip 0.4 / 0.5 on the importance weight alone)."""
    return sum(torch.exp(lp - lo).clamp(0.6, 1.5).detach() * a * lp for lp, lo in tokens(logp, old, i))


def gspo_term(logp, old, i, a):
    """``min(s A, clip(s, 0.6, 1.5) A)`` with ``s = (prod_t r_t)^(1/|o|)``."""
    pairs = tokens(logp, old, i)
    s = torch.exp(sum(lp - lo for lp, lo in pairs) / len(pairs))
    return clipped(s, a, 0.4, 0.5)


def sapo_sum(logp, old, i, a):
    """``sum_t (4 / tau) sigmoid(tau (r_t - 1)) A``, tau 1.0 for A > 0 and 1.05 otherwise."""
    tau = 1.0 if a > 0 else 1.05
    return sum(4 / tau * torch.sigmoid(tau * (torch.exp(lp - lo) - 1)) * a for lp, lo in tokens(logp, old, i))


def gmpo_term(logp, old, i, a):
    """``sgn(A) prod_t |min(r_t A, clip(r_t, e^-0.4, e^0.4) A)|^(1/|o|)``: the geometric mean of the clipped token
    objectives, written as a product."""
    pairs = tokens(logp, old, i)
    product = 1.0
    for lp, lo in pairs:
        r = torch.exp(lp - lo)
        product = product * torch.minimum(r * a, r.clamp(math.exp(-0.4), math.exp(0.4)) * a).abs()
    return math.copysign(1.0, a) * product ** (1 / len(pairs))


def sequence_mean(term, advantage):
    """``-(1/G) sum_i (1/|o_i|) term_i``: the mean over completions of their token means."""
    return lambda logp, old: (
        -sum(term(logp, old, i, advantage(i)) / LENGTHS[i] for i in range(len(REWARDS))) / len(REWARDS)
    )


def token_mean(term, advantage):
    """``-(sum_i term_i) / sum_i |o_i|``: the mean over every token of the batch."""
    return lambda logp, old: -sum(term(logp, old, i, advantage(i)) for i in range(len(REWARDS))) / sum(LENGTHS)


def sequence_objective_mean(term, advantage):
    """``-(1/G) sum_i term_i``, for objectives that are already one number per completion (GSPO, GMPO)."""
    return lambda logp, old: -sum(term(logp, old, i, advantage(i)) for i in range(len(REWARDS))) / len(REWARDS)


PRESETS = {
    "grpo": (GRPO(), sequence_mean(reinforce_sum, group_normalised)),
    "rloo": (RLOO(), sequence_mean(reinforce_sum, leave_one_out)),
    "reinforce_pp": (ReinforcePP(), sequence_mean(reinforce_sum, batch_whitened)),
    "dr_grpo": (DrGRPO(), token_mean(reinforce_sum, group_centred)),
    "dapo": (DAPO(), token_mean(ppo_clip_sum(0.2, 0.28), group_normalised)),
    "cispo": (CISPO(), token_mean(cispo_sum, group_normalised)),
    "gspo": (GSPO(), sequence_objective_mean(gspo_term, group_normalised)),
    "sapo": (SAPO(), sequence_mean(sapo_sum, group_normalised)),
    "gmpo": (GMPO(), sequence_objective_mean(gmpo_term, group_normalised)),
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_the_presets_loss_and_gradient_follow_the_papers_formula_from_the_rewards(name):
    algorithm, formula = PRESETS[name]
    logp, old, mask = step_tensors()
    got, expected = gpo_loss(algorithm, logp, old, mask), formula(logp, old)
    (got_grad,) = torch.autograd.grad(got, logp, retain_graph=True)
    (expected_grad,) = torch.autograd.grad(expected, logp)
    # advantages leave their estimator in float32 (about 1e-7 relative); everything after is float64
    assert got.item() == pytest.approx(expected.item(), rel=1e-6, abs=1e-9)
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-6, atol=1e-9)
    assert torch.all(got_grad[mask == 0] == 0)


def test_every_clip_bound_the_presets_use_binds_on_some_token_or_completion():
    """Otherwise a clipped preset would be checked on its unclipped branch only: each bound must bind where it acts,
    the upper one on a completion with a positive advantage, the lower one on a completion with a negative one."""
    signs = [math.copysign(1.0, group_normalised(i)) for i in range(len(REWARDS))]
    token_ratios = [(math.exp(x), signs[i]) for i, row in enumerate(LOG_RATIO) for x in row[: LENGTHS[i]]]
    sequence_ratios = [(math.exp(sum(row[: LENGTHS[i]]) / LENGTHS[i]), signs[i]) for i, row in enumerate(LOG_RATIO)]
    bounds = {"dapo": (token_ratios, 0.2, 0.28), "cispo": (token_ratios, 0.4, 0.5), "gspo": (sequence_ratios, 0.4, 0.5)}
    bounds["gmpo"] = (token_ratios, 1 - math.exp(-0.4), math.exp(0.4) - 1)
    for name, (ratios, low, high) in bounds.items():
        assert any(r > 1 + high and sign > 0 for r, sign in ratios), name
        assert any(r < 1 - low and sign < 0 for r, sign in ratios), name
