"""GPOModule: the LightningModule that wires a Collector and a Learner and runs one group-based RL step per batch."""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Sequence
from typing import Any, Literal

import torch
from lightning import LightningModule
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gpo.algo import EntropyBonus, KLPenalty, RewardMixer, RolloutCorrection
from gpo.algo.distillation import TeacherKL
from gpo.algo.masks import TokenMask
from gpo.algo.objective import PolicyObjective
from gpo.algo.presets import Algorithm, preset
from gpo.algo.turns import StepRewards
from gpo.algo.weighting import TokenWeight
from gpo.models.loading import DType, LoraSettings, TrainerMode, is_peft, load_policy, load_tokenizer, unwrap
from gpo.models.scorer import TokenScorer
from gpo.models.teacher import LocalTeacher, Teacher
from gpo.parallel import collectives, fsdp
from gpo.rewards.runner import RewardErrors, RewardFn
from gpo.rollout.base import Rollout, RolloutEngine
from gpo.rollout.collector import CollectionStats, Collector
from gpo.rollout.pipeline import Collected, RolloutPipeline
from gpo.train import preflight
from gpo.train.checkpointing import AtomicCheckpointIO
from gpo.train.data import PromptDraws
from gpo.train.evaluation import Evaluation, evaluate
from gpo.train.hooks import RolloutSource, run_prompt_hooks, run_rollout_hooks
from gpo.train.learner import Learner, OldLogprobs, lightning_backend
from gpo.train.metrics import count_metrics, log_due, publish, step_metrics, throughput
from gpo.train.optimization import Optimization
from gpo.train.run_state import check_same_run, describe_run, restore_random_state, restored_run_state, run_state


