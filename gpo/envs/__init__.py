"""Environments for multi-turn RL: the interface, the built-in number-guessing game, task apps and judges over HTTP."""

from gpo.envs.base import Environment, Episodes, LocalEpisodes, Step
from gpo.envs.http import ServiceError
from gpo.envs.judge import JudgeError, JudgeReward
from gpo.envs.number_guess import NumberGuess
from gpo.envs.rewards import env_reward
from gpo.envs.task_client import TaskApp, TaskAppError

__all__ = [
    "Environment",
    "Episodes",
    "JudgeError",
    "JudgeReward",
    "LocalEpisodes",
    "NumberGuess",
    "ServiceError",
    "Step",
    "TaskApp",
    "TaskAppError",
    "env_reward",
]
