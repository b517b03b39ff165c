"""Reward mixers: how several reward signals per completion become one scalar reward."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
from torch import Tensor

from gpo.algo.masked import group_mean_std, safe_divide
from gpo.algo.state import PartState


def _weights(weights: Sequence[float] | None, n: int, name: str) -> Tensor:
    if weights is None:
        return torch.ones(n)
    if len(weights) != n:
        raise ValueError(f"{name} has {len(weights)} weights for {n} reward columns; give one weight per reward.")
    return torch.as_tensor(list(weights), dtype=torch.float32)


def weighted_sum(scores: Tensor, weights: Sequence[float] | None) -> Tensor:
    """``sum_k w_k s_{i,k}`` of ``scores[B, K]`` (``weights`` None: all 1), in float32: the reward a run reports
    (``reward/mean``, ``val/reward_*``), whatever the mixer makes of the scores for training."""
    return scores.to(torch.float32) @ _weights(weights, scores.shape[-1], "weights").to(scores.device)


class RewardMixer(PartState, ABC):
    """``(scores[B, K], group[B]) -> reward[B]`` for ``K`` reward functions.

    ``weights``: one weight per reward function, in order, for mixers that weigh them (None: all 1, or unweighted).
    """

    weights: list[float] | None = None

    @abstractmethod
    def __call__(self, scores: Tensor, group: Tensor) -> Tensor:
        """Combine the ``K`` scores of each completion."""


class WeightedSum(RewardMixer):
    """``r_i = sum_k w_k s_{i,k}``.

    Args:
        weights: one weight per reward function, in order; None weights them all 1.
    """

    def __init__(self, *, weights: Sequence[float] | None = None) -> None:
        self.weights = None if weights is None else list(weights)

    def __call__(self, scores: Tensor, group: Tensor) -> Tensor:
        return weighted_sum(scores, self.weights)


class GroupNormalizedSum(RewardMixer):
    """GDPO: normalise each reward within its group, then take the weighted sum.

    ``r_i = sum_k w_k (s_{i,k} - mean_group(s_k)) / std_group(s_k)``: a high-variance reward can no longer
    drown a low-variance one, as it does when the raw sum is normalised. A reward that is constant within a
    group contributes 0 there. GDPO, and TRL's ``normalize_then_sum``, then divide the sum by its std over the
    batch: pair this mixer with ``advantage_norm: batch`` (``configs/gdpo.yaml``), not with the group std.

    Args:
        weights: one weight per reward function; None weights them all 1.
        eps: a group std at or below ``eps`` counts as zero spread.
    """

    def __init__(self, *, weights: Sequence[float] | None = None, eps: float = 1e-6) -> None:
        self.weights = None if weights is None else list(weights)
        self.eps = eps

    def __call__(self, scores: Tensor, group: Tensor) -> Tensor:
        scores = scores.to(torch.float64)  # exact sums: a column equal within a group gives exactly zero spread
        w = _weights(self.weights, scores.shape[-1], "weights").to(scores.device, torch.float64)
        columns = []
        for k in range(scores.shape[-1]):
            mean, std, _ = group_mean_std(scores[:, k], group)
            columns.append(safe_divide(scores[:, k] - mean, std, self.eps))
        return (torch.stack(columns, dim=-1) @ w).float()  # [B]


class EnvEventOutcomeBlend(WeightedSum):
    """A blend of environment, event (per-step judge) and outcome (episode judge) rewards.

    As hosted RL services configure it: ``r = w_env s_env + w_event s_event + w_outcome s_outcome``.

    Expects exactly three score columns in the order env, event, outcome.

    Args:
        env: weight of the environment's own reward.
        event: weight of the judge's per-event score.
        outcome: weight of the judge's outcome score.
    """

    def __init__(self, *, env: float = 1.0, event: float = 0.0, outcome: float = 0.0) -> None:
        super().__init__(weights=[env, event, outcome])

    def __call__(self, scores: Tensor, group: Tensor) -> Tensor:
        if scores.shape[-1] != 3:
            raise ValueError(
                f"EnvEventOutcomeBlend needs 3 score columns (env, event, outcome), got {scores.shape[-1]}; "
                "use WeightedSum for other layouts."
            )
        return super().__call__(scores, group)
