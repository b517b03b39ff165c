"""GPOModule's arguments -> its checked, loaded and wired parts: policy, scorer, collector, learner, feed."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gpo.algo import EntropyBonus, KLPenalty, RewardMixer, RolloutCorrection
from gpo.algo.distillation import TeacherKL
from gpo.algo.masks import TokenMask
from gpo.algo.objective import PolicyObjective
from gpo.algo.presets import Algorithm, preset
from gpo.algo.turns import StepRewards
from gpo.algo.weighting import TokenWeight
from gpo.models.loading import (
    DType,
    LoraSettings,
    TrainerMode,
    is_peft,
    load_policy,
    load_tokenizer,
    prepared_policy,
    unwrap,
)
from gpo.models.scorer import TokenScorer
from gpo.models.teacher import LocalTeacher, Teacher
from gpo.rewards.runner import RewardErrors, RewardFn
from gpo.rollout.base import RolloutEngine
from gpo.rollout.collector import Collector
from gpo.rollout.pipeline import RolloutPipeline
from gpo.train import preflight
from gpo.train.credit import StepCredit
from gpo.train.evaluation import Evaluation
from gpo.train.feed import RolloutFeed, rollout_feed
from gpo.train.learner import Learner, OldLogprobs
from gpo.train.optimization import Optimization


@dataclass
class Assembled:
    """The parts a ``GPOModule`` runs."""

    policy: PreTrainedModel  # trained; the module's only child
    tokenizer: PreTrainedTokenizerBase
    engine: RolloutEngine  # the run's engine; with pipelined rollouts, its queue on the sampler thread
    scorer: TokenScorer
    collector: Collector
    learner: Learner
    feed: RolloutFeed
    credit: StepCredit
    evaluation: Evaluation


def assemble(
    policy: str | PreTrainedModel,
    rewards: Sequence[RewardFn],
    *,
    engine: RolloutEngine,
    algorithm: Algorithm | str,
    group_size: int,
    mixer: RewardMixer | None,
    optim: Optimization | None,
    old_logprobs: OldLogprobs,
    ppo_clip_ref_logprobs: str | None,
    kl: KLPenalty | None,
    entropy: EntropyBonus | None,
    token_weights: Sequence[TokenWeight],
    masks: Sequence[TokenMask],
    distill: TeacherKL | None,
    teacher: str | Teacher | None,
    step_rewards: StepRewards | None,
    correction: RolloutCorrection | None,
    trainer_mode: TrainerMode,
    lora: LoraSettings | None,
    dtype: DType,
    tokenizer: str | PreTrainedTokenizerBase | None,
    evaluation: Evaluation | None,
    reward_errors: RewardErrors | None,
    seed: int | None,
    max_off_policy_steps: int,
    sampler_threads: int | None,
) -> Assembled:
    """``GPOModule``'s parts from its arguments (each documented there), checked before anything is loaded."""
    preflight.check_part_kinds(locals())  # the arguments, by name
    preflight.check_module_arguments(policy, rewards, group_size, mixer, tokenizer)
    preflight.check_pass_reward(evaluation, rewards)
    old_logprobs = preflight.old_logprobs_source(old_logprobs, ppo_clip_ref_logprobs)
    preflight.check_behaviour_policy(old_logprobs, correction is not None, max_off_policy_steps)
    parts = preset(algorithm).parts(engine.sampling.max_new_tokens)
    preflight.check_step_rewards(step_rewards, engine, parts.gate)
    sampler_shares_weights = engine.shares_policy_weights  # HFEngine's worker copy runs the trainer's code too
    draws_global_generator = engine.draws_global_generator  # the engine's own: the pipeline wraps it below
    pipeline = None
    if max_off_policy_steps:
        pipeline = RolloutPipeline(engine, max_off_policy_steps, sampler_threads)
        engine = pipeline.engine
    objective = PolicyObjective(parts.gate, parts.aggregator, kl=kl, entropy=entropy, token_weights=token_weights,
                                masks=masks, distill=distill)  # fmt: skip
    preflight.check_distillation(distill, teacher, "teacher_logp" in objective.requires)
    loaded = isinstance(policy, torch.nn.Module)
    preflight.warn_if_lora_unused(trainer_mode, lora, loaded and is_peft(policy))
    dropout = (lora or LoraSettings()).dropout if trainer_mode != "full" else 0.0
    preflight.warn_if_pipeline_irreproducible(max_off_policy_steps, draws_global_generator, dropout)
    model = (prepared_policy(policy, trainer_mode, lora) if loaded
             else load_policy(policy, dtype=dtype, mode=trainer_mode, lora=lora))  # fmt: skip
    model.train()  # at rest in train mode, as Lightning expects; scoring and sampling switch to eval
    tokenizer = tokenizer if tokenizer is not None else None if loaded else policy
    field = "model.policy" if tokenizer is policy else "model.tokenizer"
    tokenizer = load_tokenizer(tokenizer, field) if isinstance(tokenizer, str) else tokenizer
    # The frozen reference lives in the scorer, out of the module's children: no optimiser, checkpoint or summary
    # sees it. A LoRA run has none: its reference is the adapter switched off.
    needs_reference = "ref_logp" in objective.requires or (kl is not None and kl.beta > 0)
    reference = None
    if needs_reference and not is_peft(model):
        reference = copy.deepcopy(unwrap(model)).requires_grad_(False).eval()
    teacher = LocalTeacher(teacher, dtype=dtype) if isinstance(teacher, str) else teacher
    scorer = TokenScorer(model, temperature=engine.sampling.temperature, reference=reference)
    learner = Learner(scorer, objective, optim or Optimization(), old_logprobs=old_logprobs, correction=correction,
                      kl=kl, sampler_shares_weights=sampler_shares_weights, teacher=teacher)  # fmt: skip
    collector = Collector(engine, rewards, mixer=mixer, group_size=group_size, reward_errors=reward_errors, seed=seed,
                          logprobs=learner.wants_rollout_logprobs)  # fmt: skip
    return Assembled(model, tokenizer, engine, scorer, collector, learner, rollout_feed(collector, learner, pipeline),
                     StepCredit(parts.advantage, step_rewards), evaluation or Evaluation())  # fmt: skip
