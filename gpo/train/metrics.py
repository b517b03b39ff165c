"""What a training step logs about its rollout: rewards, lengths, advantages, timings and throughput."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from gpo.parallel import collectives
from gpo.rewards.runner import RewardFn, reward_name
from gpo.rollout.base import Rollout


def step_metrics(
    step: dict[str, Tensor], adv: Tensor, rewards: Sequence[RewardFn], reward_errors: Mapping[str, int]
) -> dict[str, Tensor]:
    """Statistics of the step's rows over every rank (``step`` and ``adv`` as from ``collectives.gather_step``);
    ``reward_errors`` counts this rank's samples scored as ``reward_errors.value``, per reward function."""
    lengths, reward, scores, mask = step["lengths"].float(), step["reward"], step["scores"], step["mask"]
    metrics = {
        "reward/mean": reward.mean(),
        "reward/std": reward.std() if len(reward) > 1 else reward.new_zeros(()),
        "completion/len_mean": lengths.mean(),
        "completion/len_max": lengths.max(),
        "completion/truncated_frac": step["truncated"].mean(),
        "adv/mean": (adv * mask).sum() / mask.sum().clamp_min(1),
        "adv/abs_mean": (adv.abs() * mask).sum() / mask.sum().clamp_min(1),
    }
    for k, fn in enumerate(rewards):
        metrics[f"reward/{reward_name(fn)}"] = scores[:, k].mean()
    for name, count in collectives.total_over_ranks(dict(reward_errors)).items():
        metrics[f"reward_errors/{name}"] = torch.tensor(float(count))
    return metrics


def throughput(
    rollout: Rollout, generated: float, rollout_s: float, scoring_s: float, training_s: float
) -> dict[str, float]:
    """Step time split and tokens/s: ``generated`` counts every sampled round, ``rollout`` is what trained."""
    processed = float(rollout.attention_mask.sum())
    return {
        "time/rollout_s": rollout_s,
        "time/scoring_s": scoring_s,
        "time/training_s": training_s,
        "throughput/rollout_tokens_per_s": generated / max(rollout_s, 1e-9),
        "throughput/training_tokens_per_s": processed / max(training_s, 1e-9),
    }
