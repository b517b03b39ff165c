"""Sequence-level gates: one ratio (or one weight) per completion, from the mean of its token log-ratios.

Each returns a per-token tensor whose aggregation with ``SequenceMean`` gives the paper's objective
``(1/G) sum_i score_i``. Where a paper uses a sequence advantage ``A_i``, it is the mean of ``adv`` over
the sequence's tokens, which is ``A_i`` itself when the advantage was broadcast from the sequence.
"""

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
from gpo.algo.masked import masked_stats, masked_sum, sequence_mean


def _sequence_fraction(flag: Tensor, mask: Tensor) -> Tensor:
    """Fraction of non-empty sequences where ``flag[B]`` holds."""
    has_tokens = mask.bool().any(-1)
    return (flag & has_tokens).sum().float().detach() / has_tokens.sum().clamp_min(1)


class SequenceClipGate(RatioGate):
    """GSPO (Zheng et al. 2025): clip the length-normalised sequence ratio.

    ``s_i = exp(mean_t log(pi / pi_old))``; the sequence scores
    ``min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)``, whose gradient is
    ``A_i s_i (1/|o_i|) sum_t grad log pi(o_t)`` when unclipped: every token weighted equally, the whole
    sequence dropped when its ratio leaves the band.

    With ``per_token_advantage=True`` this is GSPO-token: ``s_{i,t} = sg(s_i) * pi(o_t) / sg(pi(o_t))``
    equals ``s_i`` in value but its gradient is ``sg(s_i) grad log pi(o_t)``, so each token may carry its
    own advantage ``A_{i,t}`` (multi-turn credit). With a constant advantage per sequence the two forms
    have the same value, clipping and gradient.

    Args:
        clip_low: lower bound ``1 - clip_low`` on the sequence ratio (the GSPO paper used 3e-4).
        clip_high: upper bound ``1 + clip_high`` (the GSPO paper used 4e-4).
        per_token_advantage: use the GSPO-token construction.
    """

    def __init__(self, *, clip_low: float = 0.4, clip_high: float = 0.5, per_token_advantage: bool = False) -> None:
        check_clip_range(clip_low, clip_high)
        self.clip_low, self.clip_high = clip_low, clip_high
        self.per_token_advantage = per_token_advantage

    def __call__(self, logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, Metrics]:
        log_ratio = token_log_ratio(logp, old_logp, mask)
        seq_ratio = sequence_mean(log_ratio, mask).exp()  # [B]
        if self.per_token_advantage:
            # value s_i, gradient sg(s_i) * grad log pi(o_t)
            real_logp = torch.where(mask.bool(), logp, 0.0)
            ratio = seq_ratio.detach()[:, None] * (real_logp - real_logp.detach()).exp()  # [B, T]
            seq_adv = adv
        else:
            ratio = seq_ratio[:, None]  # [B, 1]
            seq_adv = sequence_mean(adv, mask)[:, None]  # [B, 1]
        clipped = ratio.clamp(1 - self.clip_low, 1 + self.clip_high)
        objective = torch.minimum(ratio * seq_adv, clipped * seq_adv).expand_as(logp)  # [B, T]
        seq_a = sequence_mean(adv, mask)  # [B]
        s = seq_ratio.detach()
        metrics = ratio_metrics(log_ratio, mask)
        stats = masked_stats(s, mask.bool().any(-1))
        metrics.update({f"seq_ratio/{key}": value for key, value in stats.items()})
        metrics["clip/low_frac"] = _sequence_fraction((seq_a < 0) & (s < 1 - self.clip_low), mask)
        metrics["clip/high_frac"] = _sequence_fraction((seq_a > 0) & (s > 1 + self.clip_high), mask)
        return masked_loss(-objective, mask), metrics


