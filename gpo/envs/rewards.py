"""Reward functions reading what ``MultiTurnEngine`` records of each episode."""

from __future__ import annotations

from collections.abc import Sequence


def env_reward(
    prompts: Sequence[str], completions: Sequence[str], env_return: Sequence[float] | None = None, **columns
) -> list[float]:
    """The environment's return of each episode: the sum of its step rewards (column ``env_return``)."""
    if env_return is None:
        raise ValueError(
            "reward env_reward needs the 'env_return' column of multi-turn rollouts; set model.engine to a "
            "gpo.rollout.MultiTurnEngine."
        )
    return [float(value) for value in env_return]
