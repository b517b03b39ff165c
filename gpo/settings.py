"""Grouped settings of GPOModule: how a rollout becomes optimiser steps, and how evaluation runs."""

from __future__ import annotations

from dataclasses import dataclass


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
    """

    lr: float = 1e-6
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    number_of_minibatches: int = 1
    ppo_epochs: int = 1
    micro_batch_size: int | None = None

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be > 0.")
        for name in ("number_of_minibatches", "ppo_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={self.micro_batch_size} must be >= 1 (or None).")


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
