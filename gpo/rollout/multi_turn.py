"""Multi-turn rollouts: policy turns sampled by a wrapped engine, alternating with environment turns.

Token ids are built turn by turn: each policy turn's sampled ids and each observation's ids (tokenised on its
own) are appended to the episode's list; the transcript is never decoded and tokenised again as a whole. A
tokenizer may merge characters across a turn boundary into one token (BPE: an action ending in "hi" followed by
an observation starting "gh" can become "high"), so re-tokenising would train on ids the policy never sampled,
and shift every later position, misaligning the sampler's log-probs with the trainer's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gpo.envs.base import Environment, Episodes, LocalEpisodes, Step
from gpo.rollout.base import Rollout, RolloutEngine, Sampling, pad_token_id
from gpo.rollout.hf import grouped_prompts
from gpo.rollout.token_lists import prompt_seeds

log = logging.getLogger(__name__)
ENV_TOKEN = -1  # turn index of environment tokens (and padding)


@dataclass
class Episode:
    """One episode's transcript as it grows: completion token ids and, per token, who wrote it."""

    prompt: list[int]
    handle: Any = None  # the Episodes' handle, once opened
    ids: list[int] = field(default_factory=list)  # completion tokens: policy turns and observations
    turn: list[int] = field(default_factory=list)  # per token: its policy turn, or ENV_TOKEN
    logp: list[float] = field(default_factory=list)  # per token: the sampler's log-prob, 0 on observations
    rewards: list[float] = field(default_factory=list)  # per policy turn: the environment's step reward
    turns: list[dict[str, Any]] = field(default_factory=list)  # per policy turn: action, observation, reward, info
    done: bool = False

    @property
    def context(self) -> list[int]:
        return self.prompt + self.ids

    def append(self, ids: list[int], turn: int, logp: list[float] | None = None) -> None:
        self.ids += ids
        self.turn += [turn] * len(ids)
        self.logp += logp if logp is not None else [0.0] * len(ids)


