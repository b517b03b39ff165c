"""How a rollout becomes optimiser steps: learning rate and its schedule, minibatches, epochs, micro-batches."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

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

    def build(
        self, params: list[torch.nn.Parameter], total_steps: int | None
    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        """AdamW over ``params`` and its learning-rate schedule; a schedule that needs ``trainer.max_steps``
        (``total_steps``) and has none fails here, before training.

        The fused AdamW kernel updates every parameter in one pass (the same update; Hugging Face's ``Trainer``
        defaults to it too). On a CPU it takes a sixth to a quarter of the time of torch's default per-parameter loop
        (``docs/performance.md``)."""
        optimizer = torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay, fused=True)
        self.lr_factor(self.warmup_steps, total_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: self.lr_factor(step, total_steps))
        return optimizer, scheduler

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
