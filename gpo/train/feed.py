"""Where each training step's rollout comes from: collected when the step asks for it, or by a pipeline ahead."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

from gpo.rollout.base import Rollout
from gpo.rollout.collector import CollectionStats, Collector
from gpo.rollout.pipeline import Collected, RolloutPipeline
from gpo.train.learner import Learner

Metrics = dict[str, Tensor]


class RolloutFeed:
    """Sample, then train, in turn: batch ``j``'s rollout is collected when step ``j`` asks for it.

    The rollout handed to the learner has the reward-placed KL penalty applied (``Learner.add_kl_penalty``).
    ``PipelinedFeed`` keeps the same calls and collects ahead.
    """

    def __init__(self, collector: Collector, learner: Learner) -> None:
        self.collector, self.learner = collector, learner
        self.batch: dict[str, Any] | None = None
        self.index = 0

    def submit(self, batch: dict[str, Any] | None, index: int) -> None:
        """Training batch ``index`` (the count of batches before it); None where this rank holds no prompts."""
        self.batch, self.index = batch, index

    def ready(self) -> bool:
        """Whether a rollout can be taken this step (a pipeline that is still filling has none)."""
        return True

    def take(self) -> Rollout | None:
        """The rollout of the oldest batch submitted and not yet taken; None where this rank holds no prompts."""
        self.collector.begin_step(self.index)
        return None if self.batch is None else self.learner.add_kl_penalty(self.collector.collect(self.batch))

    def draw_more(self) -> Rollout:
        """Another batch of training prompts, sampled and scored now (``DynamicSampling``'s extra draws)."""
        return self.learner.add_kl_penalty(self.collector.collect_more())

    def within_bound(self, rollout: Rollout) -> tuple[Rollout, int]:
        """``rollout`` without rows sampled too long ago, and how many were dropped (here: none are)."""
        return rollout, 0

    @property
    def samples_on_trainer(self) -> bool:
        """Whether the collection's time is spent inside the training step (it is part of the step's rollout time)."""
        return True

    @property
    def sampler_process(self) -> bool:
        """Whether rollouts are sampled in a worker process from its own copy of the policy (``ProcessEngine``)."""
        return False

    @property
    def lag(self) -> int:
        """Training steps a rollout may be collected ahead of the step that trains it (``max_off_policy_steps``)."""
        return 0

    def trained(self, model: PreTrainedModel, rollout: Rollout, dropped: int, device: torch.device) -> Metrics:
        """After the step's updates: hand ``model``'s new weights on where the sampler needs them; the step's feed
        metrics."""
        return {}

    # ---- set-up, resume and shutdown (the pipeline's threads, worker and pending rollouts) ---------------------

    def split_threads(self) -> None:
        """Leave a sampler worker process its torch threads (nothing to do here)."""

    def start(self, model: PreTrainedModel) -> None:
        """At the start of training, after a checkpoint's weights are loaded."""

    def state(self) -> dict[str, Any] | None:
        return None

    def load_state(self, state: dict[str, Any] | None) -> None:
        """Put back what ``state`` saved."""

    def close(self) -> None:
        """Stop sampling threads and workers."""


class PipelinedFeed(RolloutFeed):
    """Batch ``j``'s rollout is collected on the pipeline's sampler thread while the learner trains earlier batches,
    by the policy after ``max(0, j - lag)`` training steps (``gpo.rollout.pipeline``); the first ``lag`` steps only
    fill the pipeline."""

    def __init__(self, collector: Collector, learner: Learner, pipeline: RolloutPipeline) -> None:
        super().__init__(collector, learner)
        self.pipeline = pipeline

    def submit(self, batch: dict[str, Any] | None, index: int) -> None:
        self.pipeline.submit(functools.partial(self._collect, batch, index))

    def _collect(self, batch: dict[str, Any] | None, index: int) -> Collected:
        """Batch ``index``'s rollout, collected on the sampler thread."""
        if batch is None:
            return Collected(index, None, CollectionStats())
        rollout, stats = self.collector.collect_ahead(batch, index)
        return Collected(index, rollout, stats)

    def ready(self) -> bool:
        return self.pipeline.ready()

    def take(self) -> Rollout | None:
        ahead = self.pipeline.next()
        self.collector.begin_step(ahead.step, ahead.stats)
        return None if ahead.rollout is None else self.learner.add_kl_penalty(ahead.rollout.to(self.collector.device))

    def within_bound(self, rollout: Rollout) -> tuple[Rollout, int]:
        return self.pipeline.within_bound(rollout)

    @property
    def samples_on_trainer(self) -> bool:
        return False

    @property
    def sampler_process(self) -> bool:
        return self.pipeline.worker is not None

    @property
    def lag(self) -> int:
        return self.pipeline.lag

    def trained(self, model: PreTrainedModel, rollout: Rollout, dropped: int, device: torch.device) -> Metrics:
        metrics = self.pipeline.metrics(rollout, dropped, device)
        self.pipeline.engine.trained_steps += 1
        self.pipeline.push(model)
        return metrics

    def split_threads(self) -> None:
        self.pipeline.split_threads()

    def start(self, model: PreTrainedModel) -> None:
        self.pipeline.push(model)  # a worker started earlier (a sanity check) holds the weights from before a restore

    def state(self) -> dict[str, Any] | None:
        return self.pipeline.state()  # waits for what is in flight

    def load_state(self, state: dict[str, Any] | None) -> None:
        self.pipeline.load_state(state)  # before start(): its weight push carries the restored version

    def close(self) -> None:
        self.pipeline.close()


def rollout_feed(collector: Collector, learner: Learner, pipeline: RolloutPipeline | None) -> RolloutFeed:
    """The feed for a run: pipelined when ``pipeline`` is given (``max_off_policy_steps >= 1``)."""
    return RolloutFeed(collector, learner) if pipeline is None else PipelinedFeed(collector, learner, pipeline)
