"""DPPO: a trust region on an estimate of the policy divergence instead of on the ratio."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor
from torch.special import xlogy

from gpo.algo.gates.base import Metrics, RatioGate, fraction, masked_loss, ratio_metrics, token_log_ratio
from gpo.algo.masked import masked_mean

DivergenceMode = Literal["binary_tv", "binary_kl", "topk_tv", "topk_kl"]
MODES: tuple[str, ...] = ("binary_tv", "binary_kl", "topk_tv", "topk_kl")


def _coarse_divergence(p: Tensor, q: Tensor, kind: str) -> Tensor:
    """TV or KL(p || q) between two distributions given as bins on the last axis."""
    if kind == "tv":
        return 0.5 * (p - q).abs().sum(-1)
    # q floored at the smallest normal float: an empty bin of q with mass in p is a huge divergence, not inf;
    # the sum is clamped at 0 against rounding when p == q
    return (xlogy(p, p) - xlogy(p, q.clamp_min(torch.finfo(q.dtype).tiny))).sum(-1).clamp_min(0)


def _with_rest(probs: Tensor) -> Tensor:
    """Append the mass outside the listed tokens as one more bin: ``[..., K] -> [..., K + 1]``."""
    rest = (1 - probs.sum(-1, keepdim=True)).clamp_min(0)
    return torch.cat([probs, rest], dim=-1)


class DivergenceMaskGate(RatioGate):
    """DPPO's gate: a token's gradient is dropped where the divergence estimate is too large.

    A token's gradient is dropped when the estimated divergence between ``pi`` and ``pi_old`` at its
    position exceeds ``threshold`` and the update would push it further.

    ``loss_t = -A_t r_t M_t`` with ``M_t = 0`` if ``D_t > threshold`` and ``sign(r_t - 1) = sign(A_t)``, else 1
    (the same one-sided rule as PPO's clip, on a divergence). ``D_t`` coarsens both distributions at the
    position into a few bins and measures them exactly:

    - ``binary_tv`` / ``binary_kl``: bins {sampled token, everything else}; TV is ``|p - q|``, KL is
      ``p log(p/q) + (1-p) log((1-p)/(1-q))``, with ``p = pi(o_t)``, ``q = pi_old(o_t)``;
    - ``topk_tv`` / ``topk_kl``: bins {each of the old policy's ``top_k`` most likely tokens, everything else};
      needs ``topk_logp`` (current policy at those tokens) and ``old_topk_logp``, ``[B, T, k]``, which the trainer
      computes chunk by chunk without the full logits.

    Coarsening can only lower TV and KL, so ``D_t`` is a lower bound of the full divergence. KL is ``KL(pi || pi_old)``.
    Roitman's textbook chapter on GRPO writes the binary KL with its first term only; we keep both terms so the estimate
    is a divergence (never negative).

    Args:
        mode: which estimate, one of ``binary_tv``, ``binary_kl``, ``topk_tv``, ``topk_kl``.
        threshold: the trust-region radius ``delta`` (no default: the sources we read give none).
        top_k: old-policy tokens that get a bin of their own in the ``topk_*`` modes (unused by ``binary_*``).
    """

    def __init__(self, *, mode: DivergenceMode, threshold: float, top_k: int = 20) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not valid; choose one of {', '.join(map(repr, MODES))}.")
        if not threshold > 0:
            raise ValueError(f"threshold={threshold} must be > 0.")
        if top_k < 1:
            raise ValueError(f"top_k={top_k} must be >= 1 (old-policy tokens with a bin of their own).")
        self.mode, self.threshold = mode, threshold
        self.kind = mode.split("_")[1]
        topk = mode.startswith("topk")
        self.requires = frozenset({"topk_logp", "old_topk_logp"}) if topk else frozenset()
        self.topk_tokens = top_k if topk else 0

    def divergence(
        self, logp: Tensor, old_logp: Tensor, topk_logp: Tensor | None, old_topk_logp: Tensor | None
    ) -> Tensor:
        """``D[B, T]`` per position (no grad)."""
        with torch.no_grad():
            if self.mode.startswith("binary"):
                p = torch.stack([logp.exp(), -torch.expm1(logp)], dim=-1)  # [B, T, 2]
                q = torch.stack([old_logp.exp(), -torch.expm1(old_logp)], dim=-1)
            else:
                if topk_logp is None or old_topk_logp is None:
                    raise ValueError(f"mode={self.mode!r} needs topk_logp and old_topk_logp ([B, T, k]).")
                p, q = _with_rest(topk_logp.exp()), _with_rest(old_topk_logp.exp())
            return _coarse_divergence(p.float(), q.float(), self.kind)

    def __call__(
        self,
        logp: Tensor,
        old_logp: Tensor,
        adv: Tensor,
        mask: Tensor,
        *,
        topk_logp: Tensor | None = None,
        old_topk_logp: Tensor | None = None,
    ) -> tuple[Tensor, Metrics]:
        log_ratio = token_log_ratio(logp, old_logp, mask)
        ratio = log_ratio.exp()
        div = self.divergence(logp.detach(), old_logp.detach(), topk_logp, old_topk_logp)  # [B, T]
        pushing_out = ((adv > 0) & (log_ratio > 0)) | ((adv < 0) & (log_ratio < 0))
        dropped = (div > self.threshold) & pushing_out & mask.bool()
        loss = torch.where(dropped, 0.0, -adv * ratio)
        metrics = ratio_metrics(log_ratio, mask)
        metrics["dppo/masked_frac"] = fraction(dropped, mask)
        metrics["dppo/divergence_mean"] = masked_mean(div, mask).detach()
        return masked_loss(loss, mask), metrics
