"""gpo.rewards: built-in reward functions.

Each is a TRL-style callable ``(prompts, completions, **columns) -> list[float]``, one float per completion.
"""

from gpo.rewards.builtin import (
    LengthPenalty,
    RegexFormat,
    answer_column,
    column,
    exact_match,
    math_answer,
    needs_columns,
    positional_match,
)

__all__ = [
    "LengthPenalty",
    "RegexFormat",
    "answer_column",
    "column",
    "exact_match",
    "math_answer",
    "needs_columns",
    "positional_match",
]
