"""Reward shaping terms added to a completion's reward before advantages are computed."""

from __future__ import annotations

import torch
from torch import Tensor

from gpo.algo.masked import group_index


class SoftOverlongPunishment:
    """DAPO's soft overlong punishment: a length penalty that ramps up over the last ``cache_length`` tokens.

    ``R(|y|) = 0`` if ``|y| <= L_max - L_cache``; ``((L_max - L_cache) - |y|) / L_cache`` if
    ``L_max - L_cache < |y| <= L_max``; ``-1`` if ``|y| > L_max``. Added to the task reward.

    Args:
        max_length: ``L_max``, the length at which the penalty reaches -1.
        cache_length: ``L_cache``, the width of the ramp.
    """

    def __init__(self, *, max_length: int, cache_length: int) -> None:
        if not 0 < cache_length <= max_length:
            raise ValueError(
                f"cache_length={cache_length} must be in [1, max_length={max_length}] (DAPO used 4096 of 20480)."
            )
        self.max_length, self.cache_length = max_length, cache_length

    def __call__(self, lengths: Tensor) -> Tensor:
        """``lengths[B]`` completion lengths in tokens -> penalty ``[B]`` (<= 0)."""
        lengths = lengths.to(torch.float32)
        safe = self.max_length - self.cache_length
        ramp = (safe - lengths) / self.cache_length
        penalty = torch.where(lengths <= safe, torch.zeros_like(lengths), ramp)
        return torch.where(lengths > self.max_length, torch.full_like(lengths, -1.0), penalty)


class DuplicatePenalty:
    """Penalise completions identical to an earlier one in the same group (a "no repeat" pressure).

    The first occurrence of each distinct completion keeps its reward; every later copy in the group gets
    ``penalty`` added. Two completions are identical when their token ids over the mask are equal.

    Args:
        penalty: added to each repeated completion's reward (negative).
    """

    def __init__(self, *, penalty: float = -1.0) -> None:
        if penalty > 0:
            raise ValueError(f"penalty={penalty} must be <= 0: it is added to the reward of repeats.")
        self.penalty = penalty

    def __call__(self, tokens: Tensor, mask: Tensor, group: Tensor) -> Tensor:
        """``tokens[B, T]``, ``mask[B, T]``, ``group[B]`` -> reward term ``[B]``."""
        index, _ = group_index(group)
        lengths = mask.sum(-1, keepdim=True)
        key = torch.cat([index[:, None], lengths, torch.where(mask.bool(), tokens, -1)], dim=-1)  # [B, T + 2]
        _, key_id = torch.unique(key, dim=0, return_inverse=True)  # [B]
        same = key_id[:, None] == key_id[None, :]  # [B, B]
        earlier = torch.ones_like(same).tril(-1)
        repeated = (same & earlier).any(-1)  # [B]: an identical row comes before it
        return torch.where(repeated, self.penalty, 0.0).to(torch.float32)
