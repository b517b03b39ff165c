"""GPOModule: the LightningModule that wires a Collector and a Learner and runs one group-based RL step per batch."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

import torch
from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from typing_extensions import override

from gpo.algo import EntropyBonus, KLPenalty, RewardMixer, RolloutCorrection
from gpo.algo.distillation import TeacherKL
from gpo.algo.masks import TokenMask
from gpo.algo.presets import Algorithm
from gpo.algo.turns import StepRewards
from gpo.algo.weighting import TokenWeight
from gpo.models.loading import DType, LoraSettings, TrainerMode, unwrap
from gpo.models.teacher import Teacher
from gpo.parallel import collectives, fsdp
from gpo.rewards.runner import RewardErrors, RewardFn
from gpo.rollout.base import Rollout, RolloutEngine
from gpo.train import preflight
from gpo.train.assembly import assemble
from gpo.train.checkpointing import AtomicCheckpointIO
from gpo.train.data import PromptDraws, check_batch
from gpo.train.evaluation import Evaluation, evaluate, log_evaluation
from gpo.train.hooks import RolloutSource, run_prompt_hooks, run_rollout_hooks
from gpo.train.learner import OldLogprobs, lightning_backend
from gpo.train.metrics import log_due, publish, publish_step
from gpo.train.optimization import Optimization
from gpo.train.run_state import (
    check_same_run,
    check_same_weights,
    describe_run,
    describe_settings,
    load_part_states,
    part_states,
    restore_random_state,
    restored_run_state,
    run_state,
    warn_changed_settings,
)

#: Training batches skipped in a row (no rows left after the rollout hooks, or no token in the loss) that stop a run.
MAX_SKIPPED_IN_A_ROW = 100


class RunStalled(RuntimeError):
    """Training batches go by and none trains, so ``max_steps`` would never be reached."""


class GPOModule(RolloutSource, LightningModule):
    """Group-based policy optimisation of a transformers causal LM.

    Each training step: the ``Collector`` samples ``group_size`` completions per prompt with the engine and scores
    them (reward functions, then the mixer); the rollout hooks of the callbacks may filter or extend it; the
    advantage estimator turns rewards into advantages over the whole step (every rank's rows); the ``Learner``
    takes ``number_of_minibatches x ppo_epochs`` optimiser steps on the policy objective.

    Args:
        policy: folder of a transformers causal LM (``from_pretrained``), or a loaded model (``trainer_mode: lora``
            adds an adapter to it in place, unless it is a peft model already, whose own adapter then trains).
        rewards: reward functions ``(prompts, completions, **columns) -> list[float]`` (import paths in YAML).
        engine: the rollout engine, e.g. ``gpo.rollout.HFEngine`` (transformers ``generate``; ``gpo fit``'s default).
        algorithm: a preset by class with its settings (``GRPO``, ``DAPO``, ... in ``gpo.algo``; ``Custom`` for any
            three parts), or by lowercase name for its defaults: grpo, rloo, reinforce_pp, dr_grpo, dapo, cispo,
            gspo, sapo, gmpo, rspo, vespo, maxrl, gopo (``DPPO`` and ``DRO`` have a setting without a default).
        group_size: completions per prompt (>= 2).
        mixer: combines several rewards into one; default: their sum.
        optim: learning rate, minibatches, epochs, micro-batching, gradient clipping.
        old_logprobs: the old-policy log-probs from the ``rollout`` engine, or recomputed by the ``trainer`` before
            the first update of the step.
        ppo_clip_ref_logprobs: ``old_logprobs`` under its name in flat GRPO configs (``batch`` means ``trainer``);
            set one of the two.
        kl: KL penalty towards the initial policy (a frozen reference copy, or the LoRA adapter switched off).
        entropy: entropy bonus.
        token_weights: per-token weights of the objective: ``OverlongFilter`` (DAPO's overlong filtering),
            ``ReferenceProbWeight``.
        masks: tokens left out of the surrogate: ``OffPolicySequenceMask`` (DeepSeek-V3.2), ``SecondMomentMask``
            (M2PO), ``MismatchBandMask`` (IcePop), ``HighEntropyMask`` (80/20).
        distill: on-policy distillation towards ``teacher`` (``TeacherKL``: the per-token reverse KL as advantage).
        teacher: the teacher ``distill`` reads: the folder of a local one (``LocalTeacher``, loaded frozen in
            ``dtype``), or a ``gpo.models.teacher.Teacher`` such as ``ServerTeacher`` (vLLM servers answering its
            prompt log-probs). It must share the policy's tokenizer.
        step_rewards: per-turn advantages from the step rewards of multi-turn episodes (``MultiTurnEngine``).
        correction: rollout-vs-trainer importance correction (TIS/MIS), for engines with their own weights; needs
            ``old_logprobs: trainer`` (with ``rollout`` the gates' ratio already holds the mismatch).
        trainer_mode: ``full`` fine-tuning, ``lora`` adapter, or ``qlora`` (4-bit base, needs a GPU).
        lora: adapter settings for ``lora`` / ``qlora``.
        dtype: dtype the policy is loaded in (``float32``, ``bfloat16``, ``float16``).
        tokenizer: tokenizer folder or object; default: the policy's folder.
        evaluation: held-out evaluation settings.
        reward_errors: what a reward function that raises, hangs or returns bad values does to the run: ``fail``
            (default, with the function and prompt named) or ``score`` the samples concerned as a fixed value.
        seed: seed of the rollout sampling (see ``gpo.rollout.collector.Collector``) and of the extra prompt draws
            of ``DynamicSampling`` (``gpo.train.data.PromptDraws``); None: the run's seed
            (``seed_everything``), which then sets the whole experiment.
        max_off_policy_steps: how many training steps the sampler may run ahead of the learner (prime-rl's name).
            0: sample, then train, in turn. ``s >= 1``: the rollouts of the next ``s`` batches are sampled and scored
            while the policy trains (``gpo.rollout.pipeline``); the rollout of batch ``j`` is sampled by the policy
            after ``max(0, j - s)`` training steps and trained after ``j``, whatever the timing, so runs stay
            reproducible and resume exactly. The sampler's log-probs must enter the loss: ``old_logprobs: rollout``
            (the gates' ratio against the sampler), or ``trainer`` with a ``correction`` (weighing ``pi_train /
            pi_sampler``). ``HFEngine`` then runs in a worker process on a copy of the weights, pushed after every
            training step.
        sampler_threads: torch threads of that worker process; None: half of this process's, the trainer keeping
            the rest.
    """

    def __init__(
        self,
        policy: str | PreTrainedModel,
        rewards: Sequence[RewardFn],
        *,
        engine: RolloutEngine,
        algorithm: Algorithm | str = "grpo",
        group_size: int = 8,
        mixer: RewardMixer | None = None,
        optim: Optimization | None = None,
        old_logprobs: OldLogprobs = "rollout",
        ppo_clip_ref_logprobs: Literal["rollout", "batch"] | None = None,
        kl: KLPenalty | None = None,
        entropy: EntropyBonus | None = None,
        token_weights: Sequence[TokenWeight] = (),
        masks: Sequence[TokenMask] = (),
        distill: TeacherKL | None = None,
        teacher: str | Teacher | None = None,
        step_rewards: StepRewards | None = None,
        correction: RolloutCorrection | None = None,
        trainer_mode: TrainerMode = "full",
        lora: LoraSettings | None = None,
        dtype: DType = "float32",
        tokenizer: str | PreTrainedTokenizerBase | None = None,
        evaluation: Evaluation | None = None,
        reward_errors: RewardErrors | None = None,
        seed: int | None = None,
        max_off_policy_steps: int = 0,
        sampler_threads: int | None = None,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        arguments = {name: value for name, value in locals().items() if name not in ("self", "__class__")}
        built = assemble(**arguments)  # checks the arguments, loads the models and wires the parts
        self.policy = built.policy  # the only child module: the optimiser, checkpoints and summary see it alone
        self.tokenizer, self.engine, self.scorer = built.tokenizer, built.engine, built.scorer
        self.collector, self.learner, self.feed, self.credit = built.collector, built.learner, built.feed, built.credit
        self.evaluation = built.evaluation
        self._restored: dict[str, Any] = {}
        self.skipped_in_a_row = 0  # training batches skipped in a row (RunStalled at MAX_SKIPPED_IN_A_ROW)

    @property
    def model(self) -> PreTrainedModel:
        """The transformers model that generates and is scored (LoRA layers active in LoRA modes)."""
        return unwrap(self.policy)

    # ---- set-up ------------------------------------------------------------------------------------------------

    def configure_callbacks(self) -> list[Callback]:
        """``StopFeedOnError`` (once: a trainer that fits or validates again holds it already, and Lightning would
        announce that it replaces it). Also the earliest hook Lightning calls with the trainer attached, before it
        checks the loop settings itself, so that its automatic-optimisation settings get gpo's fix
        (``check_trainer_loop``) rather than Lightning's advice to switch to automatic optimisation."""
        if self.trainer.state.fn == TrainerFn.FITTING:  # Lightning checks them only then
            preflight.check_trainer_loop(self.trainer.gradient_clip_val, self.trainer.accumulate_grad_batches)
        attached = any(isinstance(callback, StopFeedOnError) for callback in self.trainer.callbacks)
        return [] if attached else [StopFeedOnError()]

    def setup(self, stage: str) -> None:
        preflight.check_run(self, self._trainer)
        self.collector.rank = collectives.rank()
        self.collector.setup(self.model, self.tokenizer)
        self.feed.split_threads()
        if self.learner.teacher is not None:
            self.learner.teacher.setup(self.tokenizer)
        if type(self.trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default: not atomic
            self.trainer.strategy.checkpoint_io = AtomicCheckpointIO()

    def configure_model(self) -> None:
        # FSDP2: the policy's blocks and the frozen models' are sharded alike; other strategies change nothing. Without
        # a trainer (load_from_checkpoint) there is nothing to shard.
        if self._trainer is not None and fsdp.is_sharded(self.trainer.strategy):
            self.trainer.strategy.shard(self.model)
            for frozen in self._frozen_models():
                self.trainer.strategy.shard(frozen, trainable=False)

    def on_fit_start(self) -> None:
        self.collector.device = self.device
        for frozen in self._frozen_models():
            frozen.to(self.device)

    def on_validation_start(self) -> None:
        self.collector.device = self.device  # ``validate`` calls no fit hook

    def _frozen_models(self) -> list[PreTrainedModel]:
        """The frozen reference and teacher, where the run has them (held by the scorer, out of the children)."""
        teacher = self.learner.teacher.model if self.learner.teacher is not None else None
        return [model for model in (self.scorer.reference, teacher) if model is not None]

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        total_steps = self.trainer.max_steps if self.trainer.max_steps > 0 else None
        optimizer, scheduler = self.learner.optim.build(params, total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---- resume: what a checkpoint needs beyond weights, optimiser, scheduler and loop counters ---------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        for logger in self.trainer.loggers:  # every row logged so far is on disk: a resumed run loses none
            logger.save()
        drawn = self.collector.extra_prompts.drawn if self.collector.extra_prompts is not None else 0
        streak, parts = self.learner.nonfinite.streak, part_states(self)
        state = run_state(drawn, streak, parts, self.feed.state())  # waits for what is in flight
        checkpoint["gpo"] = state | {"run": describe_run(self), "settings": describe_settings(self),
                                     "objective": self.learner.objective.state_dict()}  # fmt: skip

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("gpo", {})
        if self._trainer is None or self.trainer.state.fn != TrainerFn.FITTING:
            # the weights alone: load_from_checkpoint, or an evaluation of them (under any rewards)
            check_same_weights(state.get("run", {}), describe_run(self))
            if self._trainer is not None:
                preflight.check_evaluated_weights(self.learner.sampler_shares_weights, self.trainer.callbacks,
                                                  str(self.trainer.ckpt_path))  # fmt: skip
            return
        check_same_run(state.get("run", {}), describe_run(self), str(self.trainer.ckpt_path))
        warn_changed_settings(state.get("settings", {}), describe_settings(self))
        self._restored, self.learner.nonfinite.streak = restored_run_state(state)
        self.learner.objective.load_state_dict(state.get("objective", {}))
        load_part_states(self, self._restored.get("parts", {}))
        self.feed.load_state(self._restored.get("pipeline"))

    def on_train_start(self) -> None:
        self.feed.start(self.model)
        drawn = self._restored.get("extra_batches_drawn", 0)
        self.collector.extra_prompts = PromptDraws(self.trainer.train_dataloader, self.collector.seed, drawn)
        if "random_state" in self._restored:  # put back last, so nothing between restore and step 1 draws
            restore_random_state(self._restored["random_state"])
        self._restored = {}

    # ---- one training step: prompts -> rollout -> hooks -> advantages -> update -> metrics ---------------------

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        started = time.perf_counter()
        check_batch(batch)
        batch = run_prompt_hooks(self.trainer, self, batch)
        held = collectives.every_rank_holds(len(batch["prompt"]), 1, self.device)
        self.feed.submit(batch if held else None, self.trainer.fit_loop.epoch_loop.total_batch_idx)
        if not self.feed.ready():  # the first max_off_policy_steps batches only fill the pipeline
            publish(self.trainer, {"pipeline/filling": torch.tensor(1.0, device=self.device)}, log=True)
            return
        trainable, dropped = self._trainable(self.feed.take())
        metrics = None
        if trainable is not None:
            rollout, mask, collected = *trainable, time.perf_counter()
            step, step_adv, adv = self.credit(rollout, mask)
            metrics = self.learner.update(rollout, adv, mask, lightning_backend(self))  # None: a step mask emptied it
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if metrics is None else 0
        if self.skipped_in_a_row == MAX_SKIPPED_IN_A_ROW:
            raise RunStalled(
                f"the last {MAX_SKIPPED_IN_A_ROW} training batches were all skipped, so the run would never reach "
                "trainer.max_steps: the rollout hooks left no rows (DifficultyFilter or DynamicSampling drop the "
                "groups whose completions all got one reward: their metrics, dynamic_sampling/* and difficulty/*, say "
                "how many), or no token was left in the loss. Check the reward functions and the completion budget, "
                "or loosen the filter."
            )
        if metrics is None:
            skipped = {"rollout/skipped": 1.0, "train/empty_loss_streak": float(self.learner.empty_streak)}
            if dropped:  # pipelined: rows too stale to train on (all of them, unless a hook or a rank skipped too)
                skipped["pipeline/dropped_stale"] = float(dropped)
                rank_zero_warn(
                    f"{dropped} rows sampled more than model.max_off_policy_steps steps ago were dropped "
                    "(pipeline/dropped_stale), and the step was skipped. With VLLMWeightSync(weight_sync_interval > 1) "
                    "the engine's weights are older still: raise model.max_off_policy_steps, or sync every step."
                )
            skipped = {k: torch.tensor(v, device=self.device) for k, v in skipped.items()}
            publish(self.trainer, skipped, log=log_due(self.trainer))
            return
        metrics |= self.feed.trained(self.model, rollout, dropped, self.device)
        zero = torch.zeros((), device=self.device)  # a skipped step's keys, back to 0: callbacks read the last value
        metrics |= {"rollout/skipped": zero, "train/empty_loss_streak": zero}
        scoring_s = collected - started - (self.collector.stats.rollout_s if self.feed.samples_on_trainer else 0.0)
        publish_step(self.trainer, self.collector, rollout, step, step_adv, metrics,
                     scoring_s=scoring_s, training_s=time.perf_counter() - collected)  # fmt: skip

    def _trainable(self, rollout: Rollout | None) -> tuple[tuple[Rollout, Tensor] | None, int]:
        """``rollout`` after the rollout hooks (and without rows staler than the pipeline's bound) with its loss mask
        ``[B, T]``, or None when the step cannot train: a rank has too few rows, or no rank has a token left in the
        loss (all ranks skip together); and the count of stale rows dropped."""
        dropped = 0
        if rollout is not None:
            rollout, dropped = self.feed.within_bound(rollout)
        if rollout is not None and len(rollout):
            rollout = run_rollout_hooks(self.trainer, self, rollout)
        rows = len(rollout) if rollout is not None else 0
        if not collectives.every_rank_holds(rows, self.learner.optim.number_of_minibatches, self.device):
            return None, dropped
        mask = self.learner.objective.loss_mask(rollout.loss_mask.float(), rollout.truncated)  # [B, T]
        final = not self.learner.objective.masks  # else the update applies them, and counts again
        trains = self.learner.has_loss_tokens(mask, self.trainer.global_step, final=final)
        return ((rollout, mask) if trains else None), dropped

    def draw_rollout(self) -> Rollout:
        """Another batch of training prompts, sampled and scored (``DynamicSampling`` calls it)."""
        return self.feed.draw_more()

    def teardown(self, stage: str) -> None:
        self.feed.close()

    # ---- evaluation ---------------------------------------------------------------------------------------------

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        check_batch(batch)
        log_evaluation(self, evaluate(self.collector, batch, batch_idx, self.evaluation), len(batch["prompt"]))


class StopFeedOnError(Callback):
    """Stops ``GPOModule.feed`` (a pipeline's sampler thread and worker process) when a run fails: Lightning calls
    no ``teardown`` hook of the module then, and they would outlive the run in the Python process, keeping the torch
    threads they were given. Lightning calls it before the checkpoint callbacks' ``on_exception``: a checkpoint they
    save holds the rollouts collected ahead by then."""

    @override
    def on_exception(self, trainer: Trainer, pl_module: GPOModule, exception: BaseException) -> None:
        pl_module.feed.close()