class MultiTurnEngine(RolloutEngine):
    """Episodes of an environment as rollouts: each of the ``n`` completions of a prompt is one episode.

    The episode starts from the prompt (plus the environment's first observation); each policy turn is sampled by
    ``engine`` (one completion, stopped at EOS or the engine's ``max_new_tokens``), its decoded text goes to the
    environment, and the observation that comes back is tokenised and appended, until the environment says
    ``done`` or ``max_turns`` policy turns were taken. Completions of one prompt play the same episode (same
    environment seed), so group-relative advantages compare like with like.

    In the returned rollout ``completion_mask`` is 1 on every transcript token (policy and environment: both are
    context), ``loss_mask`` only on the policy's tokens, ``logp`` is the sampler's on policy tokens and 0 on
    environment tokens, ``truncated`` marks episodes not done within ``max_turns``. ``fields`` carries per row
    ``env_return`` (sum of step rewards), ``turn_rewards``, ``turns`` (action, observation, reward, info of each
    turn) and ``env_done``; ``turn_rewards[B, K]`` each turn's step reward (NaN past the last turn) and
    ``turn_index[B, T]`` each token's policy turn (-1 on environment tokens and padding), from which
    ``gpo.algo.StepRewards`` (``model.step_rewards``) computes per-turn advantages.

    Args:
        engine: samples each policy turn (e.g. ``HFEngine``); its ``max_new_tokens`` is the budget of one turn.
        env: an in-process ``Environment`` (one deep copy per episode) or ``Episodes`` such as a ``TaskApp``.
        max_turns: policy turns per episode at most.
        max_concurrent_rollouts: environment calls (open, step, close) in flight at once; None: no limit.
        observation_template: how an observation becomes text before tokenising (e.g. a chat template's user turn
            around ``{observation}``).
    """

    episodic = True

    def __init__(
        self,
        *,
        engine: RolloutEngine,
        env: Environment | Episodes,
        max_turns: int = 4,
        max_concurrent_rollouts: int | None = None,
        observation_template: str = "{observation}",
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns={max_turns} must be >= 1 (policy turns per episode).")
        if max_concurrent_rollouts is not None and max_concurrent_rollouts < 1:
            raise ValueError(f"max_concurrent_rollouts={max_concurrent_rollouts} must be >= 1, or null for no limit.")
        if "{observation}" not in observation_template:
            raise ValueError(f"observation_template={observation_template!r} must contain '{{observation}}'.")
        for name, value, kinds in (("engine", engine, (RolloutEngine,)), ("env", env, (Environment, Episodes))):
            if not isinstance(value, kinds):
                wanted = " or ".join(f"a {kind.__module__}.{kind.__qualname__}" for kind in kinds)
                given = f"the class {value.__name__}" if isinstance(value, type) else f"{value!r:.60}"
                raise TypeError(f"MultiTurnEngine({name}=...) takes {wanted} instance; got {given}.")
        self.engine = engine
        self.episodes = env if isinstance(env, Episodes) else LocalEpisodes(env)
        self.max_turns, self.max_concurrent_rollouts = max_turns, max_concurrent_rollouts
        self.observation_template = observation_template
        self.tokenizer: PreTrainedTokenizerBase | None = None

    @property
    def shares_policy_weights(self) -> bool:
        return self.engine.shares_policy_weights

    @property
    def serves_all_ranks(self) -> bool:
        return self.engine.serves_all_ranks

    @property
    def draws_global_generator(self) -> bool:
        return self.engine.draws_global_generator

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """The wrapped engine's weights (``VLLMWeightSync`` keeps a vLLM engine inside this one in step)."""
        self.engine.update_weights(named_tensors)

    @property
    def sampling(self) -> Sampling:
        """The wrapped engine's sampling, with ``max_new_tokens`` the policy's tokens of a whole episode at most."""
        return replace(self.engine.sampling, max_new_tokens=self.engine.sampling.max_new_tokens * self.max_turns)

    def setup(self, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        self.engine.setup(policy, tokenizer)
        self.tokenizer = tokenizer

    def generate(
        self,
        prompt_ids: list[list[int]],
        n: int,
        *,
        greedy: bool = False,
        seed: int | None = None,
        logprobs: bool = True,
        sampling: Sampling | None = None,
        tasks: Sequence[str] | None = None,
    ) -> Rollout:
        """``tasks``: each prompt's text, which its episodes' environment gets (``Environment.reset``); None: the
        prompt tokens decoded (with the chat template, where the data applied one)."""
        if self.tokenizer is None:
            raise RuntimeError("MultiTurnEngine.generate called before setup(policy, tokenizer).")
        episodes = [Episode(prompt=list(p)) for p in prompt_ids for _ in range(n)]
        if tasks is None:
            tasks = self.tokenizer.batch_decode(prompt_ids, skip_special_tokens=True)
        # ``sampling`` is an episode's (as ``self.sampling``): each turn keeps the wrapped engine's budget
        turn = None if sampling is None else replace(sampling, max_new_tokens=self.engine.sampling.max_new_tokens)
        asyncio.run(self._play(episodes, n, list(tasks), greedy=greedy, seed=seed, logprobs=logprobs, sampling=turn))
        return self._rollout(prompt_ids, n, episodes, logprobs)

    async def _play(
        self,
        episodes: list[Episode],
        n: int,
        tasks: list[str],
        *,
        greedy: bool,
        seed: int | None,
        logprobs: bool,
        sampling: Sampling | None,
    ) -> None:
        """Open every episode (prompt ``i``'s ``n`` on ``tasks[i]``), alternate policy and environment turns, and close
        them all, also on error."""
        limit = asyncio.Semaphore(self.max_concurrent_rollouts or len(episodes))

        async def bounded(call):
            async with limit:
                return await call

        async def open_episode(episode: Episode, env_seed: int, task: str) -> None:
            episode.handle, observation = await bounded(self.episodes.open(env_seed, task))  # known once opened
            self._observe(episode, observation)

        env_seeds = episode_seeds(seed, len(tasks))
        async with self.episodes:
            try:
                await _all([open_episode(e, env_seeds[i // n], tasks[i // n]) for i, e in enumerate(episodes)])
                for turn, turn_seed in enumerate(prompt_seeds(seed, self.max_turns)):
                    active = [e for e in episodes if not e.done]
                    if not active:
                        break
                    actions = self._policy_turn(active, turn, greedy=greedy, seed=turn_seed, logprobs=logprobs,
                                                sampling=sampling)  # fmt: skip
                    calls = [
                        bounded(self.episodes.step(e.handle, a, turn)) for e, a in zip(active, actions, strict=True)
                    ]
                    for episode, action, step in zip(active, actions, await _all(calls), strict=True):
                        self._answer(episode, action, step, last=turn == self.max_turns - 1)
            finally:
                opened = [e for e in episodes if e.handle is not None]
                closes = [bounded(self.episodes.close(e.handle)) for e in opened]
                closes = await asyncio.gather(*closes, return_exceptions=True)
                failed = [c for c in closes if isinstance(c, BaseException)]
                if failed:
                    log.warning("%d of %d episodes failed to close; the first: %s", len(failed), len(opened), failed[0])

    def _policy_turn(self, active: list[Episode], turn: int, *, greedy: bool, seed: int | None, logprobs: bool,
                     sampling: Sampling | None):  # fmt: skip
        """Sample one turn of every active episode; append its tokens; return the decoded actions."""
        contexts = [e.context for e in active]
        sampled = self.engine.generate(contexts, 1, greedy=greedy, seed=seed, logprobs=logprobs, sampling=sampling)
        actions = []
        for row, episode in enumerate(active):
            real = sampled.completion_mask[row].bool()
            ids = sampled.completion_ids[row][real].tolist()
            logp = sampled.logp[row][real].tolist() if sampled.logp is not None else None
            episode.append(ids, turn, logp)
            actions.append(self.tokenizer.decode(ids, skip_special_tokens=True))
        return actions

    def _observe(self, episode: Episode, observation: str) -> None:
        if observation:
            text = self.observation_template.format(observation=observation)
            episode.append(self.tokenizer(text, add_special_tokens=False).input_ids, ENV_TOKEN)

    def _answer(self, episode: Episode, action: str, step: Step, *, last: bool) -> None:
        episode.rewards.append(step.reward)
        episode.turns.append(
            {"action": action, "observation": step.observation, "reward": step.reward, "info": step.info}
        )
        episode.done = step.done
        if not (step.done or last):  # the last observation is kept in ``turns``: no policy turn reads its tokens
            self._observe(episode, step.observation)

    def _rollout(self, prompt_ids: list[list[int]], n: int, episodes: list[Episode], logprobs: bool) -> Rollout:
        pad_id = pad_token_id(self.tokenizer)
        ids, mask, group = grouped_prompts(prompt_ids, n, pad_id)  # [B, P], [B, P], [B]
        size, width = len(episodes), max(1, max(len(e.ids) for e in episodes))
        completion = torch.full((size, width), pad_id, dtype=torch.long)  # [B, T]
        turn_index = torch.full((size, width), ENV_TOKEN, dtype=torch.long)  # [B, T]
        completion_mask = torch.zeros((size, width), dtype=torch.long)  # [B, T]
        logp = torch.zeros((size, width), dtype=torch.float32)  # [B, T]
        for row, e in enumerate(episodes):
            length = len(e.ids)
            completion[row, :length] = torch.tensor(e.ids, dtype=torch.long)
            turn_index[row, :length] = torch.tensor(e.turn, dtype=torch.long)
            completion_mask[row, :length] = 1
            logp[row, :length] = torch.tensor(e.logp, dtype=torch.float32)
        turn_rewards = torch.full((size, self.max_turns), float("nan"))  # [B, K]: NaN past the last turn
        for row, e in enumerate(episodes):
            turn_rewards[row, : len(e.rewards)] = torch.tensor(e.rewards, dtype=torch.float32)
        return Rollout(
            ids, mask, completion, completion_mask,
            truncated=torch.tensor([not e.done for e in episodes]),
            group=group,
            logp=logp if logprobs else None,
            loss_mask=(turn_index != ENV_TOKEN).long(),
            turn_rewards=turn_rewards,
            turn_index=turn_index,
            fields={
                "env_return": [sum(e.rewards) for e in episodes],
                "turn_rewards": [list(e.rewards) for e in episodes],
                "turns": [list(e.turns) for e in episodes],
                "env_done": [e.done for e in episodes],
            },
        )  # fmt: skip


def episode_seeds(seed: int | None, count: int) -> list[int]:
    """One environment seed per prompt, from ``seed`` (None: from torch's global generator), below 2**31 so any
    task app can hold it in a 32-bit integer."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return torch.randint(0, 2**31 - 1, (count,), generator=generator).tolist()


async def _all(calls: list) -> list:
    """Await every call; if any raised, raise the first error only after all have finished (so each episode a call
    opened is known, and closed, before the error propagates)."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
