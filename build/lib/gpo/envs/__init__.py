"""Environments for multi-turn RL: the interface, the built-in number-guessing game, and task apps over HTTP."""

from gpo.envs.base import Environment, Episodes, LocalEpisodes, Step
from gpo.envs.http import ServiceError
from gpo.envs.number_guess import NumberGuess
from gpo.envs.task_client import TaskApp, TaskAppError

__all__ = [
    "Environment",
    "Episodes",
    "LocalEpisodes",
    "NumberGuess",
    "ServiceError",
    "Step",
    "TaskApp",
    "TaskAppError",
]