class GPOModule(RolloutSource, LightningModule):
    """Group-based policy optimisation of a transformers causal LM.

    Each training step: the ``Collector`` samples ``group_size`` completions per prompt with the engine and scores
    them (reward functions, then the mixer); the rollout hooks of the callbacks may filter or extend it; the
    advantage estimator turns rewards into advantages over the whole step (every rank's rows); the ``Learner``
    takes ``number_of_minibatches x ppo_epochs`` optimiser steps on the policy objective.

    Args:
        policy: folder of a transformers causal LM (``from_pretrained``), or a loaded model.
        rewards: reward functions ``(prompts, completions, **columns) -> list[float]`` (import paths in YAML).
        engine: the rollout engine, e.g. ``gpo.rollout.HFEngine`` (transformers ``generate``; ``gpo fit``'s default).
        algorithm: a preset by class with its settings (``GRPO``, ``DAPO``, ... in ``gpo.algo``; ``Custom`` for any
            three parts), or by seed 000's lowercase name for its defaults: grpo, rloo, reinforce_pp, dr_grpo, dapo,
            cispo, gspo, sapo, gmpo, rspo, vespo.
        group_size: completions per prompt (>= 2).
        mixer: combines several rewards into one; default: their sum.
        optim: learning rate, minibatches, epochs, micro-batching, gradient clipping.
        old_logprobs: the old-policy log-probs from the ``rollout`` engine, or recomputed by the ``trainer`` before
            the first update of the step.
        ppo_clip_ref_logprobs: seed 000's name for ``old_logprobs`` (``batch`` means ``trainer``); set one of them.
        kl: KL penalty towards the initial policy (a frozen reference copy, or the LoRA adapter switched off).
        entropy: entropy bonus.
        token_weights: per-token weights of the objective: ``OverlongFilter`` (DAPO's overlong filtering),
            ``ReferenceProbWeight``.
        masks: tokens left out of the surrogate: ``OffPolicySequenceMask`` (DeepSeek-V3.2), ``SecondMomentMask``
            (M2PO), ``MismatchBandMask`` (IcePop), ``HighEntropyMask`` (80/20).
        distill: on-policy distillation towards ``teacher`` (``TeacherKL``: the per-token reverse KL as advantage).
        teacher: the teacher ``distill`` reads: a ``gpo.models.Teacher``, or the folder of a local one
            (``LocalTeacher``, loaded frozen in ``dtype``). It must share the policy's tokenizer.
        step_rewards: per-turn advantages from the step rewards of multi-turn episodes (``MultiTurnEngine``).
        correction: rollout-vs-trainer importance correction (TIS/MIS), for engines with their own weights.
        trainer_mode: ``full`` fine-tuning, ``lora`` adapter, or ``qlora`` (4-bit base, needs a GPU).
        lora: adapter settings for ``lora`` / ``qlora``.
        dtype: dtype the policy is loaded in (``float32``, ``bfloat16``, ``float16``).
        tokenizer: tokenizer folder or object; default: the policy's folder.
        evaluation: held-out evaluation settings.
        reward_errors: what a reward function that raises, hangs or returns bad values does to the run: ``fail``
            (default, with the function and prompt named) or ``score`` the samples concerned as a fixed value.
        seed: seed of the rollout sampling (see ``gpo.rollout.collector.Collector``); None: the run's seed
            (``seed_everything``), which then sets the whole experiment.
        max_off_policy_steps: how many training steps the sampler may run ahead of the learner (prime-rl's name).
            0: sample, then train, in turn. ``s >= 1``: the rollouts of the next ``s`` batches are sampled and scored
            while the policy trains (``gpo.rollout.pipeline``); the rollout of batch ``j`` is sampled by the policy
            after ``max(0, j - s)`` training steps and trained after ``j``, whatever the timing, so runs stay
            reproducible and resume exactly. Needs ``old_logprobs: rollout`` (the sampler's log-probs are the
            behaviour policy the gates and ``correction`` work from). ``HFEngine`` then runs in a worker process on
            a copy of the weights, pushed after every training step.
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
        preflight.check_module_arguments(policy, rewards, group_size, mixer, tokenizer)
        old_logprobs = preflight.old_logprobs_source(old_logprobs, ppo_clip_ref_logprobs)
        parts = preset(algorithm).parts(engine.sampling.max_new_tokens)
        preflight.check_distillation(distill, teacher)
        sampler_shares_weights = engine.shares_policy_weights  # HFEngine's worker copy runs the trainer's code too
        self.pipeline = None
        if max_off_policy_steps:
            self.pipeline = RolloutPipeline(engine, max_off_policy_steps, sampler_threads, old_logprobs)
            engine = self.pipeline.engine
        objective = PolicyObjective(parts.gate, parts.aggregator, kl=kl, entropy=entropy, token_weights=token_weights,
                                    masks=masks, distill=distill)  # fmt: skip
        self.advantage, self.step_rewards = parts.advantage, step_rewards
        self.engine, self.optim = engine, optim or Optimization()
        self.evaluation = evaluation or Evaluation()
        loaded = isinstance(policy, torch.nn.Module)
        self.policy = policy if loaded else load_policy(policy, dtype=dtype, mode=trainer_mode, lora=lora)
        self.policy.train()  # at rest in train mode, as Lightning expects; scoring and sampling switch to eval
        tokenizer = tokenizer if tokenizer is not None else None if loaded else policy
        field = "model.policy" if tokenizer is policy else "model.tokenizer"
        self.tokenizer = load_tokenizer(tokenizer, field) if isinstance(tokenizer, str) else tokenizer
        # The frozen reference lives in the scorer, out of the module's children: no optimiser, checkpoint or
        # summary sees it. A LoRA run has none: its reference is the adapter switched off.
        needs_reference = "ref_logp" in objective.requires or (kl is not None and kl.beta > 0)
        reference = None
        if needs_reference and not is_peft(self.policy):
            reference = copy.deepcopy(unwrap(self.policy)).requires_grad_(False).eval()
        self.teacher = LocalTeacher(teacher, dtype=dtype) if isinstance(teacher, str) else teacher
        self.scorer = TokenScorer(self.policy, temperature=engine.sampling.temperature, reference=reference)
        self.learner = Learner(self.scorer, objective, self.optim, old_logprobs=old_logprobs, correction=correction,
                               kl=kl, sampler_shares_weights=sampler_shares_weights,
                               teacher=self.teacher)  # fmt: skip
        self.collector = Collector(engine, rewards, mixer=mixer, group_size=group_size, reward_errors=reward_errors,
                                   seed=seed, logprobs=self.learner.wants_rollout_logprobs)  # fmt: skip
        self._restored: dict[str, Any] = {}

    @property
    def model(self) -> PreTrainedModel:
        """The transformers model that generates and is scored (LoRA layers active in LoRA modes)."""
        return unwrap(self.policy)

    # ---- set-up ------------------------------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        preflight.check_run(self, self._trainer)
        self.collector.rank = collectives.rank()
        self.collector.setup(self.model, self.tokenizer)
        if self.pipeline is not None:
            self.pipeline.split_threads()
        if self.teacher is not None:
            self.teacher.setup(self.tokenizer)
        if type(self.trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default: not atomic
            self.trainer.strategy.checkpoint_io = AtomicCheckpointIO()

    def configure_model(self) -> None:
        # FSDP2: the policy's blocks and the frozen models' are sharded alike; other strategies change nothing.
        if fsdp.is_sharded(self.trainer.strategy):
            self.trainer.strategy.shard(self.model)
            for frozen in self._frozen_models():
                self.trainer.strategy.shard(frozen, trainable=False)

    def on_fit_start(self) -> None:
        self.collector.device = self.device
        for frozen in self._frozen_models():
            frozen.to(self.device)

    def _frozen_models(self) -> list[PreTrainedModel]:
        """The frozen reference and teacher, where the run has them (held by the scorer, out of the children)."""
        teacher = self.teacher.model if self.teacher is not None else None
        return [model for model in (self.scorer.reference, teacher) if model is not None]

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer, scheduler = self.optim.build(params, self.trainer.max_steps if self.trainer.max_steps > 0 else None)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---- resume: what a checkpoint needs beyond weights, optimiser, scheduler and loop counters ---------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        drawn = self.collector.extra_prompts.drawn if self.collector.extra_prompts is not None else 0
        pipeline = self.pipeline.state() if self.pipeline is not None else None  # waits for what is in flight
        checkpoint["gpo"] = {**run_state(drawn, self.learner.nonfinite.streak, pipeline), "run": describe_run(self),
                             "objective": self.learner.objective.state_dict()}  # fmt: skip

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("gpo", {})
        check_same_run(state.get("run", {}), describe_run(self), str(self.trainer.ckpt_path))
        self._restored, self.learner.nonfinite.streak = restored_run_state(state)
        self.learner.objective.load_state_dict(state.get("objective", {}))
        if self.pipeline is not None:  # before on_train_start: weight pushes there carry the restored version
            self.pipeline.load_state(self._restored.get("pipeline"))

    def on_train_start(self) -> None:
        if self.pipeline is not None:  # the worker's copy was made before a checkpoint's weights were loaded
            self.pipeline.push(self.model)
        drawn = self._restored.get("extra_batches_drawn", 0)
        self.collector.extra_prompts = PromptDraws(self.trainer.train_dataloader, self.collector.seed, drawn)
        if "random_state" in self._restored:  # put back last, so nothing between restore and step 1 draws
            restore_random_state(self._restored["random_state"])
        self._restored = {}

    # ---- one training step: prompts -> rollout -> hooks -> advantages -> update -> metrics ---------------------

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        started = time.perf_counter()
        index = self.trainer.fit_loop.epoch_loop.total_batch_idx  # advances on skipped steps too
        batch = run_prompt_hooks(self.trainer, self, batch)
        held = collectives.every_rank_holds(len(batch["prompt"]), 1, self.device)
        if self.pipeline is None:
            self.collector.begin_step(index)
            rollout = self.learner.add_kl_penalty(self.collector.collect(batch)) if held else None
        else:
            self.pipeline.submit(functools.partial(self._collect_ahead, batch if held else None, index))
            ahead = self.pipeline.next()
            if ahead is None:  # the first max_off_policy_steps batches only fill the pipeline
                publish(self.trainer, {"pipeline/filling": torch.tensor(1.0, device=self.device)}, log=True)
                return
            self.collector.begin_step(ahead.step, ahead.stats)
            rollout = None if ahead.rollout is None else self.learner.add_kl_penalty(ahead.rollout.to(self.device))
        collected = self._trainable(rollout)
        if collected is None:
            skipped = {"rollout/skipped": 1.0, "train/empty_loss_streak": float(self.learner.empty_streak)}
            publish(self.trainer, {k: torch.tensor(v, device=self.device) for k, v in skipped.items()}, log=True)
            return
        rollout, mask, dropped, collected = *collected, time.perf_counter()
        step, step_adv, adv = self._advantages(rollout, mask)
        metrics = self.learner.update(rollout, adv, mask, lightning_backend(self))
        if self.pipeline is not None:
            metrics |= self.pipeline.metrics(rollout, dropped, self.device)
            self.engine.trained_steps += 1
            self.pipeline.push(self.model)
        self._publish(rollout, step, step_adv, metrics, (started, collected, time.perf_counter()))

    def _collect_ahead(self, batch: dict[str, Any] | None, index: int) -> Collected:
        """Batch ``index``'s rollout, collected on the sampler thread (pipelined rollouts)."""
        if batch is None:
            return Collected(index, None, CollectionStats())
        rollout, stats = self.collector.collect_ahead(batch, index)
        return Collected(index, rollout, stats)

    def _trainable(self, rollout: Rollout | None) -> tuple[Rollout, Tensor, int] | None:
        """``rollout`` after the rollout hooks (and without rows staler than the pipeline's bound), its loss mask
        ``[B, T]`` and the count of stale rows dropped; None when the step cannot train: a rank has too few rows, or
        no rank has a token left in the loss (all ranks skip together)."""
        dropped = 0
        if rollout is not None and self.pipeline is not None:
            rollout, dropped = self.pipeline.within_bound(rollout)
        if rollout is not None and len(rollout):
            rollout = run_rollout_hooks(self.trainer, self, rollout)
        rows = len(rollout) if rollout is not None else 0
        if not collectives.every_rank_holds(rows, self.optim.number_of_minibatches, self.device):
            return None
        mask = self.learner.objective.loss_mask(rollout.loss_mask.float(), rollout.truncated)  # [B, T]
        return (rollout, mask, dropped) if self.learner.has_loss_tokens(mask, self.trainer.global_step) else None

    def _publish(self, rollout, step, step_adv, metrics, clock: tuple[float, float, float]) -> None:
        """The step's metrics to the callbacks and progress bar, and to the loggers when logging is due."""
        stats, log = self.collector.stats, log_due(self.trainer)
        started, collected, done = clock
        sampled_here = stats.rollout_s if self.pipeline is None else 0.0  # a pipeline samples on its own thread
        metrics |= throughput(rollout, stats.generated_tokens, stats.rollout_s, collected - started - sampled_here,
                              done - collected)  # fmt: skip
        counts = count_metrics(stats.reward_errors, self.device)
        if log:  # rank means and sums only where they are written: one all-reduce each
            metrics, counts = collectives.reduce_metrics(metrics, "mean"), collectives.reduce_metrics(counts, "sum")
        metrics |= counts | step_metrics(step, step_adv, self.collector.rewards, self.collector.mixer.weights)
        publish(self.trainer, {**metrics, "reward": metrics["reward/mean"]}, log=log)

    def _advantages(self, rollout: Rollout, mask: Tensor) -> tuple[dict[str, Tensor], Tensor, Tensor]:
        """The step's rows over every rank, their advantages ``[B_all, T_all]`` and this rank's ``adv[B, T]`` (plus
        the per-turn advantages of step rewards)."""
        step, rows = collectives.gather_step(rollout, mask)
        step_adv = self.advantage(step["reward"], step["group"], step["mask"])  # [B_all, T_all]
        adv = step_adv[rows, : mask.shape[1]]
        if self.step_rewards is not None:
            if rollout.turn_rewards is None:
                raise ValueError("model.step_rewards needs multi-turn rollouts: set model.engine to a MultiTurnEngine.")
            adv = adv + self.step_rewards(rollout.turn_rewards, rollout.group, rollout.turn_index) * mask
        return step, step_adv, adv

    def draw_rollout(self) -> Rollout:
        """Another batch of training prompts, sampled and scored (``DynamicSampling`` calls it)."""
        return self.learner.add_kl_penalty(self.collector.collect_more())

    def teardown(self, stage: str) -> None:
        if self.pipeline is not None:
            self.pipeline.close()

    # ---- evaluation ---------------------------------------------------------------------------------------------

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        size = len(batch["prompt"])
        for name, value in evaluate(self.collector, batch, batch_idx, self.evaluation).items():
            if "/reward_errors_" in name:
                self.log(name, value, batch_size=size, reduce_fx="sum")
            else:
                self.log(name, value, batch_size=size, prog_bar=name == "val/reward_greedy", sync_dist=True)
