"""The ratio-gate contract and the pieces every gate shares."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import Tensor

from gpo.algo.masked import masked_mean, masked_stats
from gpo.algo.state import PartState

Metrics = dict[str, Tensor]


class RatioGate(PartState, ABC):
    """How much to trust the importance ratio ``pi / pi_old`` at each token.

    A gate turns ``logp[B, T]`` (current policy, with grad), ``old_logp[B, T]`` (the policy that sampled,
    no grad), ``adv[B, T]`` and ``mask[B, T]`` into ``per_token_loss[B, T]`` (to be minimised, zero where
    ``mask`` is 0) and a dict of detached diagnostics. A ``LossAggregator`` then averages the tokens.

    Gates that need more than log-probs name the extra keyword inputs in ``requires`` (for example RSPO's
    router log-probs); the trainer computes exactly those and passes them by name. Inputs named ``old_*`` are
    computed once per step over the rollout, before the first update; the others in each gradient pass. A gate that
    reads the old policy's most likely tokens (``old_topk_logp``, and the current policy's ``topk_logp`` at those
    tokens) says how many in ``topk_tokens``. A gate that averages the advantage over each sequence before using it
    (GSPO, GMPO) sets ``per_token_advantage`` False: per-token credit (step rewards) reaches it as one shift per
    sequence.
    """

    requires: ClassVar[frozenset[str]] = frozenset()
    topk_tokens: int = 0
    per_token_advantage: bool = True

    @abstractmethod
    def __call__(self, logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, Metrics]:
        """Returns ``(per_token_loss[B, T], metrics)``."""


def token_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """``log(pi / pi_old)`` per token ``[B, T]``, exactly 0 on padding so no inf/NaN can start there."""
    return torch.where(mask.bool(), logp - old_logp.detach(), 0.0)


def masked_loss(loss: Tensor, mask: Tensor) -> Tensor:
    """Zero the loss outside the mask (with ``where``, so a NaN on padding cannot leak into the sum)."""
    return torch.where(mask.bool(), loss, 0.0)


def ratio_metrics(log_ratio: Tensor, mask: Tensor) -> Metrics:
    """min/mean/max of the token ratio over real tokens."""
    stats = masked_stats(log_ratio.detach().exp(), mask)
    return {f"ratio/{key}": value for key, value in stats.items()}


def fraction(flag: Tensor, mask: Tensor) -> Tensor:
    """Fraction of masked tokens where ``flag`` holds."""
    return masked_mean(flag.to(torch.float32), mask).detach()


def check_clip_range(clip_low: float, clip_high: float) -> None:
    """Refuse clip bounds that give an empty or inverted trust region."""
    if clip_low < 0 or clip_high < 0:
        raise ValueError(
            f"clip_low={clip_low}, clip_high={clip_high} give the interval [{1 - clip_low}, {1 + clip_high}], "
            "which does not contain 1; both must be >= 0 (e.g. clip_low=0.2, clip_high=0.28)."
        )
    if clip_low > 1:
        raise ValueError(f"clip_low={clip_low} puts the lower ratio bound below 0; use a value in [0, 1].")


def check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name}={value} must be > 0.")
