"""What an environment is: one episode stepped by text actions, and many episodes driven at once (asyncio)."""

from __future__ import annotations

import copy
import math
import numbers
from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import numpy as np
import torch


class Step(NamedTuple):
    """What the environment answers to one action; unpacks like gym's ``obs, reward, done, info``."""

    observation: str  # text shown to the policy before its next turn
    reward: float  # the environment's reward for this action (a step reward)
    done: bool  # the episode is over: no further turn
    info: dict[str, Any]  # anything else (JSON-serialisable for task apps)


class Environment(ABC):
    """One episode at a time: ``reset`` starts it, ``step`` answers each policy turn until ``done``.

    Implementations hold the episode's state; ``LocalEpisodes`` runs one deep copy per episode, so the
    constructor arguments are the settings and the state lives in what ``reset`` sets.
    """

    @abstractmethod
    def reset(self, seed: int, task: str) -> str:
        """Start an episode of ``task`` (the prompt text) whose randomness comes from ``seed``; returns the first
        observation ("" for none). Completions of the same prompt share ``seed``: they play the same episode.
        Raise ``ValueError`` for a task it cannot use (the task app answers 422)."""

    @abstractmethod
    def step(self, action: str) -> Step:
        """Apply the policy's turn (its decoded text) and answer it. Raise ``ValueError`` only for input the
        environment cannot use at all (the task app answers 422); a turn that breaks the game's rules is answered."""

    def close(self) -> None:  # noqa: B027
        """Release what the episode holds (nothing by default)."""


class Episodes(ABC):
    """Opens, steps and closes many episodes of one environment concurrently; what ``MultiTurnEngine`` drives.

    ``async with episodes:`` spans one batch of episodes (e.g. an HTTP session); handles are opaque to the caller.
    """

    async def __aenter__(self) -> Episodes:
        return self

    async def __aexit__(self, *exc_info) -> None:
        return None

    @abstractmethod
    async def open(self, seed: int, task: str) -> tuple[Any, str]:
        """Start an episode; returns its handle and first observation."""

    @abstractmethod
    async def step(self, episode: Any, action: str, turn: int) -> Step:
        """Apply turn ``turn`` (0, 1, ...) of ``episode``; ``turn`` lets a remote app answer a retried request once."""

    @abstractmethod
    async def close(self, episode: Any) -> None:
        """End ``episode`` and release it (also after an error)."""


class LocalEpisodes(Episodes):
    """Episodes of an in-process ``Environment``: one deep copy of ``env`` per episode, called directly.

    Args:
        env: the environment whose settings every episode copies.
    """

    def __init__(self, env: Environment) -> None:
        self.env = env

    async def open(self, seed: int, task: str) -> tuple[Environment, str]:
        episode = copy.deepcopy(self.env)
        return episode, checked_reset(episode.reset(seed, task), type(episode).__name__)

    async def step(self, episode: Environment, action: str, turn: int) -> Step:
        return checked_step(episode.step(action), type(episode).__name__)

    async def close(self, episode: Environment) -> None:
        episode.close()


def checked_reset(observation: Any, env_name: str) -> str:
    """``observation``, what ``env_name.reset`` returned, if it is the first observation, a str; refused naming it
    otherwise (a gym-style ``(observation, info)`` would enter the context as its repr)."""
    if not isinstance(observation, str):
        raise TypeError(f"{env_name}.reset returned {observation!r:.80}; return the first observation, a str ('' for "
                        "none).")  # fmt: skip
    return observation


def checked_step(answer: Any, env_name: str) -> Step:
    """``answer``, what ``env_name.step`` returned, as a ``Step`` of plain values; refused, naming the field, where it
    is not one: ``done="false"`` would read as true and a reward of ``"1"`` as a number (a task app's answer is held to
    the same). A numpy scalar or a one-element tensor stands for its value; ``info`` None for none (a dict is copied:
    an environment may reuse one)."""
    try:
        observation, reward, done, info = answer
    except (TypeError, ValueError):
        raise TypeError(
            f"{env_name}.step returned {answer!r:.80}; return gpo.envs.Step(observation, reward, done, info)."
        ) from None
    reward, done = _scalar(reward), _scalar(done)
    if not isinstance(observation, str):
        problem = f"observation={observation!r:.60} must be a str ('' for none)"
    elif isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        problem = f"reward={reward!r:.60} must be a finite number"
    elif not isinstance(done, bool):
        problem = f"done={done!r:.60} must be True or False"
    elif not isinstance(info, dict | None):
        problem = f"info={info!r:.60} must be a dict (or None)"
    else:
        return Step(observation, float(reward), done, dict(info) if info is not None else {})
    raise TypeError(f"{env_name}.step returned {problem}.")


def _scalar(value: Any) -> Any:
    """The Python value of a numpy scalar or a one-element tensor; anything else as it is."""
    if isinstance(value, np.generic) or (isinstance(value, torch.Tensor) and value.numel() == 1):
        return value.item()
    return value
