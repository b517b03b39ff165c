"""Step rewards of multi-turn episodes: per-turn credit, and the per-turn advantage it adds to the policy's tokens.

Shapes: ``B`` episodes, ``K`` turns (the engine's ``max_turns``), ``T`` completion tokens. ``valid[B, K]`` is 1
on the turns an episode took; ``turn_index[B, T]`` names each token's policy turn (-1 on environment tokens and
padding).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from gpo.algo.masked import group_index, group_sum

StepRewardsMode = Literal["off", "decision_stepwise", "env_sparse"]
STEP_REWARDS_MODES = ("off", "decision_stepwise", "env_sparse")


def check_step_rewards(mode: str, beta: float) -> None:
    if mode not in STEP_REWARDS_MODES:
        raise ValueError(f"step_rewards_mode={mode!r} is not valid; choose one of {', '.join(STEP_REWARDS_MODES)}.")
    if beta < 0:
        raise ValueError(f"step_rewards_beta={beta} must be >= 0 (the weight of the per-turn advantage).")


def turn_credit(rewards: Tensor, valid: Tensor, mode: StepRewardsMode) -> Tensor:
    """``credit[B, K]`` of each turn from the environment's step rewards ``rewards[B, K]``.

    - ``decision_stepwise``: ``c_k = r_k``, each decision is credited with its own immediate reward;
    - ``env_sparse``: ``c_k = sum_{j >= k} r_j``, the reward-to-go, so a sparse reward (one at the end) reaches
      every decision that led to it.
    """
    if mode not in ("decision_stepwise", "env_sparse"):
        raise ValueError(f"turn_credit needs mode 'decision_stepwise' or 'env_sparse', got {mode!r}.")
    rewards = rewards.to(torch.float32) * valid  # [B, K]
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
    return torch.where(turn_index >= 0, picked, torch.zeros_like(picked))