class GeometricMeanGate(RatioGate):
    """GMPO (Zhao et al. 2025): geometric mean over the sequence of token-clipped ratios.

    Per token, the ratio is clipped in log space in the direction the advantage pushes:
    ``l_t = min(log r_t, clip_high)`` if ``A_i >= 0`` else ``max(log r_t, -clip_low)``. The sequence score is
    ``A_i * exp(mean_t l_t)`` (the paper's ``sgn(A_i) (prod_t |clip-min(r_t A_i)|)^(1/|o_i|)``), whose
    gradient is ``A_i * exp(mean_t l_t) * (1/|o_i|) sum_{t unclipped} grad log pi(o_t)``, the geometric mean of the
    clipped ratios times the unclipped tokens' score functions: one outlier token
    cannot dominate as it can in an arithmetic mean.

    Args:
        clip_low: how far (in log space) a ratio may fall before its token stops pushing (paper: 0.4).
        clip_high: how far (in log space) a ratio may rise (paper: 0.4).
    """

    per_token_advantage = False  # the sequence score is A_i times a geometric mean

    def __init__(self, *, clip_low: float = 0.4, clip_high: float = 0.4) -> None:
        check_positive(clip_low=clip_low, clip_high=clip_high)
        self.clip_low, self.clip_high = clip_low, clip_high

    def clipped_log_ratio(self, log_ratio: Tensor, seq_adv: Tensor) -> Tensor:
        """``[B, T]`` token log-ratios clipped on the side the advantage ``seq_adv[B]`` pushes.

        A sequence of zero advantage scores 0 whichever side is clipped; it is capped from above, so that a runaway
        ratio's ``exp`` stays finite (``0 x inf`` would put NaN in the batch's loss and gradient)."""
        upward = (seq_adv >= 0)[:, None]
        return torch.where(upward, log_ratio.clamp(max=self.clip_high), log_ratio.clamp(min=-self.clip_low))

    def clip_metrics(self, log_ratio: Tensor, seq_adv: Tensor, mask: Tensor) -> Metrics:
        metrics = ratio_metrics(log_ratio, mask)
        metrics["clip/low_frac"] = fraction((seq_adv < 0)[:, None] & (log_ratio < -self.clip_low), mask)
        metrics["clip/high_frac"] = fraction((seq_adv > 0)[:, None] & (log_ratio > self.clip_high), mask)
        return metrics

    def __call__(self, logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, Metrics]:
        log_ratio = token_log_ratio(logp, old_logp, mask)
        seq_adv = sequence_mean(adv, mask)  # [B]
        clipped = self.clipped_log_ratio(log_ratio, seq_adv)  # [B, T]
        score = seq_adv * sequence_mean(clipped, mask).exp()  # [B]
        loss = masked_loss(-score[:, None].expand_as(logp), mask)
        return loss, self.clip_metrics(log_ratio, seq_adv, mask)


class VESPOGate(RatioGate):
    """VESPO: a smooth sequence weight from a variational view of off-policy correction.

    With the (unnormalised) sequence importance weight ``W_i = prod_t pi / pi_old``, each sequence's
    gradient is scaled by ``phi(W_i) = W_i^k exp(lambda (1 - W_i))`` (stop-gradient, ``phi(1) = 1``):
    ``loss_t = -sg(phi(W_i)) A_t log pi(o_t)``. Stale sequences (``W << 1``) fade through ``W^k``, runaway
    ones (``W >> 1``) through ``exp(-lambda W)``. ``(k, lambda)`` differ for non-negative and negative
    advantages. ``log W`` is clamped to ``[-60, 60]`` only to keep the kernel finite.

    Args:
        k_pos, lambda_pos: kernel shape and rate where the sequence advantage is >= 0.
        k_neg, lambda_neg: kernel shape and rate where it is < 0.
    """

    def __init__(
        self, *, k_pos: float = 2.0, lambda_pos: float = 3.0, k_neg: float = 3.0, lambda_neg: float = 2.0
    ) -> None:
        check_positive(k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg, lambda_neg=lambda_neg)
        self.k_pos, self.lambda_pos, self.k_neg, self.lambda_neg = k_pos, lambda_pos, k_neg, lambda_neg

    def weight(self, log_w: Tensor, seq_adv: Tensor) -> Tensor:
        """``phi(W)`` per sequence from ``log W[B]``."""
        log_w = log_w.clamp(-60.0, 60.0)
        non_negative = seq_adv >= 0
        k = torch.full_like(log_w, self.k_neg).masked_fill(non_negative, self.k_pos)
        lam = torch.full_like(log_w, self.lambda_neg).masked_fill(non_negative, self.lambda_pos)
        return (k * log_w + lam * (1 - log_w.exp())).exp()

    def __call__(self, logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, Metrics]:
        log_ratio = token_log_ratio(logp, old_logp, mask)
        seq_adv = sequence_mean(adv, mask)
        phi = self.weight(masked_sum(log_ratio, mask, dim=-1).detach(), seq_adv)  # [B], no grad
        metrics = ratio_metrics(log_ratio, mask)
        stats = masked_stats(phi, mask.bool().any(-1))
        metrics.update({f"vespo/weight_{key}": value for key, value in stats.items()})
        return masked_loss(-phi[:, None] * adv * logp, mask), metrics
