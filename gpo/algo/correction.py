"""Rollout-vs-trainer importance correction (TIS / MIS) for log-prob mismatch between engines."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from gpo.algo.masked import masked_mean, masked_stats, masked_sum

CorrectionMode = Literal["tis", "mis"]
CorrectionLevel = Literal["token", "sequence"]


class RolloutCorrection:
    """Reweight the loss by how much more likely the trainer finds each sample than the rollout engine did.

    The rollout engine (vLLM, another precision, other kernels) samples from ``pi_rollout``, which differs
    slightly from the trainer's ``pi_train`` of the same weights. With ``w = pi_train / pi_rollout`` per
    token, or its product over the sequence:

    - ``tis`` (truncated importance sampling): weight ``min(w, cap)``;
    - ``mis`` (masked importance sampling): weight ``w 1[w <= cap]``, dropping badly mismatched samples.

    The weight is a constant (no grad) multiplied into the per-token loss, whose ratio gates then take the old
    log-probs from the trainer (``old_logprobs: trainer``: they clip ``pi / pi_train``), so ``w`` enters once, as in
    TRL (``token_truncate``, ``token_mask``, ``sequence_*``). Textbooks write MIS's weight as ``1[w <= cap]`` alone,
    applied to a ratio ``pi / pi_rollout`` that already holds ``w``: the same product at the first update.

    Args:
        mode: ``tis`` or ``mis``.
        level: ``token`` (per-token ratio) or ``sequence`` (product over the completion).
        cap: the constant ``C``.
    """

    def __init__(self, *, mode: CorrectionMode = "tis", level: CorrectionLevel = "token", cap: float = 2.0) -> None:
        if mode not in ("tis", "mis"):
            raise ValueError(f"mode={mode!r} is not valid; choose 'tis' or 'mis'.")
        if level not in ("token", "sequence"):
            raise ValueError(f"level={level!r} is not valid; choose 'token' or 'sequence'.")
        if not cap > 0:
            raise ValueError(f"cap={cap} must be > 0.")
        self.mode, self.level, self.cap = mode, level, cap

    def __call__(self, train_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """``train_logp``, ``rollout_logp``, ``mask`` ``[B, T]`` -> ``(weight[B, T], metrics)``."""
        with torch.no_grad():
            diff = torch.where(mask.bool(), train_logp - rollout_logp, 0.0)  # [B, T]
            if self.level == "sequence":
                diff = masked_sum(diff, mask, dim=-1)[:, None].expand_as(train_logp)
            w = diff.exp()
            weight = w.clamp(max=self.cap) if self.mode == "tis" else torch.where(w <= self.cap, w, 0.0)
            weight = torch.where(mask.bool(), weight, 0.0)
            metrics = {
                "correction/weight_mean": masked_mean(weight, mask),
                "correction/capped_frac": masked_mean((w > self.cap).float(), mask),
            }
            metrics.update(mismatch_metrics(train_logp, rollout_logp, mask))
        return weight, metrics


def mismatch_metrics(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """How far the rollout engine's log-probs are from the trainer's: max/mean |diff| and a k3 KL estimate."""
    with torch.no_grad():
        d = torch.where(mask.bool(), rollout_logp - train_logp, 0.0)
        stats = masked_stats(d.abs(), mask)
        return {
            "mismatch/abs_diff_max": stats["max"],
            "mismatch/abs_diff_mean": stats["mean"],
            "mismatch/kl": masked_mean(torch.expm1(-d) + d, mask),
        }
