"""Held-out evaluation: greedy and sampled completions of the validation prompts, scored like training's."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from gpo.rollout.collector import Collector


@dataclass(frozen=True)
class Evaluation:
    """Held-out evaluation, run by Lightning's validation loop (``trainer.val_check_interval`` sets how often).

    Each prompt gets one greedy completion and ``samples`` sampled ones, with a fixed seed so evaluations are
    comparable across the run. Logged: ``val/reward_greedy``, ``val/pass@1_greedy``, ``val/reward_sampled``,
    ``val/pass@1_sampled``; a completion passes when its reward is at least ``pass_threshold``.

    Args:
        samples: sampled completions per prompt.
        pass_threshold: reward at or above which a completion counts as solved.
        seed: sampling seed of every evaluation.
    """

    samples: int = 4
    pass_threshold: float = 1.0
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(
                f"model.evaluation.samples={self.samples} must be >= 1 (sampled completions per held-out prompt)."
            )
        if not math.isfinite(self.pass_threshold):
            raise ValueError(f"model.evaluation.pass_threshold={self.pass_threshold} must be a finite number.")


def evaluate(collector: Collector, batch: dict[str, Any], batch_idx: int, settings: Evaluation) -> dict[str, Tensor]:
    """``val/reward_{kind}`` and ``val/pass@1_{kind}`` (means over the batch's completions) and
    ``val/reward_errors_{kind}/<name>`` (counts) for the ``greedy`` and ``sampled`` completions of ``batch``."""
    metrics = {}
    for kind, n, greedy in (("greedy", 1, True), ("sampled", settings.samples, False)):
        errors = Counter()
        rollout = collector.score(collector.sample(batch, seed=settings.seed + batch_idx, greedy=greedy, n=n), errors)
        metrics[f"val/reward_{kind}"] = rollout.reward.mean()
        metrics[f"val/pass@1_{kind}"] = (rollout.reward >= settings.pass_threshold).float().mean()
        metrics |= {f"val/reward_errors_{kind}/{name}": rollout.reward.new_tensor(c) for name, c in errors.items()}
    return metrics
