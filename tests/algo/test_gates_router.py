"""RouterShiftGate (RSPO) with clip_low != clip_high, against values worked out by hand in float64."""

import math

import pytest
import torch

from gpo.algo.gates import RouterShiftGate

OLD_ROUTER = [0.8, 0.2]  # the old router's probabilities over 2 experts, at every position of both sequences
MOVED_ROUTER = [0.6, 0.4]  # the new router where it moved: gamma = exp(-|log 0.6 - log 0.8|) = 0.75


def router_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """``[L=1, B=2, T=2, E=2]`` log routing probabilities: the router moved at (0, 0) and (1, 1) only."""
    old = torch.tensor(OLD_ROUTER, dtype=torch.float64).log().expand(1, 2, 2, 2).clone()
    new = old.clone()
    new[0, 0, 0] = torch.tensor(MOVED_ROUTER, dtype=torch.float64).log()
    new[0, 1, 1] = torch.tensor(MOVED_ROUTER, dtype=torch.float64).log()
    return new, old


@pytest.mark.parametrize(
    ("clip_low", "clip_high", "clipped_mean"),
    [
        # sequence 0 (A = 1.5 > 0): log-ratios [0.5, -0.2] -> [min(0.5, 0.3), -0.2] = [0.3, -0.2], mean 0.05
        # sequence 1 (A = -2 < 0): log-ratios [-0.5, 0.2] -> [max(-0.5, -0.1), 0.2] = [-0.1, 0.2], mean 0.05
        #   (floored at -clip_high = -0.3 instead, as the survey's clip(w^sgn(A)) reads, the mean would be -0.05)
        pytest.param(0.1, 0.3, (0.05, 0.05), id="low_0.1_high_0.3"),
        # sequence 0: [min(0.5, 0.1), -0.2] = [0.1, -0.2], mean -0.05
        # sequence 1: [max(-0.5, -0.3), 0.2] = [-0.3, 0.2], mean -0.05
        pytest.param(0.3, 0.1, (-0.05, -0.05), id="low_0.3_high_0.1"),
    ],
)
def test_clip_low_bounds_the_fall_and_clip_high_the_rise(clip_low, clip_high, clipped_mean):
    gate = RouterShiftGate(top_k=1, gamma_min=0.5, clip_low=clip_low, clip_high=clip_high)
    old_logp = torch.zeros(2, 2, dtype=torch.float64)
    logp = torch.tensor([[0.5, -0.2], [-0.5, 0.2]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.5, 1.5], [-2.0, -2.0]], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.float64)
    router_logp, old_router_logp = router_inputs()

    loss, metrics = gate(logp, old_logp, adv, mask, router_logp=router_logp, old_router_logp=old_router_logp)

    # gamma = [[0.75, 1], [1, 0.75]]: mean log gamma = log(0.75) / 2 in both sequences, i.e. geomean(gamma) = sqrt(0.75)
    # score_i = A_i * exp(clipped mean) * geomean(gamma), for either sign; each token's loss is -score_i
    score_0 = 1.5 * math.exp(clipped_mean[0]) * math.sqrt(0.75)
    score_1 = -2.0 * math.exp(clipped_mean[1]) * math.sqrt(0.75)
    expected = torch.tensor([[-score_0, -score_0], [-score_1, -score_1]], dtype=torch.float64)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)

    # gradient of one token's entry (-score_i): the clipped token (0.5 above clip_high, -0.5 below -clip_low) gives
    # none; the other gives -score_i * (1/|o_i|) = -score_i / 2
    (grad,) = torch.autograd.grad(loss[:, 0].sum(), logp)
    expected_grad = torch.tensor([[0.0, -score_0 / 2], [0.0, -score_1 / 2]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=0)

    # one token in four clipped on each side
    assert metrics["clip/low_frac"].item() == pytest.approx(0.25)
    assert metrics["clip/high_frac"].item() == pytest.approx(0.25)
