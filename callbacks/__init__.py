"""gpo.callbacks: Lightning callbacks for group-based RL, usable from any LightningModule that provides what each
callback's docstring asks for. Each is imported on first use: a project that wants one callback pays for that one.

Besides Lightning's hooks, ``gpo.train.hooks.RolloutCallback`` declares two that gpo's trainer runs (and any
LightningModule can run with ``run_prompt_hooks`` / ``run_rollout_hooks``):

- ``on_prompts(trainer, module, batch) -> batch | None``: before sampling; return a filtered batch of prompts.
- ``on_rollout_end(trainer, module, rollout) -> rollout | None``: after scoring, before advantages and training;
  return a replacement rollout (more or fewer groups), or None to keep it.
"""

from gpo import lazy_exports

_HOMES = {
    "CompletionSamples": "gpo.callbacks.completion_samples",
    "DifficultyFilter": "gpo.callbacks.difficulty_filter",
    "DynamicSampling": "gpo.callbacks.dynamic_sampling",
    "ExportPolicy": "gpo.callbacks.export_policy",
    "ResumeCheckpoint": "gpo.callbacks.resume_checkpoint",
    "RolloutMonitor": "gpo.callbacks.rollout_monitor",
    "StepProgressBar": "gpo.callbacks.step_progress",
    "VLLMWeightSync": "gpo.callbacks.vllm_weight_sync",
}

__getattr__, __dir__, __all__ = lazy_exports("gpo.callbacks", _HOMES, globals())
