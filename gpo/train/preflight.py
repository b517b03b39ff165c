"""Checks run before any sampling: paths, reward functions against the dataset, tokenizer, context and batch
sizes. Each error names the config field (its YAML path) and the fix."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gpo.algo import EntropyBonus, KLPenalty, RewardMixer, RolloutCorrection
from gpo.algo.distillation import TeacherKL
from gpo.algo.gates import NoGate, RatioGate
from gpo.algo.presets import Algorithm
from gpo.algo.turns import StepRewards
from gpo.models.loading import LoraSettings, check_pretrained_folder
from gpo.models.teacher import Teacher
from gpo.rewards.runner import RewardErrors, RewardFn, reward_name
from gpo.rewards.signature import check_reward_columns, check_reward_names, check_reward_signature
from gpo.rollout.base import RolloutEngine
from gpo.suggest import did_you_mean
from gpo.train.evaluation import Evaluation
from gpo.train.hooks import WeightSync, warn_unreached_hooks
from gpo.train.optimization import Optimization

log = logging.getLogger(__name__)
#: ``GPOModule``'s arguments that take a part (or settings object), with the kinds each takes; all but the engine may
#: be None.
PART_KINDS: dict[str, tuple[type, ...]] = {
    "engine": (RolloutEngine,),
    "algorithm": (str, Algorithm),
    "mixer": (RewardMixer,),
    "optim": (Optimization,),
    "kl": (KLPenalty,),
    "entropy": (EntropyBonus,),
    "distill": (TeacherKL,),
    "teacher": (str, Teacher),
    "step_rewards": (StepRewards,),
    "correction": (RolloutCorrection,),
    "lora": (LoraSettings,),
    "evaluation": (Evaluation,),
    "reward_errors": (RewardErrors,),
}
#: What a string given for a part means, where one may be.
NAMED_BY = {"algorithm": "a preset's name ('grpo')", "teacher": "the teacher model's folder"}


def check_tokenizer(tokenizer: Any, field: str, embedding_rows: int | None) -> None:
    """The tokenizer can end completions (and so pad them: its EOS pads when it has no pad token), and its ids fit
    the policy's embedding."""
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"the tokenizer ({field}) has no EOS token; a completion ends at it, and without a pad token it pads the "
            "batch too. Add an eos_token to the tokenizer (tokenizer.add_special_tokens({'eos_token': ...}); then "
            "save_pretrained it), or use one that has one."
        )
    if embedding_rows is not None and len(tokenizer) > embedding_rows:
        raise ValueError(
            f"the tokenizer ({field}) has {len(tokenizer)} tokens but model.policy's input embedding has "
            f"{embedding_rows} rows, so some token ids would index past it; use the tokenizer saved with the model, "
            "or call model.resize_token_embeddings(len(tokenizer)) and save the model."
        )


def check_context(longest_prompt: tuple[int, str], max_new_tokens: int | None, context: int | None) -> None:
    """The longest prompt plus the generation budget fits the model's context (``max_position_embeddings``)."""
    if max_new_tokens is None or context is None:
        return
    tokens, where = longest_prompt
    budget = f"model.engine.init_args.sampling.max_new_tokens={max_new_tokens}"
    if max_new_tokens >= context:
        raise ValueError(
            f"{budget} leaves no room for a prompt in the model's context of {context} tokens "
            f"(max_position_embeddings of model.policy); set max_new_tokens below {context}."
        )
    if tokens + max_new_tokens > context:
        raise ValueError(
            f"the longest prompt ({where}) is {tokens} tokens; with {budget} a sequence reaches "
            f"{tokens + max_new_tokens} tokens, over the model's context of {context} (max_position_embeddings of "
            f"model.policy). Lower max_new_tokens, or cut prompts to fit: data.max_prompt_length: "
            f"{context - max_new_tokens} with data.long_prompts: truncate."
        )


