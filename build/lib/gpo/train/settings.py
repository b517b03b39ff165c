"""Grouped settings of GPOModule: how a rollout becomes optimiser steps, and how evaluation runs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

LRSchedule = Literal["constant", "linear", "cosine"]


@dataclass(frozen=True)
class Optimization:
    """How one rollout batch becomes optimiser steps.

    Args:
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        max_grad_norm: clip the global gradient norm to this (None: no clipping).
        number_of_minibatches: optimiser steps per rollout batch and epoch (the batch is split this many ways).
        ppo_epochs: passes over the rollout batch.
        micro_batch_size: completions per forward/backward pass (None: a whole minibatch at once); it changes
            memory only, never the gradient.
        lr_schedule: ``constant``, or ``linear`` / ``cosine`` decay to 0 at ``trainer.max_steps``.
        warmup_steps: optimiser steps of linear warm-up from 0 to ``lr`` before the schedule.
        max_consecutive_nonfinite: an update whose loss or gradient is NaN/inf is skipped (and logged); this many
            skips in a row stop the run.
    """

    lr: float = 1e-6
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    number_of_minibatches: int = 1
    ppo_epochs: int = 1
    micro_batch_size: int | None = None
    lr_schedule: LRSchedule = "constant"
    warmup_steps: int = 0
    max_consecutive_nonfinite: int = 5

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"model.optim.lr={self.lr} must be > 0 (1e-6 is usual for full fine-tuning).")
        if self.weight_decay < 0:
            raise ValueError(f"model.optim.weight_decay={self.weight_decay} must be >= 0 (0 disables it).")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"model.optim.max_grad_norm={self.max_grad_norm} must be > 0; set it to null to not clip.")
        for name in ("number_of_minibatches", "ppo_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.optim.{name}={getattr(self, name)} must be >= 1 (1: one update per rollout).")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(
                f"model.optim.micro_batch_size={self.micro_batch_size} must be >= 1, or null for a whole minibatch "
                "per pass."
            )
        if self.lr_schedule not in ("constant", "linear", "cosine"):
            raise ValueError(
                f"model.optim.lr_schedule={self.lr_schedule!r} is not valid; choose constant, linear or cosine."
            )
        if self.warmup_steps < 0:
            raise ValueError(f"model.optim.warmup_steps={self.warmup_steps} must be >= 0 (0: no warm-up).")
        if self.max_consecutive_nonfinite < 1:
            raise ValueError(f"model.optim.max_consecutive_nonfinite={self.max_consecutive_nonfinite} must be >= 1.")

    def lr_factor(self, step: int, total_steps: int | None) -> float:
        """Multiplier of ``lr`` at optimiser step ``step``: linear warm-up, then the schedule's decay to 0 at
        ``total_steps`` (cosine: ``0.5 (1 + cos(pi p))`` with ``p`` the fraction of the decay done)."""
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.lr_schedule == "constant":
            return 1.0
        if total_steps is None or total_steps <= self.warmup_steps:
            raise ValueError(
                f"model.optim.lr_schedule={self.lr_schedule!r} decays to 0 at trainer.max_steps; set "
                f"trainer.max_steps above model.optim.warmup_steps={self.warmup_steps}."
            )
        done = min(1.0, (step - self.warmup_steps) / (total_steps - self.warmup_steps))
        return 1.0 - done if self.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))


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
