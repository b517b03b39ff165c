"""Advantage estimators: how good was each completion relative to its siblings.

Every estimator maps ``reward[B]`` (one scalar per completion), ``group[B]`` (which prompt it answers) and
``mask[B, T]`` to ``adv[B, T]``: the sequence advantage broadcast over the completion's tokens and zero on
padding. Batch statistics are over the ``B`` given; in a distributed run the caller gathers the (tiny)
reward and group vectors from every rank first. Groups of one and groups whose rewards are all equal get
zero advantage, never NaN.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Literal

import torch
from torch import Tensor

from gpo.algo.masked import group_index, group_mean_std, group_sum, safe_divide
from gpo.algo.state import PartState

Scale = Literal["group", "batch", "none"]
StdConvention = Literal["population", "sample"]


def _broadcast(adv: Tensor, mask: Tensor) -> Tensor:
    """``[B] -> [B, T]``: copy each sequence's advantage onto its tokens, zero on padding."""
    return adv[:, None].to(torch.float32) * mask.to(torch.float32)


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {', '.join(map(repr, allowed))}.")


def _batch_std(x: Tensor, unbiased: bool) -> Tensor:
    return x.std(unbiased=unbiased) if x.numel() > 1 else x.new_zeros(())


class AdvantageEstimator(PartState, ABC):
    """Maps rewards of grouped completions to per-token advantages."""

    @abstractmethod
    def __call__(self, reward: Tensor, group: Tensor, mask: Tensor) -> Tensor:
        """``reward[B]``, ``group[B]``, ``mask[B, T]`` -> ``adv[B, T]``."""


class GroupNormAdvantage(AdvantageEstimator):
    """Group-relative advantage: subtract the group mean, then divide by a spread.

    ``A_i = (r_i - mean_group(r)) / s`` with ``s`` chosen by ``scale``:

    - ``group``: the std of the rewards in ``i``'s group (GRPO, DeepSeekMath, Shao et al. 2024);
    - ``batch``: the std of all rewards in the batch (batch-level reward scaling, ScaleRL / TRL's
      ``scale_rewards="batch"``);
    - ``none``: ``s = 1``, mean-centring only (Dr. GRPO, Liu et al. 2025, which removes the std's
      question-difficulty bias).

    Args:
        scale: which spread divides the centred reward.
        std: ``population`` (divide the squared deviations by n, the default; a group of two then gets
            exactly +-1 as in 2-GRPO) or ``sample`` (divide by n - 1, as ``torch.std`` and TRL do).
        eps: a spread at or below ``eps`` counts as zero and gives zero advantage.
    """

    def __init__(self, *, scale: Scale = "group", std: StdConvention = "population", eps: float = 1e-6) -> None:
        _check_choice("scale", scale, ("group", "batch", "none"))
        _check_choice("std", std, ("population", "sample"))
        if eps < 0:
            raise ValueError(f"eps={eps} must be >= 0.")
        self.scale, self.std, self.eps = scale, std, eps

    def __call__(self, reward: Tensor, group: Tensor, mask: Tensor) -> Tensor:
        reward = reward.to(torch.float64)  # exact sums: equal rewards give exactly zero spread
        unbiased = self.std == "sample"
        mean, group_std, _ = group_mean_std(reward, group, unbiased=unbiased)  # [B] each
        centred = reward - mean  # [B]
        if self.scale == "none":
            adv = centred
        elif self.scale == "group":
            adv = safe_divide(centred, group_std, self.eps)
        else:
            adv = safe_divide(centred, _batch_std(reward, unbiased).expand_as(centred), self.eps)
        return _broadcast(adv, mask)


class LeaveOneOutAdvantage(AdvantageEstimator):
    """REINFORCE Leave-One-Out (RLOO, Ahmadian et al. 2024): the baseline excludes the sample itself.

    ``A_i = r_i - (1 / (n - 1)) * sum_{j != i} r_j = n / (n - 1) * (r_i - mean_group(r))``, the group mean
    advantage scaled by ``n / (n - 1)``, which removes the bias of a baseline that contains ``r_i``.
    A group of one has no baseline and gets zero advantage.
    """

    def __call__(self, reward: Tensor, group: Tensor, mask: Tensor) -> Tensor:
        reward = reward.to(torch.float64)  # exact sums: equal rewards give exactly zero spread
        index, n_groups = group_index(group)
        count = group_sum(torch.ones_like(reward), index, n_groups)  # [B]
        total = group_sum(reward, index, n_groups)  # [B]
        baseline = (total - reward) / (count - 1).clamp_min(1)  # [B]
        adv = torch.where(count > 1, reward - baseline, 0.0)
        return _broadcast(adv, mask)


