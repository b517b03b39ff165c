"""Step rewards of multi-turn episodes: each policy turn's credit, as an advantage added to the sequence advantage.

Shapes: ``B`` episodes, ``K`` turns at most, ``T`` completion tokens. ``turn_rewards[B, K]`` holds each turn's step
reward and NaN past the episode's last turn; ``turn_index[B, T]`` names each token's policy turn (-1 on environment
tokens and padding). ``gpo.rollout.MultiTurnEngine`` records both on the rollout.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from gpo.algo.masked import group_index, group_sum

StepRewardsMode = Literal["decision_stepwise", "env_sparse"]
STEP_REWARDS_MODES = ("decision_stepwise", "env_sparse")


def turn_credit(rewards: Tensor, valid: Tensor, mode: StepRewardsMode) -> Tensor:
    """``credit[B, K]`` of each turn from the environment's step rewards ``rewards[B, K]``.

    - ``decision_stepwise``: ``c_k = r_k``, each decision is credited with its own immediate reward;
    - ``env_sparse``: ``c_k = sum_{j >= k} r_j``, the reward-to-go, so a sparse reward (one at the end) reaches
      every decision that led to it.
    """
    if mode not in STEP_REWARDS_MODES:
        raise ValueError(f"turn_credit needs mode 'decision_stepwise' or 'env_sparse', got {mode!r}.")
    rewards = torch.where(valid.bool(), rewards.to(torch.float32), 0.0)  # [B, K]
    if mode == "env_sparse":
        rewards = rewards.flip(-1).cumsum(-1).flip(-1)  # [B, K] reward-to-go
    return rewards * valid


def turn_advantage(credit: Tensor, valid: Tensor, group: Tensor, beta: float) -> Tensor:
    """``adv[B, K] = beta * (c_{i,k} - mean_g(c))`` on valid turns, 0 elsewhere, where ``mean_g`` is the mean credit
    over every turn taken by the episodes of ``i``'s group (one prompt): the same group baseline as the sequence
    advantage, applied per decision."""
    valid = valid.to(torch.float32)
    index, n_groups = group_index(group)
    total = group_sum((credit * valid).sum(-1), index, n_groups)  # [B]
    count = group_sum(valid.sum(-1), index, n_groups)  # [B]
    mean = total / count.clamp_min(1)  # [B]
    return beta * (credit - mean[:, None]) * valid  # [B, K]


def spread_over_tokens(per_turn: Tensor, turn_index: Tensor) -> Tensor:
    """``[B, K] -> [B, T]``: each policy token gets its turn's value, environment tokens and padding 0."""
    picked = per_turn.gather(1, turn_index.clamp_min(0))  # [B, T]
    return torch.where(turn_index >= 0, picked, 0.0)


class StepRewards:
    """Per-turn advantages from the step rewards of multi-turn episodes.

    They follow the ``step_rewards_mode`` / ``step_rewards_beta`` of a hosted GSPO training service's config reference,
    and are added to every policy token of turn ``k`` on top of the sequence advantage:

    ``A_{i,t} += beta * (c_{i,k(t)} - mean over the turns taken in i's group of c)``, with the credit ``c`` of
    ``turn_credit``. Per-token advantages need a token-level gate (``ClipGate``, or GSPO-token:
    ``GSPO(per_token_advantage=true)``).

    Args:
        mode: ``decision_stepwise`` (each turn credited with its own step reward) or ``env_sparse`` (with the step
            rewards from it to the end).
        beta: weight of the per-turn advantage (>= 0).
    """

    def __init__(self, *, mode: StepRewardsMode = "decision_stepwise", beta: float = 1.0) -> None:
        if mode not in STEP_REWARDS_MODES:
            raise ValueError(f"StepRewards mode={mode!r} is not valid; choose one of {', '.join(STEP_REWARDS_MODES)}.")
        if beta < 0:
            raise ValueError(f"StepRewards beta={beta} must be >= 0 (the weight of the per-turn advantage).")
        self.mode, self.beta = mode, beta

    def __call__(self, turn_rewards: Tensor, group: Tensor, turn_index: Tensor) -> Tensor:
        """``turn_rewards[B, K]`` (NaN past the last turn), ``group[B]``, ``turn_index[B, T]`` -> ``adv[B, T]``."""
        valid = (~turn_rewards.isnan()).to(torch.float32)  # [B, K]
        credit = turn_credit(turn_rewards, valid, self.mode)  # [B, K]
        return spread_over_tokens(turn_advantage(credit, valid, group, self.beta), turn_index)
