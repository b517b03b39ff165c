"""Running reward functions on a rollout: one column of scores per function, checked row by row."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from gpo.rollout.base import Rollout

RewardFn = Callable[..., Sequence[float]]


def reward_name(fn: RewardFn) -> str:
    """The name a reward function's mean is logged under (``reward/<name>``)."""
    return getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__


def score(rewards: Sequence[RewardFn], rollout: Rollout) -> Tensor:
    """``scores[B, K]``: reward function ``k`` applied to every completion of the rollout.

    Each function gets ``(prompts, completions, **fields, completion_ids=...)``. A function that returns the
    wrong number of values, or a None/NaN/inf value, is reported with its name and the prompt concerned.
    """
    pairs = zip(rollout.completion_ids, rollout.completion_mask, strict=True)
    completion_ids = [ids[mask.bool()].tolist() for ids, mask in pairs]
    columns = {**rollout.fields, "completion_ids": completion_ids}
    out = torch.empty(len(rollout), len(rewards), dtype=torch.float32)
    for k, fn in enumerate(rewards):
        values = list(fn(rollout.prompts, rollout.completions, **columns))
        if len(values) != len(rollout):
            raise ValueError(
                f"reward function {reward_name(fn)!r} returned {len(values)} values for {len(rollout)} completions."
            )
        for row, value in enumerate(values):
            if value is None or not math.isfinite(float(value)):
                raise ValueError(
                    f"reward function {reward_name(fn)!r} returned {value!r} for prompt {rollout.prompts[row]!r} "
                    f"and completion {rollout.completions[row]!r}; rewards must be finite numbers."
                )
        out[:, k] = torch.tensor([float(v) for v in values])
    return out
