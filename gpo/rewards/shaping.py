"""Shaping rewards: DAPO's soft overlong punishment and a penalty on repeated completions, as reward functions.

Add them to ``model.rewards`` next to the task's reward; the mixer sums them (weight 1 each by default).
"""

from __future__ import annotations

import math
from typing import Any

from gpo.rewards.builtin import column


class SoftOverlongPunishment:
    """DAPO's soft overlong punishment: a length penalty that ramps up near the limit.

    DAPO is Yu et al. 2025. The penalty ramps up over the last
    ``cache_length`` tokens of the budget.

    ``R(|y|) = 0`` if ``|y| <= L_max - L_cache``; ``((L_max - L_cache) - |y|) / L_cache`` if
    ``L_max - L_cache < |y| <= L_max``; ``-1`` if ``|y| > L_max``, with ``|y|`` the completion's length in tokens
    (EOS included; column ``completion_ids``).

    Args:
        max_length: ``L_max``, the length at which the penalty reaches -1 (DAPO: 20480).
        cache_length: ``L_cache``, the width of the ramp (DAPO: 4096).
        name: the key this reward's mean is logged under (``reward/<name>``).
    """

    def __init__(self, *, max_length: int, cache_length: int, name: str = "soft_overlong") -> None:
        if not 0 < cache_length <= max_length:
            raise ValueError(
                f"SoftOverlongPunishment: cache_length={cache_length} must be in [1, max_length={max_length}] "
                "(DAPO used 4096 of 20480)."
            )
        self.max_length, self.cache_length = max_length, cache_length
        self.name = self.__name__ = name

    def penalty(self, length: int) -> float:
        """``R(length)``, in [-1, 0]."""
        safe = self.max_length - self.cache_length
        if length <= safe:
            return 0.0
        return -1.0 if length > self.max_length else (safe - length) / self.cache_length

    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        return [self.penalty(len(ids)) for ids in column(self.name, "completion_ids", completions, columns)]


class DuplicatePenalty:
    """Penalise a completion identical to an earlier completion of the same prompt (a "no repeat" pressure).

    The first occurrence of each distinct completion keeps its reward; every later copy of it among the completions
    of the same prompt text in the batch gets ``penalty``. Completions are compared by token ids (column
    ``completion_ids``), so two texts that decode alike from different tokens are different.

    Args:
        penalty: the reward of each repeat (<= 0).
        name: the key this reward's mean is logged under (``reward/<name>``).
    """

    def __init__(self, *, penalty: float = -1.0, name: str = "duplicate_penalty") -> None:
        if not math.isfinite(penalty) or penalty > 0:
            raise ValueError(
                f"DuplicatePenalty: penalty={penalty} must be a finite number <= 0: it is the reward of a repeat."
            )
        self.penalty = penalty
        self.name = self.__name__ = name

    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        seen, out = set(), []
        for prompt, ids in zip(prompts, column(self.name, "completion_ids", completions, columns), strict=True):
            key = (prompt, tuple(ids))
            out.append(self.penalty if key in seen else 0.0)
            seen.add(key)
        return out
