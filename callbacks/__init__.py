"""gpo.callbacks: Lightning callbacks for group-based RL, usable from any LightningModule that provides what each
callback's docstring asks for.

Besides Lightning's hooks, ``gpo.train.hooks.RolloutCallback`` declares two that gpo's trainer runs (and any
LightningModule can run with ``run_prompt_hooks`` / ``run_rollout_hooks``):

- ``on_prompts(trainer, module, batch) -> batch | None``: before sampling; return a filtered batch of prompts.
- ``on_rollout_end(trainer, module, rollout) -> rollout | None``: after scoring, before advantages and training;
  return a replacement rollout (more or fewer groups), or None to keep it.
"""

from gpo.callbacks.completion_samples import CompletionSamples
from gpo.callbacks.difficulty_filter import DifficultyFilter
from gpo.callbacks.dynamic_sampling import DynamicSampling
from gpo.callbacks.export_policy import ExportPolicy
from gpo.callbacks.resume_checkpoint import ResumeCheckpoint
from gpo.callbacks.rollout_monitor import RolloutMonitor
from gpo.callbacks.vllm_weight_sync import VLLMWeightSync

__all__ = [
    "CompletionSamples",
    "DifficultyFilter",
    "DynamicSampling",
    "ExportPolicy",
    "ResumeCheckpoint",
    "RolloutMonitor",
    "VLLMWeightSync",
]
