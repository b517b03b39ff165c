"""Token-level gates: each token's own ratio decides its weight."""

from __future__ import annotations

import torch
from torch import Tensor

from gpo.algo.gates.base import (
    Metrics,
    RatioGate,
    check_clip_range,
    check_positive,
    fraction,
    masked_loss,
    ratio_metrics,
    token_log_ratio,
)
from gpo.algo.masked import masked_mean


class NoGate(RatioGate):
    """Plain policy gradient (REINFORCE with a baseline): ``loss_t = -A_t * log pi(o_t)``.

    The ratio is ignored, so the gradient is ``-A_t * grad log pi`` however far the policy has moved;
    use it on-policy (one optimiser step per rollout). Ratio statistics are still reported.
    """

    def __call__(self, logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, Metrics]:
        log_ratio = token_log_ratio(logp, old_logp, mask)
        return masked_loss(-adv * logp, mask), ratio_metrics(log_ratio, mask)


class ClipGate(RatioGate):
    """PPO clipped surrogate (Schulman et al. 2017) with decoupled bounds and optional dual clip.

    ``loss_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t)``, ``r_t = pi / pi_old``.
    ``clip_high > clip_low`` is DAPO's Clip-Higher (Yu et al. 2025). With ``dual_clip = c > 1``
    (Ye et al. 2020), a negative-advantage token's objective is bounded below by ``c A_t``, so a huge
    ratio on a bad token cannot produce an unbounded step. The gradient is ``-A_t r_t grad log pi`` on
    tokens where no bound is active and 0 elsewhere.

    INTELLECT-2's two-sided clipping (its bound ``delta``; TRL's ``delta``) is this dual clip with
    ``dual_clip = delta``: its objective ``min(min(r_t, delta) A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t)``
    equals ours token by token whenever ``delta >= 1 + clip_high``, the range the report and TRL ask for (for
    ``A_t > 0`` the clipped branch is already below ``delta``; for ``A_t < 0`` both are ``A_t min(max(r_t, clip(r_t)),
    delta)``). So there is no separate ``delta`` setting.

    Args:
        clip_low: lower bound is ``1 - clip_low``.
        clip_high: upper bound is ``1 + clip_high``.
        dual_clip: the constant ``c`` of dual clipping (INTELLECT-2's ``delta``), or None to disable.
    """

    def __init__(self, *, clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None) -> None:
        check_clip_range(clip_low, clip_high)
        if dual_clip is not None and not dual_clip > 1:
            raise ValueError(f"dual_clip={dual_clip} must be > 1 (3.0 is common), or None to disable it.")
        self.clip_low, self.clip_high, self.dual_clip = clip_low, clip_high, dual_clip

    def __call__(self, logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, Metrics]:
        log_ratio = token_log_ratio(logp, old_logp, mask)
        ratio = log_ratio.exp()  # [B, T]
        clipped = ratio.clamp(1 - self.clip_low, 1 + self.clip_high)
        objective = torch.minimum(ratio * adv, clipped * adv)  # [B, T]
        metrics = ratio_metrics(log_ratio, mask)
        metrics["clip/low_frac"] = fraction((adv < 0) & (ratio < 1 - self.clip_low), mask)
        metrics["clip/high_frac"] = fraction((adv > 0) & (ratio > 1 + self.clip_high), mask)
        if self.dual_clip is not None:
            dual_bound = self.dual_clip * adv
            objective = torch.where(adv < 0, torch.maximum(objective, dual_bound), objective)
            metrics["clip/dual_frac"] = fraction((adv < 0) & (ratio > self.dual_clip), mask)
        return masked_loss(-objective, mask), metrics


