"""Terms added to the policy loss or the reward: KL to a reference policy and an entropy bonus."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from gpo.algo.masked import masked_mean, masked_sum

KLEstimator = Literal["k1", "k2", "k3", "k3+"]
KLPlacement = Literal["loss", "reward"]
ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "k3+")


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: KLEstimator = "k3", bound: float | None = None) -> Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from tokens sampled from ``pi`` (Schulman, "Approximating
    KL divergence", 2020). With ``d = log pi(o_t) - log pi_ref(o_t)``:

    - ``k1 = d`` (unbiased, high variance, can be negative);
    - ``k2 = d^2 / 2`` (biased, low variance, gradient ``d grad log pi``);
    - ``k3 = exp(-d) - 1 + d`` (unbiased, always >= 0; DeepSeekMath's GRPO KL; veRL's ``low_var_kl``);
    - ``k3+``: the value of ``k3`` with the gradient of ``k2`` (straight through: ``k2 - sg(k2) + sg(k3)``), veRL's
      ``k3+``. ``k3``'s own gradient ``(1 - pi_ref / pi) grad log pi`` is the gradient of ``E[k3]`` only through
      the samples' values, not through the sampling distribution; ``k2``'s ``d grad log pi`` is, in expectation,
      the gradient of the true KL, and it grows linearly in ``d`` instead of like ``pi_ref / pi``.

    ``bound`` clamps the estimate's value to ``[-bound, bound]`` (veRL clamps ``k3`` at 10); past the bound the
    gradient of ``k1``, ``k2`` and ``k3`` is 0, while ``k3+`` keeps ``k2``'s unclamped gradient (only its value is
    clamped), as in veRL.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator={estimator!r} is not valid; choose one of {', '.join(map(repr, ESTIMATORS))}.")
    d = logp - ref_logp.detach()  # [B, T]
    if estimator == "k1":
        k = d
    elif estimator == "k2":
        k = 0.5 * d**2
    else:
        k = torch.expm1(-d) + d  # k3, also the value of k3+
    if bound is not None:
        k = k.clamp(-bound, bound)
    if estimator == "k3+":
        k2 = 0.5 * d**2
        k = k2 - k2.detach() + k.detach()
    return k


class KLPenalty:
    """KL regularisation towards a frozen reference policy, as a loss term or as a reward penalty.

    - ``placement="loss"``: ``beta * k(logp, ref_logp)`` is added to each token's loss (GRPO, DeepSeekMath),
      leaving the advantages untouched; see ``loss_term``.
    - ``placement="reward"``: ``-beta * sum_t k_t`` is added to each completion's reward before advantages
      (the PPO-RLHF way); see ``reward_penalty``.

    ``importance_corrected`` (DeepSeek-V3.2; TRL's ``use_bias_correction_kl``) multiplies the loss term by the
    token's ratio ``r_t = pi(o_t) / pi_old(o_t)``: ``beta * r_t k_t``. The tokens were sampled from ``pi_old``, not
    from ``pi``; the ratio re-weights them to ``pi``. The ratio is *not* detached, as in TRL: with ``k3`` the
    gradient of ``r_t k3_t`` is ``r_t (k3_t + 1 - pi_ref / pi) grad log pi``, whose expectation under ``pi_old`` is
    ``E_pi[d grad log pi] = grad KL(pi || pi_ref)``, the unbiased gradient the paper is after; a detached ratio
    would only re-weight ``k3``'s biased gradient. On the first update (``pi = pi_old``) the ratio is 1 in value
    but still carries that gradient.

    ``bound`` is off by default: ``k3``'s gradient is exactly what pulls the policy back where it has fallen far
    below the reference, and a clamp at 10 silently switches it off for those tokens (``d < -2.6``); the default
    also keeps gpo's ``k3`` identical to DeepSeekMath's. Set ``bound: 10`` to reproduce veRL, or prefer ``k3+``,
    whose gradient grows only linearly, against gradient spikes.

    Args:
        beta: coefficient; 0 disables the term (and the reference model).
        estimator: ``k1``, ``k2``, ``k3`` or ``k3+``.
        placement: ``loss`` or ``reward``.
        importance_corrected: multiply the loss term by ``pi / pi_old`` (loss placement only).
        bound: clamp the estimate's value to ``[-bound, bound]``, or None.
    """

    def __init__(
        self,
        *,
        beta: float = 0.04,
        estimator: KLEstimator = "k3",
        placement: KLPlacement = "loss",
        importance_corrected: bool = False,
        bound: float | None = None,
    ) -> None:
        if beta < 0:
            raise ValueError(f"beta={beta} must be >= 0.")
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator={estimator!r} is not valid; choose one of {', '.join(map(repr, ESTIMATORS))}.")
        if placement not in ("loss", "reward"):
            raise ValueError(f"placement={placement!r} is not valid; choose 'loss' or 'reward'.")
        if importance_corrected and placement == "reward":
            raise ValueError(
                "importance_corrected=True re-weights the loss term's gradient; with placement='reward' there is none. "
                "Use placement='loss', or importance_corrected=False."
            )
        if bound is not None and not bound > 0:
            raise ValueError(f"bound={bound} must be > 0 (veRL uses 10), or None for no bound.")
        self.beta, self.estimator, self.placement = beta, estimator, placement
        self.importance_corrected, self.bound = importance_corrected, bound

    def loss_term(
        self, logp: Tensor, ref_logp: Tensor, mask: Tensor, *, old_logp: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """``beta * k_t`` (times ``pi / pi_old`` when importance-corrected) per token ``[B, T]``, grad through
        ``logp``, and the mean KL for logging. ``old_logp`` is read only when importance-corrected."""
        on = mask.bool()  # padding is zeroed before the estimate: NaN there must not reach the gradient
        logp, ref_logp = torch.where(on, logp, 0.0), torch.where(on, ref_logp.detach(), 0.0)
        if self.importance_corrected:
            if old_logp is None:
                raise ValueError("importance_corrected=True needs old_logp (the sampling policy's log-probs).")
            # float64: k3's corrected gradient r (k3 + 1 - pi_ref / pi) = r d cancels two terms of size r pi_ref / pi
            wide, old = logp.double(), torch.where(on, old_logp.detach(), 0.0).double()  # [B, T] each
            kl = ((wide - old).exp() * kl_estimate(wide, ref_logp.double(), self.estimator, self.bound)).to(logp.dtype)
        else:
            kl = kl_estimate(logp, ref_logp, self.estimator, self.bound)  # [B, T]
        kl = torch.where(on, kl, 0.0)  # [B, T]
        return self.beta * kl, {"kl/mean": masked_mean(kl, mask).detach()}

    def reward_penalty(self, logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
        """``-beta * sum_t k_t`` per completion ``[B]`` (no grad)."""
        with torch.no_grad():
            return -self.beta * masked_sum(kl_estimate(logp, ref_logp, self.estimator, self.bound), mask, dim=-1)


class AdaptiveEntropy:
    """Adaptive entropy control (Skywork-OR1): an entropy coefficient steered towards a target.

    Skywork-OR1 is He et al. 2025; TRL calls it ``use_adaptive_entropy``. The entropy
    coefficient climbs while the policy's entropy is at or below a target and falls back above it.

    After each RL step with mean token entropy ``H`` (``update``):
    ``c <- min(c + step, max_coef)`` if ``H <= target``, else ``c <- max(c - step, min_coef)``. The coefficient
    applied during the next step (``coef``) is ``c`` if ``H <= target`` and 0 otherwise: the bonus only acts while
    entropy is at or below the target. Before the first measurement no bonus is applied (``H = +inf``), as in TRL.

    The state (``c`` and the last ``H``) is two plain floats: ``state_dict`` / ``load_state_dict``.

    Args:
        target: target mean token entropy in nats (no default: set it near the entropy seen early in training;
            TRL's 0.2 rarely triggers on a language model whose tokens carry 2-10 nats).
        step: how much ``c`` moves per RL step (TRL's ``entropy_coef_delta``).
        initial_coef: ``c`` before the first step.
        min_coef, max_coef: the range of ``c``.
    """

    def __init__(
        self,
        *,
        target: float,
        step: float = 0.005,
        initial_coef: float = 0.0,
        min_coef: float = 0.0,
        max_coef: float = 1.0,
    ) -> None:
        if not target > 0:
            raise ValueError(f"target={target} must be > 0 (a mean token entropy in nats).")
        if not step > 0:
            raise ValueError(f"step={step} must be > 0.")
        if not 0 <= min_coef <= initial_coef <= max_coef:
            raise ValueError(
                f"min_coef={min_coef}, initial_coef={initial_coef}, max_coef={max_coef} must satisfy "
                "0 <= min_coef <= initial_coef <= max_coef."
            )
        self.target, self.step, self.min_coef, self.max_coef = target, step, min_coef, max_coef
        self.value, self.entropy = initial_coef, math.inf

    @property
    def coef(self) -> float:
        """The coefficient to apply now."""
        return self.value if self.entropy <= self.target else 0.0

    def update(self, entropy: float) -> None:
        """Move the coefficient after a step whose mean token entropy was ``entropy``."""
        if entropy <= self.target:
            self.value = min(self.value + self.step, self.max_coef)
        else:
            self.value = max(self.value - self.step, self.min_coef)
        self.entropy = entropy

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "entropy": self.entropy}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value, self.entropy = float(state["value"]), float(state["entropy"])


class EntropyBonus:
    """``-coef * H_t`` added to each token's loss, so minimising the loss raises the policy's entropy.

    ``H_t`` is the entropy of the full next-token distribution at the position (from
    ``gpo.algo.logprobs``, computed chunk by chunk). With ``adaptive``, the coefficient is the controller's
    (``AdaptiveEntropy.coef``), fed the step's mean entropy through ``observe``.

    Args:
        coef: entropy coefficient (0 disables it); must stay 0 with ``adaptive``, which owns the coefficient.
        adaptive: adaptive entropy control towards a target entropy, or None for a constant ``coef``.
    """

    def __init__(self, *, coef: float = 0.0, adaptive: AdaptiveEntropy | None = None) -> None:
        if coef < 0:
            raise ValueError(f"coef={coef} must be >= 0 (it is a bonus; 0 disables it).")
        if adaptive is not None and coef != 0:
            raise ValueError(
                f"coef={coef} and adaptive both set the entropy coefficient; with adaptive the coefficient starts at "
                "adaptive.initial_coef, so set coef: 0 (or remove adaptive)."
            )
        self.coef, self.adaptive = coef, adaptive

    @property
    def enabled(self) -> bool:
        return self.coef > 0 or self.adaptive is not None

    @property
    def current(self) -> float:
        """The coefficient applied now."""
        return self.adaptive.coef if self.adaptive is not None else self.coef

    def loss_term(self, entropy: Tensor, mask: Tensor) -> Tensor:
        return torch.where(mask.bool(), -self.current * entropy, 0.0)

    def observe(self, entropy: float) -> dict[str, float]:
        """End of an RL step: the adaptive controller sees the step's mean token entropy; returns the coefficient
        the next step applies (``entropy/coef``)."""
        if self.adaptive is not None:
            self.adaptive.update(entropy)
        return {"entropy/coef": self.current}
