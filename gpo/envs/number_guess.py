"""The built-in environment: guess a secret number, told "higher" or "lower" after each guess."""

from __future__ import annotations

import random
import re

from gpo.envs.base import Environment, Step

NUMBER = re.compile(r"-?\d+")


class NumberGuess(Environment):
    """A number-guessing game with higher / lower feedback, small enough for a tiny model.

    The secret is drawn uniformly from ``[low, high]`` by ``seed``; each turn the first integer in the action is
    the guess. A right guess ends the episode with reward ``win_reward``; otherwise the observation says
    ``higher``, ``lower`` or ``invalid`` (no integer in the action) and the reward is 0. Bisection wins within
    ``ceil(log2(high - low + 2))`` turns; small enough for a tiny model to learn on a CPU.

    Args:
        low: smallest secret.
        high: largest secret.
        win_reward: reward of the turn that guesses right.
    """

    def __init__(self, *, low: int = 1, high: int = 8, win_reward: float = 1.0) -> None:
        if low > high:
            raise ValueError(f"NumberGuess low={low} must be <= high={high}.")
        self.low, self.high, self.win_reward = low, high, win_reward
        self.secret: int | None = None

    def reset(self, seed: int, task: str) -> str:
        self.secret = random.Random(seed).randint(self.low, self.high)
        return ""

    def step(self, action: str) -> Step:
        if self.secret is None:
            raise RuntimeError("NumberGuess.step called before reset.")
        found = NUMBER.search(action)
        if found is None:
            return Step("invalid\n", 0.0, False, {"guess": None})
        try:
            guess = int(found.group())
        except ValueError:  # more digits than int() accepts: a turn the game cannot use
            return Step("invalid\n", 0.0, False, {"guess": None})
        if guess == self.secret:
            return Step("correct\n", self.win_reward, True, {"guess": guess})
        return Step("higher\n" if guess < self.secret else "lower\n", 0.0, False, {"guess": guess})
