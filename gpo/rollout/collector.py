"""Collector: prompts -> engine -> decoded completions -> reward functions -> mixer -> a scored Rollout."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gpo.algo.contracts import checked_mixer_output
from gpo.algo.mixers import RewardMixer, WeightedSum
from gpo.rewards.runner import RewardErrors, RewardFn, ServedReward, score
from gpo.rollout.base import Rollout, RolloutEngine, Sampling
from gpo.seeds import run_seed, stream_seed


@dataclass
class CollectionStats:
    """What the collection of one step cost: every round counted, kept or not."""

    rollout_s: float = 0.0  # seconds in the engine
    generated_tokens: Tensor | float = 0.0  # completion tokens sampled (a tensor once a round was sampled)
    reward_errors: Counter = field(default_factory=Counter)  # samples scored as RewardErrors.value, per function


class Collector:
    """Samples, decodes and scores the completions of a batch of prompts.

    Samples ``group_size`` completions per prompt with the engine, decodes them, attaches the dataset's fields,
    runs the reward functions (with their timeouts and error policy) and mixes their scores into one reward.

    It needs no Trainer: the step index (``begin_step``) and the prompts it may draw beyond the step's own
    (``extra_prompts``, for callbacks such as ``DynamicSampling``) are handed to it, so it can run apart from the
    training loop. Every round of a step samples with a seed of its own, ``gpo.seeds.stream_seed("rollout", seed,
    step, round, rank)``, so a run replays exactly however many rounds it draws, and no two seeds, steps, rounds or
    ranks share a stream.

    Args:
        engine: samples completions (token ids, masks, and the sampler's log-probs when asked).
        rewards: reward functions ``(prompts, completions, **columns) -> list[float]``.
        mixer: combines the reward functions' scores into one reward (default: their sum).
        group_size: completions per prompt.
        reward_errors: what a reward function that raises, hangs or returns bad values does to the run.
        seed: seed of the rollout sampling; None: the run's seed (``seed_everything``).
        logprobs: ask the engine for the sampled tokens' log-probs.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        rewards: Sequence[RewardFn],
        *,
        mixer: RewardMixer | None = None,
        group_size: int = 8,
        reward_errors: RewardErrors | None = None,
        seed: int | None = None,
        logprobs: bool = False,
    ) -> None:
        self.engine, self.rewards, self.mixer = engine, list(rewards), mixer or WeightedSum()
        self.group_size, self.reward_errors = group_size, reward_errors or RewardErrors()
        self.seed, self.logprobs = run_seed(seed), logprobs
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.device = torch.device("cpu")  # where collected rollouts are put (the trainer's device)
        self.rank = 0  # this process's rank: its seeds differ from every other rank's
        self.extra_prompts: Iterator[dict[str, Any]] | None = None
        self.step, self.round, self.stats = 0, 0, CollectionStats()

    def setup(self, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        """Ready to collect: the engine set up, and every reward that asks a service answered by it."""
        self.tokenizer = tokenizer
        self.engine.setup(policy, tokenizer)
        for reward in self.rewards:
            if isinstance(reward, ServedReward):
                reward.wait_ready()

    def begin_step(self, step: int, collected: CollectionStats | None = None) -> None:
        """Start collecting for training batch ``step`` (counted over the run, skipped batches included); with
        ``collected``, the statistics of its first round, collected ahead (``collect_ahead``)."""
        self.step, self.round, self.stats = step, int(collected is not None), collected or CollectionStats()

    def collect(self, batch: dict[str, Any]) -> Rollout:
        """The scored rollout of ``batch``'s prompts, sampled with this step's next seed."""
        seed = stream_seed("rollout", self.seed, self.step, self.round, self.rank)
        self.round += 1
        return self._collect(batch, seed, self.stats)

    def collect_ahead(self, batch: dict[str, Any], step: int) -> tuple[Rollout, CollectionStats]:
        """The first round of training batch ``step``, collected before the step trains (pipelined rollouts, on the
        sampler thread), with statistics of its own; the step being trained is left alone."""
        stats = CollectionStats()
        return self._collect(batch, stream_seed("rollout", self.seed, step, 0, self.rank), stats), stats

    def _collect(self, batch: dict[str, Any], seed: int, stats: CollectionStats) -> Rollout:
        started = time.perf_counter()
        rollout = self.sample(batch, seed=seed, logprobs=self.logprobs)
        stats.rollout_s += time.perf_counter() - started
        stats.generated_tokens = stats.generated_tokens + rollout.completion_mask.sum()
        return self.score(rollout, stats.reward_errors)

    def collect_more(self) -> Rollout:
        """The scored rollout of the next batch of ``extra_prompts`` (a callback drawing beyond the step's batch)."""
        if self.extra_prompts is None:
            raise RuntimeError("Collector.collect_more needs extra_prompts (GPOModule sets them when training starts).")
        return self.collect(next(self.extra_prompts))

    def sample(
        self, batch: dict[str, Any], *, seed: int | None, greedy: bool = False, n: int | None = None,
        logprobs: bool = False, sampling: Sampling | None = None,
    ) -> Rollout:  # fmt: skip
        """``n`` completions (default ``group_size``) per prompt of ``batch``, with texts and dataset fields;
        ``sampling`` replaces the engine's settings for this call."""
        n = n or self.group_size
        tasks = {"tasks": batch["prompt"]} if self.engine.episodic else {}  # the environment gets the prompts' text
        generated = self.engine.generate(
            batch["prompt_ids"], n, seed=seed, greedy=greedy, logprobs=logprobs, sampling=sampling, **tasks
        )
        rollout = generated.to(self.device)
        rollout.prompts = [p for p in batch["prompt"] for _ in range(n)]
        # padding is the engine's pad token, a special token (RolloutEngine.generate): decoding skips it
        rollout.completions = self.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        rollout.fields |= {key: [v for v in values for _ in range(n)] for key, values in batch["fields"].items()}
        return rollout

    def score(self, rollout: Rollout, errors: Counter) -> Rollout:
        """``rollout`` with ``scores[B, K]`` (one column per reward function) and the mixed ``reward[B]`` set; the
        samples scored as ``reward_errors.value`` are counted into ``errors`` per function."""
        scored = score(self.rewards, rollout, self.reward_errors)
        rollout.scores = scored.values.to(self.device)  # [B, K]
        errors.update(scored.replaced)
        rollout.reward = checked_mixer_output(self.mixer(rollout.scores, rollout.group), self.mixer, rollout.scores)
        return rollout
