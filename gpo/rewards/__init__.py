"""gpo.rewards: reward functions, the runner that calls them, and judges over HTTP.

Each reward is a TRL-style callable ``(prompts, completions, **columns) -> list[float]``, one float per completion.
"""

from gpo.rewards.builtin import (
    LengthPenalty,
    RegexFormat,
    answer_column,
    bounded_time,
    column,
    env_reward,
    exact_match,
    math_answer,
    needs_columns,
    positional_match,
)
from gpo.rewards.judge import JudgeError, JudgeReward
from gpo.rewards.runner import ServedReward
from gpo.rewards.shaping import DuplicatePenalty, SoftOverlongPunishment

__all__ = [
    "DuplicatePenalty",
    "JudgeError",
    "JudgeReward",
    "LengthPenalty",
    "RegexFormat",
    "ServedReward",
    "SoftOverlongPunishment",
    "answer_column",
    "bounded_time",
    "column",
    "env_reward",
    "exact_match",
    "math_answer",
    "needs_columns",
    "positional_match",
]