def check_minibatches(prompts_per_step: int, group_size: int, number_of_minibatches: int, ranks: int = 1) -> None:
    """The rollout of one step splits into ``number_of_minibatches`` equal minibatches; under DDP each of the
    ``ranks`` processes splits its own ``prompts_per_step / ranks`` prompts, so that share has to split evenly."""
    rollout = prompts_per_step * group_size
    if rollout % number_of_minibatches:
        raise ValueError(
            f"model.optim.number_of_minibatches={number_of_minibatches} does not divide the rollout of "
            f"data.prompts_per_step x model.group_size = {prompts_per_step} x {group_size} = {rollout} "
            f"completions; choose one of {_divisors(rollout)}, or change prompts_per_step or group_size."
        )
    rows = prompts_per_step // ranks * group_size
    if ranks > 1 and rows % number_of_minibatches:
        raise ValueError(
            f"model.optim.number_of_minibatches={number_of_minibatches} does not divide each rank's rollout of "
            f"data.prompts_per_step / ranks x model.group_size = {prompts_per_step} / {ranks} x {group_size} = "
            f"{rows} completions (each of the {ranks} processes splits its own share); choose one of "
            f"{_divisors(rows)}."
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def warn_if_no_trust_region(updates_per_rollout: int, gate: RatioGate) -> None:
    """Several updates per rollout without a ratio gate move the policy off-policy with nothing to hold it back."""
    if updates_per_rollout > 1 and isinstance(gate, NoGate):
        log.warning(
            "%d optimiser updates per rollout (model.optim.number_of_minibatches x ppo_epochs) without a ratio "
            "gate: later updates are off-policy and unclipped. Choose a gated algorithm, e.g. model.algorithm: "
            "{class_path: GRPO, init_args: {ppo_clip: {}}}, or DAPO, CISPO, GSPO, SAPO, GMPO.",
            updates_per_rollout,
        )


def check_router_inputs(requires: frozenset[str], gate: RatioGate, model: Any) -> None:
    """An objective that reads router log-probs (``requires``: RSPO's ``RouterShiftGate``) needs a mixture-of-experts
    policy; transformers' MoE models are those whose config has ``output_router_logits``."""
    if not requires & {"router_logp", "old_router_logp"} or hasattr(model.config, "output_router_logits"):
        return
    raise ValueError(
        f"model.algorithm: {type(gate).__name__} (RSPO) weights tokens by how far a mixture-of-experts router moved, "
        f"but model.policy ({type(model).__name__}) has no router. Use a mixture-of-experts policy (e.g. gpo tiny "
        "--arch qwen2_moe), or GMPO (RSPO without the router weight) for a dense one: model.algorithm: gmpo."
    )


def check_part_kinds(arguments: Mapping[str, Any]) -> None:
    """Each of ``GPOModule``'s ``arguments`` in ``PART_KINDS`` an instance of its kind (or None where it may be): in
    Python a class, a string or a number there would fail later as an AttributeError far from the argument (the
    command line's parser checks the kinds itself)."""
    from gpo.algo.presets.base import SLOTS  # a preset's parts: where one given as the algorithm goes

    for name, kinds in PART_KINDS.items():
        value = arguments[name]
        if (value is None and name != "engine") or isinstance(value, kinds):
            continue
        wanted = " or ".join(
            NAMED_BY[name] if kind is str else f"a {kind.__module__}.{kind.__qualname__}" for kind in kinds
        )
        if isinstance(value, type):
            hint = f"; give an instance, {value.__name__}(...)" if issubclass(value, kinds) else ""
            raise TypeError(f"model.{name} is the class {value.__name__}; it takes {wanted}{hint}.")
        slot = next((slot for slot, (kind, _) in SLOTS.items() if isinstance(value, kind)), None)
        hint = f"; {type(value).__name__} is a part of one: Custom({slot}=...)" if name == "algorithm" and slot else ""
        shown = repr(value) if isinstance(value, str | int | float | dict | list) else f"{type(value).__name__}(...)"
        raise TypeError(f"model.{name}={shown[:60]}: it takes {wanted}{hint}.")


def check_module_arguments(policy, rewards, group_size: int, mixer, tokenizer) -> None:
    """What can be refused from the arguments alone, before any weights load (the rest: ``check_run``)."""
    if isinstance(policy, str):
        check_pretrained_folder(policy, "model.policy", "model")
    elif tokenizer is None:
        raise ValueError("GPOModule was given a loaded model without a tokenizer; pass tokenizer= (a tokenizer, or "
                         "the folder it was saved in).")  # fmt: skip
    field, path = ("model.tokenizer", tokenizer) if tokenizer is not None else ("model.policy", policy)
    if isinstance(path, str):
        check_pretrained_folder(path, field, "tokenizer")
    if callable(rewards):
        raise TypeError(f"model.rewards is one function ({reward_name(rewards)}); give a list of them: rewards=[fn].")
    if not rewards:
        raise ValueError("model.rewards is empty; give at least one reward function (e.g. gpo.rewards.exact_match).")
    for index, fn in enumerate(rewards):
        check_reward_signature(fn, index)
    check_reward_names(rewards)
    if mixer is not None and mixer.weights is not None and len(mixer.weights) != len(rewards):
        raise ValueError(
            f"model.mixer ({type(mixer).__name__}) has {len(mixer.weights)} weights for the {len(rewards)} "
            "functions in model.rewards; give one weight per reward function, in the same order."
        )
    if group_size < 2:
        raise ValueError(
            f"model.group_size={group_size}: group-relative advantages need at least 2 completions per prompt; "
            "set it to >= 2 (8 is usual)."
        )


def check_pass_reward(evaluation: Evaluation | None, rewards: Sequence[RewardFn]) -> None:
    """``model.evaluation.pass_reward``, when set, names one of ``model.rewards``."""
    if evaluation is None or evaluation.pass_reward is None:
        return
    names = [reward_name(fn) for fn in rewards]
    if evaluation.pass_reward not in names:
        guess = did_you_mean(evaluation.pass_reward, names)
        raise ValueError(
            f"model.evaluation.pass_reward={evaluation.pass_reward!r} names none of model.rewards, which are named "
            f"{', '.join(names)}{'; ' + guess if guess else ''}."
        )


def check_distillation(distill: Any, teacher: Any, teacher_read: bool) -> None:
    """``model.distill`` and ``model.teacher`` come together: one is the signal, the other the model it reads (or
    another part that reads ``teacher_logp``: ``teacher_read``)."""
    if distill is not None and teacher is None:
        raise ValueError("model.distill needs a teacher: set model.teacher to the teacher model's folder.")
    if teacher is not None and not teacher_read:
        raise ValueError(
            "model.teacher is set but nothing reads it: add model.distill (gpo.algo.TeacherKL), or remove the teacher."
        )
    if isinstance(teacher, str):
        check_pretrained_folder(teacher, "model.teacher", "model")


def old_logprobs_source(old_logprobs: str, ppo_clip_ref_logprobs: str | None) -> str:
    """``old_logprobs``, or what ``ppo_clip_ref_logprobs`` (flat GRPO configs' name) says (``batch`` is ``trainer``)."""
    if old_logprobs not in ("rollout", "trainer"):
        raise ValueError(f"model.old_logprobs={old_logprobs!r} is not valid; choose rollout or trainer.")
    if ppo_clip_ref_logprobs is None:
        return old_logprobs
    if ppo_clip_ref_logprobs not in ("rollout", "batch"):
        raise ValueError(
            f"model.ppo_clip_ref_logprobs={ppo_clip_ref_logprobs!r} is not valid; choose rollout or batch (or set "
            "model.old_logprobs: rollout | trainer, its new name)."
        )
    aliased = "trainer" if ppo_clip_ref_logprobs == "batch" else "rollout"
    if old_logprobs != "rollout" and old_logprobs != aliased:
        raise ValueError(
            f"model.old_logprobs={old_logprobs!r} and model.ppo_clip_ref_logprobs={ppo_clip_ref_logprobs!r} (its "
            "name in flat GRPO configs) disagree; set only one of them."
        )
    return aliased


def check_behaviour_policy(old_logprobs: str, correcting: bool, max_off_policy_steps: int) -> None:
    """Refuse settings that count the sampler's policy twice or not at all. ``model.correction`` weighs each token by
    ``pi_train / pi_rollout``; with ``old_logprobs: rollout`` the gates' ratio ``pi / pi_rollout`` already holds that
    factor (``pi = pi_train`` at the first update), so the weight must go with ``old_logprobs: trainer`` (the gates
    clip ``pi / pi_train``, the correction carries the rest, as TRL's TIS does). Rollouts
    sampled ahead (``max_off_policy_steps``) come from an older policy, which one of the two must bring in."""
    if correcting and old_logprobs == "rollout":
        raise ValueError(
            "model.correction weighs each token by pi_train / pi_rollout, which the ratio pi / pi_rollout of "
            "model.old_logprobs: rollout (the default) already holds: it would count twice. Set model.old_logprobs: "
            "trainer (the gates then clip pi / pi_train and the correction weighs in the sampler's mismatch)."
        )
    if max_off_policy_steps > 0 and old_logprobs != "rollout" and not correcting:
        raise ValueError(
            f"model.max_off_policy_steps={max_off_policy_steps} trains on rollouts sampled by an older policy, which "
            "must enter the loss: set model.old_logprobs: rollout (the gates' ratio is then pi / pi_sampler), or keep "
            f"old_logprobs: {old_logprobs} with a model.correction (which weighs pi_train / pi_sampler)."
        )


#: ``trainer.precision`` values gpo trains with: full precision, bfloat16 autocast, float16 autocast with loss scaling.
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
#: The ``model.dtype`` that gives the weights of a Lightning ``*-true`` precision.
TRUE_PRECISION_DTYPES = {"bf16-true": "bfloat16", "16-true": "float16"}


def check_precision(precision: str, sharded: bool, weights: torch.dtype) -> None:
    """Refuse a ``trainer.precision`` gpo's update cannot honour. The ``*-true`` precisions cast the policy and
    change the default dtype of every new tensor (rewards and metrics too), which ``model.dtype`` does for the weights
    alone. ``16-mixed`` (float16 autocast with loss scaling, on a GPU; Lightning makes it ``bf16-mixed`` on a CPU)
    computes in float16 from float32 ``weights``, and works in one process and under DDP, not under FSDP2
    (``sharded``), whose ranks would each check their own shards for an overflow and could disagree on skipping an
    update."""
    if precision == "16-mixed" and sharded:
        raise ValueError(
            "trainer.precision=16-mixed is not supported under FSDP2 (its loss scaler checks each rank's shards "
            "alone); use trainer.precision: bf16-mixed, or the strategy's mixed_precision: bf16."
        )
    if precision == "16-mixed" and weights != torch.float32:
        raise ValueError(
            f"trainer.precision=16-mixed computes in float16 from float32 weights, and model.dtype is "
            f"{str(weights).removeprefix('torch.')}: set model.dtype: float32 (or leave trainer.precision at 32-true)."
        )
    if precision in PRECISIONS:
        return
    if precision in TRUE_PRECISION_DTYPES:
        raise ValueError(
            f"trainer.precision={precision} casts the policy and changes the dtype of every new tensor, rewards "
            f"included; gpo sets the weights' dtype itself: use model.dtype: {TRUE_PRECISION_DTYPES[precision]} "
            "(log-probs, losses and rewards stay float32) and leave trainer.precision at 32-true, or use "
            "trainer.precision: bf16-mixed."
        )
    raise ValueError(f"trainer.precision={precision} is not supported by gpo; use one of {list(PRECISIONS)}.")


def check_trainer_loop(gradient_clip_val: float | None, accumulate_grad_batches: int) -> None:
    """Refuse the settings of Lightning's automatic optimisation, which gpo's update (manual optimisation) has settings
    of its own for, before Lightning refuses them in its own words ("switch to automatic optimization")."""
    if gradient_clip_val is not None and gradient_clip_val > 0:
        raise ValueError(
            f"trainer.gradient_clip_val={gradient_clip_val} is Lightning's clipping, which gpo's update does itself: "
            f"set model.optim.max_grad_norm: {gradient_clip_val} (the global gradient norm; default 1.0) instead."
        )
    if accumulate_grad_batches != 1:
        raise ValueError(
            f"trainer.accumulate_grad_batches={accumulate_grad_batches} is Lightning's accumulation over batches, "
            "which gpo's update does not use: to update on more prompts at once raise data.prompts_per_step, and "
            "bound the memory with model.optim.micro_batch_size (rows per forward and backward; the gradient is "
            "the same)."
        )


def warn_if_pipeline_irreproducible(max_off_policy_steps: int, draws_global_generator: bool, dropout: float) -> None:
    """A pipelined engine that draws from torch's process-wide generator (in-process vLLM) takes draws from the
    trainer's dropout at times that vary: two runs of one seed then differ (shown with LoRA's dropout 0.1)."""
    if max_off_policy_steps and draws_global_generator and dropout > 0:
        log.warning(
            "model.max_off_policy_steps=%d with an in-process vLLM engine and model.lora.dropout=%g: vLLM's sampling "
            "on the sampler thread draws from torch's process-wide generator, which the trainer's dropout draws from "
            "too, at times that vary, so two runs with one seed differ. Set model.lora.dropout: 0, or sample with "
            "gpo.rollout.VLLMServerEngine, for reproducible runs.", max_off_policy_steps, dropout,
        )  # fmt: skip


def warn_if_lora_unused(trainer_mode: str, lora: Any, given_peft: bool) -> None:
    """LoRA settings that make no adapter (``trainer_mode: full``, or a policy given as a peft model, whose own adapter
    trains): say so rather than ignore them."""
    if lora is None:
        return
    if given_peft:
        log.warning("model.lora is set but model.policy is a peft model: its own adapter trains, and the LoRA "
                    "settings are not used.")  # fmt: skip
    elif trainer_mode == "full":
        log.warning("model.lora is set but model.trainer_mode is 'full': the whole model trains and the LoRA settings "
                    "are not used (set trainer_mode: lora to train an adapter).")  # fmt: skip


def check_step_rewards(step_rewards: Any, engine: Any, gate: RatioGate) -> None:
    """Per-turn credit needs the turn rewards and turn indices that only an episodic (multi-turn) engine records; a
    gate that averages the advantage over the sequence turns it into one shift per sequence (warned)."""
    if step_rewards is None:
        return
    if not engine.episodic:
        raise ValueError(
            f"model.step_rewards needs multi-turn rollouts, and model.engine is {type(engine).__name__}: set "
            "model.engine to a MultiTurnEngine (configs/multiturn.yaml), or remove model.step_rewards."
        )
    if not gate.per_token_advantage:
        log.warning(
            "model.step_rewards gives each turn's tokens their own advantage, but the gate %s averages the advantage "
            "over each sequence: the turns' credit reaches it as one shift per sequence. For per-turn credit use a "
            "token-level gate (grpo, dapo, cispo, ...; or GSPO's per_token_advantage: true).", type(gate).__name__,
        )  # fmt: skip


def engine_left_unsynced(sampler_shares_weights: bool, callbacks: Sequence[Any]) -> bool:
    """Whether the engine holds its own copy of the weights (vLLM) and no weight-sync callback
    (``gpo.train.hooks.WeightSync``: ``VLLMWeightSync``) pushes the policy's into it: it samples from the weights it
    was started with."""
    return not sampler_shares_weights and not any(isinstance(callback, WeightSync) for callback in callbacks)


def warn_if_sampler_never_synced(sampler_shares_weights: bool, callbacks: Sequence[Any]) -> None:
    """An engine with its own copy of the weights (vLLM) samples from the initial policy all run unless a
    weight-sync callback (``VLLMWeightSync``) pushes the trained weights into it."""
    if engine_left_unsynced(sampler_shares_weights, callbacks):
        log.warning(
            "model.engine holds its own copy of the weights and trainer.callbacks has no VLLMWeightSync: unless "
            "something else updates them, it samples from the initial policy for the whole run while the trainer's "
            "policy moves. Add gpo.callbacks.VLLMWeightSync to trainer.callbacks (configs/quickstart_vllm.yaml shows "
            "how); a callback of your own that pushes them subclasses gpo.train.hooks.WeightSync."
        )


def check_evaluated_weights(sampler_shares_weights: bool, callbacks: Sequence[Any], ckpt_path: str) -> None:
    """Evaluating a checkpoint with an engine that holds its own copy of the weights (vLLM) needs a weight-sync
    callback (``VLLMWeightSync``) to push the checkpoint's weights into it: without, the engine scores the weights it
    was started with."""
    if engine_left_unsynced(sampler_shares_weights, callbacks):
        raise ValueError(
            f"--ckpt_path {ckpt_path}: model.engine holds its own copy of the weights and trainer.callbacks has no "
            "VLLMWeightSync, so the engine would score the weights it started with, not the checkpoint's. Add "
            "gpo.callbacks.VLLMWeightSync to trainer.callbacks (the config the run was fitted with has it); a callback "
            "of your own that pushes them subclasses gpo.train.hooks.WeightSync."
        )


def check_run(module, trainer) -> None:
    """Checks of a ``GPOModule`` against its trainer and data, before any sampling: tokenizer, router inputs, reward
    columns, context length, minibatch split, precision, strategy."""
    from lightning.pytorch.trainer.states import TrainerFn

    from gpo.parallel import collectives, fsdp
    from gpo.train.data import PromptDataModule

    embedding_rows = module.model.get_input_embeddings().num_embeddings
    check_tokenizer(module.tokenizer, "model.tokenizer, by default model.policy's folder", embedding_rows)
    objective, optim = module.learner.objective, module.learner.optim
    check_router_inputs(objective.requires, objective.gate, module.model)
    data = trainer.datamodule if trainer is not None else None
    if isinstance(data, PromptDataModule):  # checks against the loaded prompts, before any sampling
        collector = module.collector
        check_reward_columns(collector.rewards, data.columns, data.prompt_column)
        context = getattr(module.model.config, "max_position_embeddings", None)
        check_context(data.longest_prompt, module.engine.sampling.max_new_tokens, context)
        check_minibatches(data.prompts_per_step, collector.group_size, optim.number_of_minibatches,
                          collectives.world_size())  # fmt: skip
    updates = optim.number_of_minibatches * optim.ppo_epochs
    warn_if_no_trust_region(updates, objective.gate)
    fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
    if fitting and trainer.is_global_zero and trainer.max_steps > 0 and trainer.max_steps % updates:
        log.warning(
            "trainer.max_steps=%d is not a multiple of the %d optimiser steps each batch takes (number_of_minibatches "
            "x ppo_epochs): the run ends after %d, and a linear or cosine schedule reaches 0 at step %d.",
            trainer.max_steps, updates, -(-trainer.max_steps // updates) * updates, trainer.max_steps,
        )  # fmt: skip
    if trainer is not None:
        if fitting and trainer.is_global_zero:
            warn_if_sampler_never_synced(module.learner.sampler_shares_weights, trainer.callbacks)
            warn_unreached_hooks(trainer.callbacks)
        check_precision(trainer.precision, fsdp.is_sharded(trainer.strategy), module.model.dtype)
        fsdp.check_strategy(trainer.strategy)
        fsdp.check_sampler_process(trainer.strategy, module.feed.sampler_process)
