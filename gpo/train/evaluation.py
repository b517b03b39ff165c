"""Held-out evaluation: greedy and sampled completions of the validation prompts, scored like training's."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from lightning import LightningModule
from torch import Tensor

from gpo.algo.mixers import weighted_sum
from gpo.rewards.runner import RewardFn, reward_name
from gpo.rollout.base import Sampling, check_temperature_and_top_p
from gpo.rollout.collector import Collector
from gpo.seeds import stream_seed


@dataclass(frozen=True)
class Evaluation:
    """Held-out evaluation settings, run by Lightning's validation loop.

    ``trainer.val_check_interval`` sets how often (the
    final policy: ``gpo validate --config ... --ckpt_path last``).

    Each prompt gets one greedy completion and, for each of ``seeds``, ``samples`` (k) sampled ones at the
    evaluation's own temperature and top-p, so evaluations are comparable across the run. A completion passes when
    its reward (or the score of ``pass_reward`` alone) is at least ``pass_threshold``. Logged: ``val/reward_greedy``,
    ``val/pass@1_greedy``, ``val/reward_sampled`` and ``val/pass@1_sampled`` (means over the sampled completions),
    ``val/pass@k`` (the fraction of prompts with at least one passing sample among its k), each averaged over the
    seeds. With several reward functions, each one's mean too: ``val/reward_greedy/<name>``,
    ``val/reward_sampled/<name>``. The reward is the reward functions' weighted sum (``gpo.algo.mixers.weighted_sum``),
    as ``reward/mean`` in training is: a mixer that normalises within groups (GDPO) would make it 0; a pass reads it
    too, unless ``pass_reward`` names the one function that says whether a completion is right (a format bonus or a
    length penalty in the sum would move a completion across ``pass_threshold``).

    Args:
        samples: sampled completions per prompt and seed (the k of pass@k).
        temperature: sampling temperature of the evaluation; None: the rollout engine's.
        top_p: nucleus mass of the evaluation; None: the rollout engine's.
        pass_threshold: reward at or above which a completion counts as solved.
        pass_reward: the reward function (its name, as in ``reward/<name>``) whose score alone decides a pass; None:
            the weighted sum of them all.
        seeds: sampling seeds; the sampled metrics are their mean.
    """

    samples: int = 4
    temperature: float | None = None
    top_p: float | None = None
    pass_threshold: float = 1.0
    pass_reward: str | None = None
    seeds: tuple[int, ...] = (1234,)

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(
                f"model.evaluation.samples={self.samples} must be >= 1 (sampled completions per held-out prompt)."
            )
        if not math.isfinite(self.pass_threshold):
            raise ValueError(f"model.evaluation.pass_threshold={self.pass_threshold} must be a finite number.")
        if not self.seeds:
            raise ValueError("model.evaluation.seeds is empty; give at least one seed (e.g. [1234]).")
        check_temperature_and_top_p(1.0 if self.temperature is None else self.temperature,
                                    1.0 if self.top_p is None else self.top_p, "model.evaluation")  # fmt: skip

    def sampling(self, engine_sampling: Sampling) -> Sampling:
        """The engine's sampling with this evaluation's temperature and top-p where they are set."""
        changes = {"temperature": self.temperature, "top_p": self.top_p}
        return replace(engine_sampling, **{k: v for k, v in changes.items() if v is not None})


def evaluate(collector: Collector, batch: dict[str, Any], batch_idx: int, settings: Evaluation) -> dict[str, Tensor]:
    """The evaluation metrics of ``batch`` (see ``Evaluation``) and ``val/reward_errors_{kind}/<name>`` (counts of
    samples scored as ``reward_errors.value``)."""
    errors, sampled, parts = Counter(), [], []
    greedy_seed = stream_seed("eval/greedy", settings.seeds[0], batch_idx)  # a multi-turn episode's seed, too
    greedy = collector.score(collector.sample(batch, seed=greedy_seed, greedy=True, n=1), errors)
    greedy_reward = weighted_sum(greedy.scores, collector.mixer.weights)  # [B]
    passed = passes(greedy.scores, greedy_reward, collector.rewards, settings)  # [B]
    metrics = {"val/reward_greedy": greedy_reward.mean(), "val/pass@1_greedy": passed.mean()}
    metrics |= _each_reward("val/reward_greedy", collector, greedy.scores.mean(0))
    metrics |= {f"val/reward_errors_greedy/{name}": greedy.reward.new_tensor(c) for name, c in errors.items()}
    errors, sampling = Counter(), settings.sampling(collector.engine.sampling)
    for seed in settings.seeds:
        rollout = collector.sample(
            batch, seed=stream_seed("eval", seed, batch_idx), n=settings.samples, sampling=sampling
        )
        rollout = collector.score(rollout, errors)
        sampled_reward = weighted_sum(rollout.scores, collector.mixer.weights)  # [B]
        passed = passes(rollout.scores, sampled_reward, collector.rewards, settings)  # [B]
        _, prompt = torch.unique(rollout.group, return_inverse=True)  # [B]
        any_passed = passed.new_zeros(int(prompt.max()) + 1).scatter_reduce(0, prompt, passed, "amax")  # [prompts]
        sampled.append(torch.stack([sampled_reward.mean(), passed.mean(), any_passed.mean()]))  # [3]
        parts.append(rollout.scores.mean(0))  # [K]
    reward, pass1, passk = torch.stack(sampled).mean(0)  # over the seeds
    metrics |= {"val/reward_sampled": reward, "val/pass@1_sampled": pass1, f"val/pass@{settings.samples}": passk}
    metrics |= _each_reward("val/reward_sampled", collector, torch.stack(parts).mean(0))
    return metrics | {f"val/reward_errors_sampled/{name}": reward.new_tensor(c) for name, c in errors.items()}


def log_evaluation(module: LightningModule, metrics: dict[str, Tensor], prompts: int) -> None:
    """Log ``evaluate``'s metrics of a batch of ``prompts``: means over the validation set and the ranks, and sums of
    the reward-error counts; ``val/reward_greedy`` on the progress bar."""
    for name, value in metrics.items():
        if "/reward_errors_" in name:
            module.log(name, value, batch_size=prompts, reduce_fx="sum", sync_dist=True)  # summed over the ranks
        else:
            module.log(name, value, batch_size=prompts, prog_bar=name == "val/reward_greedy", sync_dist=True)


def _each_reward(prefix: str, collector: Collector, means: Tensor) -> dict[str, Tensor]:
    """``means[K]`` of the reward functions under ``prefix/<name>`` when there are several (one is the reward)."""
    if len(collector.rewards) < 2:
        return {}
    return {f"{prefix}/{reward_name(fn)}": mean for fn, mean in zip(collector.rewards, means, strict=True)}


def passes(scores: Tensor, reward: Tensor, rewards: Sequence[RewardFn], settings: Evaluation) -> Tensor:
    """``[B]``: 1.0 where a completion passes, 0.0 elsewhere: its score of the reward function named
    ``settings.pass_reward`` in ``scores[B, K]`` (``K`` = ``rewards``), or else its ``reward[B]`` (the weighted sum), at
    or above ``settings.pass_threshold``."""
    if settings.pass_reward is not None:
        reward = scores[:, [reward_name(fn) for fn in rewards].index(settings.pass_reward)]
    return (reward >= settings.pass_threshold).float()
