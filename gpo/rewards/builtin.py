"""Built-in reward functions: ``(prompts, completions, **columns) -> list[float]``, one float per completion.

``columns`` are the dataset's extra columns plus ``completion_ids``, one value per completion; unknown ones are ignored.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, TypeVar

from gpo.rewards.answers import math_equal_batch

Reward = TypeVar("Reward", bound=Callable[..., Any])


def needs_columns(*names: str) -> Callable[[Reward], Reward]:
    """Declare the dataset columns a reward reads from ``**columns`` (as ``fn.required_columns``), so a run whose
    dataset lacks one fails in setup, before any sampling (see ``gpo.rewards.signature.required_columns``)."""

    def declare(fn: Reward) -> Reward:
        fn.required_columns = names
        return fn

    return declare


def bounded_time(fn: Reward) -> Reward:
    """Declare that a reward returns promptly by construction (one pass over the strings, no I/O, no search), as
    ``fn.bounded_time``: the runner then calls it directly instead of in a thread timed by
    ``model.reward_errors.timeout_s`` (a thread handoff per call, about 0.2 ms)."""
    fn.bounded_time = True
    return fn


def column(fn_name: str, name: str, completions: list[str], columns: dict[str, Any]) -> list[Any]:
    """``columns[name]``, checked to hold one value per completion; errors name the function and the column."""
    if name not in columns:
        have = ", ".join(sorted(columns)) or "(no columns)"
        raise ValueError(f"{fn_name} needs a column '{name}'; the dataset has: {have}")
    values = list(columns[name])
    if len(values) != len(completions):
        raise ValueError(
            f"{fn_name}: column '{name}' has {len(values)} values for {len(completions)} completions; "
            "it needs one per completion."
        )
    return values


def answer_column(fn_name: str, completions: list[str], columns: dict[str, Any]) -> list[str]:
    """The ``answer`` column as stripped strings (numbers are formatted with ``str``; ``None`` is an error)."""
    values = column(fn_name, "answer", completions, columns)
    for i, value in enumerate(values):
        if value is None:
            raise ValueError(f"{fn_name}: column 'answer' is None at row {i}; every row needs an answer.")
    return [str(value).strip() for value in values]


@bounded_time
@needs_columns("answer")
def exact_match(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """1.0 if the completion equals the ``answer`` column (both stripped of surrounding whitespace), else 0.0."""
    golds = answer_column("exact_match", completions, columns)
    return [float(completion.strip() == gold) for completion, gold in zip(completions, golds, strict=True)]


@needs_columns("answer")
def math_answer(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """1.0 if the completion's final answer is mathematically equal to the ``answer`` column, else 0.0.

    Uses ``math-verify``: the answer is taken from ``\\boxed{}`` or an "answer:" phrase if present, else the last
    LaTeX or plain number/expression, and compared symbolically and numerically (``0.5`` equals
    ``\\frac{1}{2}``, ``1,000`` equals ``1000``). No parsable math on either side, or a timeout, scores 0.0.
    Each parse and comparison may take 5 s; off the main thread, where math-verify cannot bound them, they run in a
    child process (``gpo.rewards.answers``).
    """
    golds = answer_column("math_answer", completions, columns)
    return [float(ok) for ok in math_equal_batch(golds, completions)]


@bounded_time
@needs_columns("answer")
def positional_match(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """Fraction in [0, 1] of the ``answer``'s character positions the completion matches (partial credit).

    Both are stripped; position ``i`` counts if ``completion[i] == answer[i]``, for ``i < len(answer)``, so
    extra characters neither add nor subtract. For synthetic tasks (e.g. sort the digits). Empty answer -> error.
    """
    golds = answer_column("positional_match", completions, columns)
    out = []
    for i, (completion, gold) in enumerate(zip(completions, golds, strict=True)):
        if not gold:
            raise ValueError(f"positional_match: column 'answer' is empty at row {i}; there is nothing to match.")
        hits = sum(a == b for a, b in zip(completion.strip(), gold, strict=False))
        out.append(hits / len(gold))
    return out


class RegexFormat:
    """``reward`` if ``pattern`` matches the completion (``re.search``, or ``re.fullmatch`` when ``full_match``).

    Range: ``{0.0, reward}``. Typical use: reward a ``<think>...</think><answer>...</answer>`` layout.

    Args:
        pattern: a Python regular expression, compiled once with ``re.DOTALL`` (``.`` matches newlines).
        reward: the score of a matching completion; a non-matching one scores 0.0.
        full_match: require the whole completion to match instead of any part of it.
        name: the key the trainer logs this reward's mean under (``reward/<name>``).
    """

    def __init__(
        self, *, pattern: str, reward: float = 1.0, full_match: bool = False, name: str = "regex_format"
    ) -> None:
        if not math.isfinite(reward):
            raise ValueError(f"RegexFormat: reward={reward} must be a finite number.")
        try:
            self.regex = re.compile(pattern, re.DOTALL)
        except re.error as e:
            raise ValueError(f"RegexFormat: pattern {pattern!r} is not a valid regular expression: {e}") from e
        self.pattern, self.reward, self.full_match = pattern, float(reward), full_match
        self.name = self.__name__ = name

    def __call__(self, prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        match = self.regex.fullmatch if self.full_match else self.regex.search
        return [self.reward if match(completion) else 0.0 for completion in completions]

    def __repr__(self) -> str:
        return (
            f"RegexFormat(pattern={self.pattern!r}, reward={self.reward}, full_match={self.full_match}, "
            f"name={self.name!r})"
        )


class LengthPenalty:
    """0.0 up to ``max_tokens`` completion tokens, then ``-penalty_per_token`` per extra token.

    Range: ``(-inf, 0]``: ``-penalty_per_token * max(0, n - max_tokens)`` with ``n = len(completion_ids)``.

    Args:
        max_tokens: completion length in tokens allowed without penalty (>= 0).
        penalty_per_token: penalty per token beyond ``max_tokens`` (finite, >= 0).
        name: the key the trainer logs this reward's mean under (``reward/<name>``).
    """

    def __init__(self, *, max_tokens: int, penalty_per_token: float = 0.01, name: str = "length_penalty") -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"LengthPenalty: max_tokens={max_tokens!r} must be an integer >= 0.")
        if not (math.isfinite(penalty_per_token) and penalty_per_token >= 0):
            raise ValueError(
                f"LengthPenalty: penalty_per_token={penalty_per_token!r} must be finite and >= 0 "
                "(it is subtracted per extra token)."
            )
        self.max_tokens, self.penalty_per_token = max_tokens, float(penalty_per_token)
        self.name = self.__name__ = name

    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        ids = column(self.name, "completion_ids", completions, columns)
        return [0.0 - self.penalty_per_token * max(0, len(row) - self.max_tokens) for row in ids]

    def __repr__(self) -> str:
        return (
            f"LengthPenalty(max_tokens={self.max_tokens}, penalty_per_token={self.penalty_per_token}, "
            f"name={self.name!r})"
        )


def env_reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """The environment's return of each multi-turn episode: the sum of its step rewards (column ``env_return``,
    which ``gpo.rollout.MultiTurnEngine`` fills)."""
    if "env_return" not in columns:
        raise ValueError(
            "reward env_reward needs the 'env_return' column of multi-turn rollouts; set model.engine to a "
            "gpo.rollout.MultiTurnEngine."
        )
    return [float(value) for value in column("env_reward", "env_return", completions, columns)]