class BatchWhitenedAdvantage(AdvantageEstimator):
    """REINFORCE++ (Hu et al. 2025): subtract the group mean, then whiten over the whole batch.

    ``a_i = r_i - mean_group(r)``; ``A_i = (a_i - mean_batch(a)) / std_batch(a)``.

    Args:
        std: ``population`` or ``sample`` convention for the batch std.
        eps: a batch std at or below ``eps`` gives zero advantage.
    """

    def __init__(self, *, std: StdConvention = "population", eps: float = 1e-6) -> None:
        _check_choice("std", std, ("population", "sample"))
        self.std, self.eps = std, eps

    def __call__(self, reward: Tensor, group: Tensor, mask: Tensor) -> Tensor:
        reward = reward.to(torch.float64)  # exact sums: equal rewards give exactly zero spread
        mean, _, _ = group_mean_std(reward, group)
        centred = reward - mean  # [B]
        whitened = centred - centred.mean()
        adv = safe_divide(whitened, _batch_std(centred, self.std == "sample").expand_as(centred), self.eps)
        return _broadcast(adv, mask)


class MeanScaledAdvantage(AdvantageEstimator):
    """Centred reward over the group mean (MaxRL, "maximum-likelihood RL", arXiv 2602.02710; prime-rl's ``max_rl``).

    ``A_i = (r_i - mean_group(r)) / mean_group(r)``. For rewards in ``[0, 1]`` with pass rate ``p`` in the group, a
    correct answer gets ``(1 - p) / p``: rare successes on hard prompts weigh like ``1 / p``, the weighting of the
    maximum-likelihood objective, where GRPO's std scaling gives ``sqrt((1 - p) / p)``.

    Guard: a group whose mean reward is at or below ``eps`` gets zero advantage. The rule is meant for non-negative
    (usually binary) rewards; a negative mean would flip the sign of every advantage in the group, and a mean of
    ~0 (all answers wrong) carries no signal. prime-rl zeroes groups with mean ``<= 0``; ``eps`` also keeps a mean
    of 1e-12 from producing advantages of 1e12. Groups of one and all-equal groups get 0 (centred reward 0).

    Args:
        eps: a group mean at or below ``eps`` gives zero advantage.
    """

    def __init__(self, *, eps: float = 1e-6) -> None:
        if eps < 0:
            raise ValueError(f"eps={eps} must be >= 0.")
        self.eps = eps

    def __call__(self, reward: Tensor, group: Tensor, mask: Tensor) -> Tensor:
        reward = reward.to(torch.float64)  # exact sums: equal rewards give exactly zero centred reward
        mean, _, _ = group_mean_std(reward, group)  # [B]
        return _broadcast(safe_divide(reward - mean, mean, self.eps), mask)


class RankAdvantage(AdvantageEstimator):
    """Rank-based advantage (GOPO, group ordinal policy optimisation): only the order within a group counts.

    With ``rank_i`` in ``0..n-1`` (ascending reward; ties share their average rank),
    ``A_i = 2 * rank_i / (n - 1) - 1``: a monotone map onto ``[-1, 1]``, invariant to any monotone
    transformation of the rewards. Equal rewards get equal advantages; all-equal groups and groups of one get 0.
    """

    def __call__(self, reward: Tensor, group: Tensor, mask: Tensor) -> Tensor:
        reward = reward.to(torch.float64)  # exact sums: equal rewards give exactly zero spread
        same_group = group[:, None] == group[None, :]  # [B, B]
        below = (reward[None, :] < reward[:, None]) & same_group  # [B, B]
        tied = (reward[None, :] == reward[:, None]) & same_group  # [B, B], includes i itself
        rank = below.sum(1).to(reward.dtype) + (tied.sum(1).to(reward.dtype) - 1) / 2  # [B], average rank
        count = same_group.sum(1).to(reward.dtype)  # [B]
        adv = torch.where(count > 1, 2 * rank / (count - 1).clamp_min(1) - 1, 0.0)
        return _broadcast(adv, mask)