class CISPOGate(RatioGate):
    """CISPO (MiniMax-M1, 2025): clip the importance weight, never drop the token.

    ``loss_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A_t * log pi(o_t)``. The clipped ratio is a
    constant weight (stop-gradient), so every token keeps a gradient ``-r_hat_t A_t grad log pi``, capped
    rather than zeroed as PPO clipping would.

    Args:
        clip_low: the weight is at least ``1 - clip_low``.
        clip_high: the weight is at most ``1 + clip_high``.
    """

    def __init__(self, *, clip_low: float = 0.4, clip_high: float = 0.5) -> None:
        check_clip_range(clip_low, clip_high)
        self.clip_low, self.clip_high = clip_low, clip_high

    def __call__(self, logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, Metrics]:
        log_ratio = token_log_ratio(logp, old_logp, mask)
        ratio = log_ratio.detach().exp()
        weight = ratio.clamp(1 - self.clip_low, 1 + self.clip_high)  # [B, T], no grad
        metrics = ratio_metrics(log_ratio, mask)
        metrics["clip/low_frac"] = fraction(ratio < 1 - self.clip_low, mask)
        metrics["clip/high_frac"] = fraction(ratio > 1 + self.clip_high, mask)
        return masked_loss(-weight * adv * logp, mask), metrics


class SoftGate(RatioGate):
    """SAPO soft gate (Gao et al. 2025): a sigmoid trust region instead of a hard clip.

    ``loss_t = -f(r_t) A_t`` with ``f(r) = (4 / tau) * sigmoid(tau (r - 1))``, ``tau = tau_pos`` where
    ``A_t > 0`` and ``tau_neg`` otherwise. The gradient is ``-A_t w(r_t) r_t grad log pi`` with
    ``w(r) = 4 s (1 - s) = sech^2(tau (r - 1) / 2)``, ``s = sigmoid(tau (r - 1))``: exactly 1 at ``r = 1``
    (the ``4 / tau`` calibration), decaying smoothly as the ratio drifts. ``tau_neg > tau_pos`` damps
    negative updates faster, as the paper recommends.

    Args:
        tau_pos: gate temperature for positive advantages.
        tau_neg: gate temperature for zero or negative advantages.
    """

    def __init__(self, *, tau_pos: float = 1.0, tau_neg: float = 1.05) -> None:
        check_positive(tau_pos=tau_pos, tau_neg=tau_neg)
        self.tau_pos, self.tau_neg = tau_pos, tau_neg

    def __call__(self, logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, Metrics]:
        log_ratio = token_log_ratio(logp, old_logp, mask)
        ratio = log_ratio.exp()
        tau = torch.full_like(ratio, self.tau_neg).masked_fill(adv > 0, self.tau_pos)  # [B, T]
        gate = torch.sigmoid(tau * (ratio - 1))
        metrics = ratio_metrics(log_ratio, mask)
        s = gate.detach()
        metrics["gate/weight_mean"] = masked_mean(4 * s * (1 - s), mask).detach()
        return masked_loss(-(4 / tau) * gate * adv, mask), metrics


class DROGate(RatioGate):
    """Direct reward optimisation's loss on the sampled tokens (DRO, Richemond et al. 2024; issue 16 names veRL).

    ``loss_t = -(A_t log pi(o_t) - (beta / 2) (log pi(o_t) - log pi_old(o_t))^2)``, whose gradient is
    ``-(A_t - beta log r_t) grad log pi``: the REINFORCE gradient at ``r_t = 1``, with a pull back towards the policy
    that sampled the token that grows linearly with the token's log-ratio. Nothing is clipped or dropped and the
    ratio never multiplies the gradient, which grows with ``log r_t``, not ``r_t``; ``beta`` alone sets how far the
    policy may wander from ``pi_old``. This is the per-token form of DRO's squared-residual loss with ``pi_old`` as
    the anchor, as Tinker documents its ``dro`` loss.

    Args:
        beta: weight of the quadratic penalty on the log-ratio (no default: the sources we read use 0.01 to 1).
    """

    def __init__(self, *, beta: float) -> None:
        check_positive(beta=beta)
        self.beta = beta

    def __call__(self, logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, Metrics]:
        log_ratio = token_log_ratio(logp, old_logp, mask)
        penalty = 0.5 * self.beta * log_ratio**2  # [B, T], 0 on padding
        metrics = ratio_metrics(log_ratio, mask)
        metrics["dro/penalty_mean"] = masked_mean(penalty.detach(), mask)
        return masked_loss(-(adv * logp - penalty), mask), metrics
