"""Terms added to the policy loss or the reward: KL to a reference policy and an entropy bonus."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from gpo.algo.masked import masked_mean, masked_sum

KLEstimator = Literal["k1", "k2", "k3"]
KLPlacement = Literal["loss", "reward"]


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from tokens sampled from ``pi`` (Schulman, "Approximating
    KL divergence", 2020). With ``d = log pi(o_t) - log pi_ref(o_t)``:

    - ``k1 = d`` (unbiased, high variance, can be negative);
    - ``k2 = d^2 / 2`` (biased, low variance, gradient ``d grad log pi``);
    - ``k3 = exp(-d) - 1 + d`` (unbiased, always >= 0; DeepSeekMath's GRPO KL).
    """
    d = logp - ref_logp.detach()
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d**2
    if estimator == "k3":
        return torch.expm1(-d) + d
    raise ValueError(f"estimator={estimator!r} is not valid; choose one of 'k1', 'k2', 'k3'.")


class KLPenalty:
    """KL regularisation towards a frozen reference policy, as a loss term or as a reward penalty.

    - ``placement="loss"``: ``beta * k(logp, ref_logp)`` is added to each token's loss (GRPO, DeepSeekMath),
      leaving the advantages untouched; see ``loss_term``.
    - ``placement="reward"``: ``-beta * sum_t k_t`` is added to each completion's reward before advantages
      (the PPO-RLHF way); see ``reward_penalty``.

    Args:
        beta: coefficient; 0 disables the term (and the reference model).
        estimator: ``k1``, ``k2`` or ``k3``.
        placement: ``loss`` or ``reward``.
    """

    def __init__(self, *, beta: float = 0.04, estimator: KLEstimator = "k3", placement: KLPlacement = "loss") -> None:
        if beta < 0:
            raise ValueError(f"beta={beta} must be >= 0.")
        if estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"estimator={estimator!r} is not valid; choose one of 'k1', 'k2', 'k3'.")
        if placement not in ("loss", "reward"):
            raise ValueError(f"placement={placement!r} is not valid; choose 'loss' or 'reward'.")
        self.beta, self.estimator, self.placement = beta, estimator, placement

    def loss_term(self, logp: Tensor, ref_logp: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """``beta * k_t`` per token ``[B, T]`` (grad through ``logp``) and the mean KL for logging."""
        on = mask.bool()  # padding is zeroed before the estimate: NaN there must not reach the gradient
        logp, ref_logp = torch.where(on, logp, 0.0), torch.where(on, ref_logp.detach(), 0.0)
        kl = torch.where(on, kl_estimate(logp, ref_logp, self.estimator), torch.zeros_like(logp))
        return self.beta * kl, {"kl/mean": masked_mean(kl, mask).detach()}

    def reward_penalty(self, logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
        """``-beta * sum_t k_t`` per completion ``[B]`` (no grad)."""
        with torch.no_grad():
            return -self.beta * masked_sum(kl_estimate(logp, ref_logp, self.estimator), mask, dim=-1)


class EntropyBonus:
    """``-coef * H_t`` added to each token's loss, so minimising the loss raises the policy's entropy.

    ``H_t`` is the entropy of the full next-token distribution at the position (from
    ``gpo.algo.logprobs``, computed chunk by chunk).

    Args:
        coef: entropy coefficient (0 disables it).
    """

    def __init__(self, *, coef: float = 0.0) -> None:
        if coef < 0:
            raise ValueError(f"coef={coef} must be >= 0 (it is a bonus; 0 disables it).")
        self.coef = coef

    def loss_term(self, entropy: Tensor, mask: Tensor) -> Tensor:
        return torch.where(mask.bool(), -self.coef * entropy, torch.zeros_like(entropy))
