"""Settings and import paths that moved, and settings other trainers keep elsewhere: where each one is in gpo now."""

from __future__ import annotations

#: Settings that moved, by their old key: where each went.
MOVED_KEYS: dict[str, str] = {
    "model.knobs": "a preset takes its own settings now, e.g. model.algorithm: {class_path: GRPO, init_args: "
    "{ppo_clip: {clip_low: 0.2}}} (configs/<preset>.yaml show each preset's)",
    "model.gate": "parts are combined with model.algorithm: {class_path: Custom, init_args: {advantage: ..., gate: "
    "..., aggregator: ...}}, or changed through a preset's own settings",
    "model.advantage": "parts are combined with model.algorithm: {class_path: Custom, init_args: {advantage: ...}}",
    "model.aggregator": "parts are combined with model.algorithm: {class_path: Custom, init_args: {aggregator: ...}}",
    "model.export": "export is a top-level setting now: export: none (merged, adapter or none)",
    "model.mask_truncated_completions": "overlong filtering is a token weight now: model.token_weights: "
    "[gpo.algo.OverlongFilter]",
    "model.engine.init_args.step_rewards_mode": "step rewards are an advantage part now: model.step_rewards: "
    "{mode: decision_stepwise, beta: 1.0}",
    "model.engine.init_args.step_rewards_beta": "step rewards are an advantage part now: model.step_rewards: "
    "{mode: decision_stepwise, beta: 1.0}",
    **{
        f"model.engine.init_args.{name}": f"engines take one sampling argument now: "
        f"model.engine.init_args.sampling.{name}"
        for name in ("temperature", "top_p", "top_k", "max_new_tokens")
    },
}

#: Import paths that moved: old -> new.
MOVED_PATHS: dict[str, str] = {
    "gpo.envs.env_reward": "gpo.rewards.env_reward",
    "gpo.envs.JudgeReward": "gpo.rewards.JudgeReward",
    "gpo.envs.judge_app": "gpo.rewards.judge_app",
    "gpo.strategies.FullyShardedStrategy": "gpo.parallel.fsdp.FullyShardedStrategy",
    "gpo.module.GPOModule": "gpo.train.module.GPOModule",
    "gpo.data.PromptDataModule": "gpo.train.data.PromptDataModule",
    "gpo.algo.SoftOverlongPunishment": "gpo.rewards.SoftOverlongPunishment (a reward function now)",
    "gpo.algo.DuplicatePenalty": "gpo.rewards.DuplicatePenalty (a reward function now)",
    "gpo.algo.AlgorithmKnobs": "the preset classes' own settings (gpo.algo.GRPO, DAPO, ...)",
}

#: LightningCLI settings that ``gpo fit`` does not offer, by key: what sets the same thing in gpo.
REPLACED_KEYS: dict[str, str] = {
    "optimizer": "gpo fit has no optimizer setting: the optimiser is AdamW, set by model.optim (lr, weight_decay, "
    "max_grad_norm), e.g. --model.optim.lr=1e-5",
    "lr_scheduler": "gpo fit has no lr_scheduler setting: the schedule is model.optim.lr_schedule (constant, linear "
    "or cosine) with model.optim.warmup_steps",
}

#: Settings of other trainers, by the key a user coming from one writes: where gpo keeps the same thing.
ELSEWHERE_KEYS: dict[str, str] = {
    "model.evaluation.every_n_iters": "evaluations are scheduled by the trainer: trainer.val_check_interval: N "
    "(training batches) with trainer.check_val_every_n_epoch: null",
    "model.weight_sync_interval": "weight sync is a callback: trainer.callbacks: [{class_path: "
    "gpo.callbacks.VLLMWeightSync, init_args: {weight_sync_interval: N}}]",
    "model.step_rewards_mode": "model.step_rewards: {mode: decision_stepwise, beta: 1.0}",
    "model.step_rewards_beta": "model.step_rewards: {mode: decision_stepwise, beta: 1.0}",
    "model.reward_blend": "model.mixer: {class_path: gpo.algo.EnvEventOutcomeBlend, init_args: {env, event, outcome}}",
    "data.episodes_per_batch": "episodes per step are data.prompts_per_step x model.group_size",
}
