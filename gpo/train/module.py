"""GPOModule: the LightningModule that owns the policy and runs one group-based RL step per batch of prompts."""

from __future__ import annotations

import copy
import itertools
import logging
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import torch
from lightning import LightningModule
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from gpo.algo import (
    AdvantageEstimator,
    AlgorithmKnobs,
    EntropyBonus,
    KLPenalty,
    LossAggregator,
    RatioGate,
    RewardMixer,
    RolloutCorrection,
    WeightedSum,
    build_algorithm,
    mismatch_metrics,
    overlong_filter,
)
from gpo.algo.objective import PolicyObjective
from gpo.models.export import ExportMode, export_policy
from gpo.models.loading import (
    DType,
    LoraSettings,
    TrainerMode,
    adapter_disabled,
    is_peft,
    load_policy,
    training_mode,
    unwrap,
)
from gpo.models.scorer import completion_logprobs, completion_router_logp
from gpo.parallel import collectives, fsdp
from gpo.rewards.runner import RewardErrors, RewardFn, score
from gpo.rollout.base import Rollout, RolloutEngine
from gpo.rollout.hf import HFEngine
from gpo.train.checkpointing import AtomicCheckpointIO
from gpo.train.data import PromptDataModule, batches_per_pass, reshuffled
from gpo.train.metrics import step_metrics, throughput
from gpo.train.nonfinite import NonfiniteGuard
from gpo.train.preflight import (
    check_context,
    check_minibatches,
    check_module_arguments,
    check_reward_columns,
    check_tokenizer,
    warn_if_no_trust_region,
)
from gpo.train.random_state import capture_random_state, restore_random_state
from gpo.train.settings import Evaluation, Optimization

log = logging.getLogger(__name__)

OldLogprobs = Literal["rollout", "batch"]
RANK_SEED_STRIDE = 2**32  # rank r samples with seeds offset by r * this, far from any seed rank 0 uses
SUPPLIED_GATE_INPUTS = frozenset({"router_logp", "old_router_logp"})


class GPOModule(LightningModule):
    """Group-based policy optimisation of a transformers causal LM.

    Each training step: sample ``group_size`` completions per prompt with the rollout engine, score them with
    the reward functions, mix the scores into one reward, compute advantages, then take
    ``number_of_minibatches x ppo_epochs`` optimiser steps on the policy objective.

    Args:
        policy: folder of a transformers causal LM (``from_pretrained``), or a loaded model.
        rewards: reward functions ``(prompts, completions, **columns) -> list[float]`` (import paths in YAML).
        algorithm: preset filling in ``advantage``, ``gate`` and ``aggregator`` where they are not given.
        knobs: the preset's knobs (``use_ppo_clip``, ``clip_low``, ...).
        advantage: advantage estimator (overrides the preset's).
        gate: ratio gate (overrides the preset's).
        aggregator: loss aggregator (overrides the preset's).
        mixer: combines several rewards into one; default: sum with weight 1 each.
        engine: rollout engine; default: transformers ``generate`` on the policy.
        group_size: completions per prompt.
        optim: learning rate, minibatches, epochs, micro-batching, gradient clipping.
        ppo_clip_ref_logprobs: old-policy log-probs from the ``rollout`` engine, or recomputed by the trainer
            (``batch``) before the first update of the step.
        kl: KL penalty towards the initial policy (a frozen reference copy, or the LoRA adapter switched off).
        entropy: entropy bonus.
        correction: rollout-vs-trainer importance correction (TIS/MIS), for engines with their own weights.
        mask_truncated_completions: drop completions without EOS from the loss (DAPO's overlong filtering).
        trainer_mode: ``full`` fine-tuning, ``lora`` adapter, or ``qlora`` (4-bit base, needs a GPU).
        lora: adapter settings for ``lora`` / ``qlora``.
        dtype: dtype the policy is loaded in (``float32``, ``bfloat16``, ``float16``).
        tokenizer: tokenizer folder or object; default: the policy's folder.
        evaluation: held-out evaluation settings.
        export: at the end of training save the policy as a transformers folder (``merged``: LoRA merged into
            the weights; ``adapter``: the adapter alone; ``none``: no export) under ``<log dir>/export``.
        reward_errors: what a reward function that raises, hangs or returns bad values does to the run: ``fail``
            (default, with the function and prompt named) or ``score`` the samples concerned as a fixed value.
        seed: seeds the rollout sampling of each step (``seed + global_step``; under DDP rank ``r`` adds ``r * 2**32``).
    """

    def __init__(
        self,
        policy: str | PreTrainedModel,
        rewards: Sequence[RewardFn],
        *,
        algorithm: str = "grpo",
        knobs: AlgorithmKnobs | None = None,
        advantage: AdvantageEstimator | None = None,
        gate: RatioGate | None = None,
        aggregator: LossAggregator | None = None,
        mixer: RewardMixer | None = None,
        engine: RolloutEngine | None = None,
        group_size: int = 8,
        optim: Optimization | None = None,
        ppo_clip_ref_logprobs: OldLogprobs = "rollout",
        kl: KLPenalty | None = None,
        entropy: EntropyBonus | None = None,
        correction: RolloutCorrection | None = None,
        mask_truncated_completions: bool = False,
        trainer_mode: TrainerMode = "full",
        lora: LoraSettings | None = None,
        dtype: DType = "float32",
        tokenizer: str | PreTrainedTokenizerBase | None = None,
        evaluation: Evaluation | None = None,
        export: ExportMode = "merged",
        reward_errors: RewardErrors | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        check_module_arguments(policy, rewards, group_size, ppo_clip_ref_logprobs, export, knobs, mixer, tokenizer)
        self.engine = engine or HFEngine()
        preset = build_algorithm(algorithm, self._complete_knobs(knobs, group_size))
        self.advantage = advantage or preset.advantage
        self.aggregator = aggregator or preset.aggregator
        self.objective = PolicyObjective(gate or preset.gate, self.aggregator, kl=kl, entropy=entropy)
        unsupported = set(self.objective.gate.requires) - SUPPLIED_GATE_INPUTS
        if unsupported:
            raise ValueError(
                f"gate {type(self.objective.gate).__name__} needs {sorted(unsupported)}, which the trainer does "
                f"not compute yet (it supplies {sorted(SUPPLIED_GATE_INPUTS)})."
            )
        self.rewards, self.mixer = list(rewards), mixer or WeightedSum()
        self.group_size, self.optim = group_size, optim or Optimization()
        self.ppo_clip_ref_logprobs, self.kl, self.correction = ppo_clip_ref_logprobs, kl, correction
        self.mask_truncated_completions, self.seed = mask_truncated_completions, seed
        self.evaluation, self.export = evaluation or Evaluation(), export
        self.reward_errors, self._reward_errors_seen = reward_errors or RewardErrors(), defaultdict(int)
        self.policy = (
            policy
            if isinstance(policy, torch.nn.Module)
            else load_policy(policy, dtype=dtype, mode=trainer_mode, lora=lora)
        )
        tokenizer = tokenizer if tokenizer is not None else policy if isinstance(policy, str) else None
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer) if isinstance(tokenizer, str) else tokenizer
        # The frozen reference is kept out of the module's children: no optimiser, checkpoint or summary sees it.
        needs_reference = kl is not None and kl.beta > 0 and not is_peft(self.policy)
        self._reference = (copy.deepcopy(unwrap(self.policy)).requires_grad_(False).eval(),) if needs_reference else ()
        self._extra_prompts, self._seeds_used, self._rollout_time, self._generated_tokens = None, 0, 0.0, 0.0
        self._extra_batches_drawn, self._restored_random_state = 0, None
        self.nonfinite = NonfiniteGuard(self.optim.max_consecutive_nonfinite)

    def _complete_knobs(self, knobs: AlgorithmKnobs | None, group_size: int) -> AlgorithmKnobs:
        """The preset knobs with the module's group size and, unless set, the engine's generation budget."""
        knobs = replace(knobs or AlgorithmKnobs(), group_size=group_size)
        budget = getattr(getattr(self.engine, "sampling", None), "max_new_tokens", None)
        if knobs.max_completion_length is None and budget is not None:
            knobs = replace(knobs, max_completion_length=budget)
        return knobs

    @property
    def gate(self) -> RatioGate:
        return self.objective.gate

    @property
    def reference(self) -> PreTrainedModel | None:
        """The frozen reference copy (full fine-tuning with KL on), else None."""
        return self._reference[0] if self._reference else None

    @property
    def model(self) -> PreTrainedModel:
        """The transformers model that generates and is scored (LoRA layers active in LoRA modes)."""
        return unwrap(self.policy)

    @property
    def temperature(self) -> float:
        sampling = getattr(self.engine, "sampling", None)
        return sampling.temperature if sampling is not None else 1.0

    def setup(self, stage: str) -> None:
        if self.tokenizer is None:
            raise ValueError("GPOModule was given a loaded model without a tokenizer; pass tokenizer=.")
        embedding_rows = self.model.get_input_embeddings().num_embeddings
        check_tokenizer(self.tokenizer, "model.tokenizer, by default model.policy's folder", embedding_rows)
        data = self._trainer.datamodule if self._trainer is not None else None
        if isinstance(data, PromptDataModule):  # checks against the loaded prompts, before any sampling
            check_reward_columns(self.rewards, data.columns, data.prompt_column)
            budget = getattr(getattr(self.engine, "sampling", None), "max_new_tokens", None)
            check_context(data.longest_prompt, budget, getattr(self.model.config, "max_position_embeddings", None))
            minibatches, ranks = self.optim.number_of_minibatches, collectives.world_size()
            check_minibatches(data.prompts_per_step, self.group_size, minibatches, ranks)
        warn_if_no_trust_region(self.optim.number_of_minibatches * self.optim.ppo_epochs, self.gate)
        fsdp.check_strategy(self.trainer.strategy)
        if fsdp.is_sharded(self.trainer.strategy) and self.export != "none":
            raise ValueError(
                f"model.export={self.export!r} under FSDP is not supported yet (the policy is sharded over the "
                "processes): set model.export: none (configs/fsdp.yaml does)."
            )
        self.engine.setup(self.model, self.tokenizer)
        if type(self.trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default: not atomic
            self.trainer.strategy.checkpoint_io = AtomicCheckpointIO()

    def configure_model(self) -> None:
        # FSDP2: the policy's blocks and the frozen reference's are sharded alike; other strategies change nothing.
        if fsdp.is_sharded(self.trainer.strategy):
            self.trainer.strategy.shard(self.model)
            for reference in self._reference:
                self.trainer.strategy.shard(reference, trainable=False)

    def on_fit_start(self) -> None:
        # Dropout (if any) acts only in the gradient pass: sampling and scoring run in eval mode (see training_mode).
        for reference in self._reference:
            reference.to(self.device)

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=self.optim.lr, weight_decay=self.optim.weight_decay)
        total = self.trainer.max_steps if self.trainer.max_steps > 0 else None
        self.optim.lr_factor(self.optim.warmup_steps, total)  # a schedule that needs max_steps fails here
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: self.optim.lr_factor(step, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---- resume: what a checkpoint needs beyond weights, optimiser, scheduler and loop counters ---------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Under DDP each rank has its own draws (extra prompt batches, generators): all are saved, each reads its own.
        draws = {"random_state": capture_random_state(), "extra_batches_drawn": self._extra_batches_drawn}
        ranks = collectives.gather_objects(draws)
        checkpoint["gpo"] = {**draws, "nonfinite_streak": self.nonfinite.streak}
        if len(ranks) > 1:
            checkpoint["gpo"]["ranks"] = ranks

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("gpo", {})
        ranks, size = state.get("ranks", [state]), collectives.world_size()
        if len(ranks) != size:
            log.warning("checkpoint of %d processes resumed by %d: all resume rank 0's draws", len(ranks), size)
        own = ranks[collectives.rank()] if len(ranks) == size else ranks[0]
        self._extra_batches_drawn = own.get("extra_batches_drawn", 0)
        self.nonfinite.streak = state.get("nonfinite_streak", 0)
        self._restored_random_state = own.get("random_state")

    def on_train_start(self) -> None:
        if self._restored_random_state is not None:  # put back last, so nothing between restore and step 1 draws
            restore_random_state(self._restored_random_state)
            self._restored_random_state = None

    # ---- one training step ------------------------------------------------------------------------------------

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        started = time.perf_counter()
        self._seeds_used = 0
        batch = self._prompt_hooks(batch)
        # Under DDP all ranks train the step or all skip it (see every_rank_holds).
        held = collectives.every_rank_holds(len(batch["prompt"]), 1, self.device)
        rollout = self._rollout_hooks(self.scored_rollout(batch)) if held else None
        minibatches = self.optim.number_of_minibatches
        if rollout is None or not collectives.every_rank_holds(len(rollout), minibatches, self.device):
            self.log("rollout/skipped", 1.0, on_step=True)
            return
        sampling_time = time.perf_counter() - started
        mask = rollout.loss_mask.float()  # 0 on padding and on multi-turn environment tokens
        if self.mask_truncated_completions:
            mask = overlong_filter(mask, rollout.truncated)
        step, rows = collectives.gather_step(rollout, mask)
        step_adv = self.advantage(step["reward"], step["group"], step["mask"])  # [B_all, T_all], all ranks' rows
        adv = step_adv[rows, : mask.shape[1]]
        if rollout.turn_adv is not None:  # multi-turn step rewards: each turn's own advantage on its tokens
            adv = adv + rollout.turn_adv * mask
        metrics = self._optimise(rollout, adv, mask)
        training_time = time.perf_counter() - started - sampling_time
        times = (self._rollout_time, sampling_time - self._rollout_time, training_time)
        metrics.update(throughput(rollout, self._generated_tokens, *times))
        metrics = {
            **collectives.mean_over_ranks({k: float(v) for k, v in metrics.items()}),
            **step_metrics(step, step_adv, self.rewards, self._reward_errors_seen),
        }
        self.log_dict({k: float(v) for k, v in metrics.items()}, on_step=True, prog_bar=False)
        self.log("reward", float(metrics["reward/mean"]), prog_bar=True, on_step=True)

    def scored_rollout(self, batch: dict[str, Any], *, seed: int | None = None) -> Rollout:
        """Sample ``group_size`` completions per prompt of ``batch`` and score them (``scores``, ``reward``).

        Callbacks call this to draw more (dynamic sampling); each call of a step gets its own seed, derived from
        ``seed`` and the training batch, so a run is reproducible however many rounds it draws.
        """
        if seed is None:
            batches = self.trainer.fit_loop.epoch_loop.total_batch_idx  # advances on skipped steps too
            seed = self.seed + batches + 1_000_003 * self._seeds_used + RANK_SEED_STRIDE * collectives.rank()
            self._seeds_used += 1
        started = time.perf_counter()
        rollout = self.rollout(batch, seed=seed)
        self._rollout_time += time.perf_counter() - started
        self._generated_tokens += float(rollout.completion_mask.sum())  # every round, kept or not
        scored = score(self.rewards, rollout, self.reward_errors)
        rollout.scores = scored.values.to(self.device)  # [B, K]
        for name, count in scored.replaced.items():
            self._reward_errors_seen[name] += count
        reward = self.mixer(rollout.scores, rollout.group)  # [B]
        if self.kl is not None and self.kl.beta > 0 and self.kl.placement == "reward":
            mask = rollout.completion_mask
            reward = reward + self.kl.reward_penalty(self._policy_logp(rollout), self._ref_logp(rollout), mask)
        rollout.reward = reward
        return rollout

    def next_prompt_batch(self) -> dict[str, Any]:
        """Another batch of training prompts (for callbacks that draw more), from passes over the data of their own.

        Pass ``k`` is shuffled by ``seed + k`` alone and the count drawn is checkpointed, so a resumed run draws
        the same batches (for map-style datasets; an iterable dataset is simply iterated again). Under DDP each rank
        draws from its own share of each pass."""
        loader = self.trainer.train_dataloader
        per_pass = batches_per_pass(loader)
        passes, offset = divmod(self._extra_batches_drawn, per_pass or 1)
        if self._extra_prompts is None or offset == 0:
            extra = reshuffled(loader, self.seed + 1 + passes) if per_pass else loader
            self._extra_prompts = itertools.islice(iter(extra), offset, None)
        self._extra_batches_drawn += 1
        try:
            return next(self._extra_prompts)
        except StopIteration:  # an iterable dataset ran out: start it again
            self._extra_prompts = iter(loader)
            return next(self._extra_prompts)

    def rollout(self, batch: dict[str, Any], *, seed: int | None = None, greedy: bool = False, n: int | None = None):
        """Sample ``n`` completions (default ``group_size``) per prompt; attach texts and dataset fields."""
        n = n or self.group_size
        logprobs = self.training and (self.ppo_clip_ref_logprobs == "rollout" or self.correction is not None)
        generated = self.engine.generate(batch["prompt_ids"], n, seed=seed, greedy=greedy, logprobs=logprobs)
        rollout = generated.to(self.device)
        rollout.prompts = [p for p in batch["prompt"] for _ in range(n)]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        rollout.completions = self.tokenizer.batch_decode(
            rollout.completion_ids.masked_fill(rollout.completion_mask == 0, pad), skip_special_tokens=True
        )
        rollout.fields |= {key: [v for v in values for _ in range(n)] for key, values in batch["fields"].items()}
        return rollout

    def _prompt_hooks(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Callbacks defining ``on_prompts(trainer, module, batch)`` may return a filtered batch of prompts."""
        self._rollout_time, self._generated_tokens = 0.0, 0.0
        self._reward_errors_seen.clear()  # a skipped step's counts are not the next step's
        for callback in self.trainer.callbacks:
            hook = getattr(callback, "on_prompts", None)
            if hook is not None:
                filtered = hook(self.trainer, self, batch)
                batch = batch if filtered is None else filtered
        return batch

    def _rollout_hooks(self, rollout: Rollout | None) -> Rollout | None:
        """Callbacks defining ``on_rollout_end(trainer, module, rollout)`` see the scored rollout before training;
        one that returns a rollout replaces it (e.g. with more or fewer groups), returning None keeps it."""
        for callback in self.trainer.callbacks:
            hook = getattr(callback, "on_rollout_end", None)
            if hook is not None and rollout is not None:
                replaced = hook(self.trainer, self, rollout)  # an empty rollout is a valid answer: skip the step
                rollout = rollout if replaced is None else replaced
        return rollout

    def _policy_logp(self, rollout: Rollout) -> Tensor:
        return self._score_tokens(self.model, rollout)

    def _ref_logp(self, rollout: Rollout) -> Tensor:
        if self._reference:
            ref_logp = self._score_tokens(self._reference[0], rollout)
            fsdp.reshard(self._reference[0])  # FSDP2: the reference's root unit is not kept gathered
            return ref_logp
        with adapter_disabled(self.policy) as reference:
            return self._score_tokens(reference, rollout)

    @torch.no_grad()
    def _score_tokens(self, model: PreTrainedModel, rollout: Rollout) -> Tensor:
        """``model``'s log-probs ``[B, T]`` of the rollout's completion tokens at the sampling temperature."""
        width = rollout.completion_ids.shape[1]
        ids, attn = rollout.input_ids, rollout.attention_mask
        with training_mode(model, False):
            return completion_logprobs(model, ids, attn, width, temperature=self.temperature)[0].logp

    @torch.no_grad()
    def _router_logp(self, rollout: Rollout) -> Tensor:
        """The sampling policy's log routing probabilities at the completion positions, ``[L, B, T, E]``."""
        width = rollout.completion_ids.shape[1]
        with training_mode(self.model, False):
            _, router = completion_logprobs(
                self.model, rollout.input_ids, rollout.attention_mask, width, output_router_logits=True
            )
        if router is None:
            raise ValueError(f"gate {type(self.gate).__name__} needs router logits; the policy is not a MoE model.")
        return completion_router_logp(router, len(rollout), width)

    def _step_inputs(self, rollout: Rollout, mask: Tensor) -> tuple[dict[str, Tensor | None], dict[str, Tensor]]:
        """Everything the updates of this step need that does not change while the policy moves."""
        single_update = self.optim.ppo_epochs == 1 and self.optim.number_of_minibatches == 1
        use_rollout = self.ppo_clip_ref_logprobs == "rollout" and rollout.logp is not None
        separate_sampler = rollout.logp is not None and not self.engine.shares_policy_weights  # mismatch to log
        need_train_old = self.correction is not None or separate_sampler or not (use_rollout or single_update)
        train_old = self._policy_logp(rollout) if need_train_old else None
        inputs = {"old_logp": rollout.logp if use_rollout else train_old, "weight": None}
        metrics = {}
        if train_old is not None and rollout.logp is not None:
            metrics = mismatch_metrics(train_old, rollout.logp, mask)
            if self.correction is not None:
                inputs["weight"], metrics = self.correction(train_old, rollout.logp, mask)
        inputs["ref_logp"] = self._ref_logp(rollout) if self.objective.kl is not None else None
        inputs["old_router_logp"] = self._router_logp(rollout) if "old_router_logp" in self.gate.requires else None
        return inputs, metrics

    def _optimise(self, rollout: Rollout, adv: Tensor, mask: Tensor) -> dict[str, Tensor]:
        """``ppo_epochs x number_of_minibatches`` optimiser steps on one rollout; returns averaged diagnostics."""
        inputs, step_metrics = self._step_inputs(rollout, mask)
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        sums: dict[str, float] = defaultdict(float)
        updates = skipped = 0
        for _ in range(self.optim.ppo_epochs):
            order = torch.randperm(len(rollout)) if updates + skipped else torch.arange(len(rollout))
            for rows in collectives.split_rows(order.to(self.device), self.optim.number_of_minibatches):
                normaliser = collectives.ddp_normaliser(self.aggregator.normaliser(mask[rows]))  # see ddp_normaliser
                optimizer.zero_grad()
                minibatch_loss = 0.0
                micros = rows.split(self.optim.micro_batch_size or len(rows))
                if fsdp.is_sharded(self.trainer.strategy):
                    fsdp.check_same_count(len(micros), "micro-batches", self.device)
                for index, micro in enumerate(micros):
                    loss, metrics = self._micro_loss(rollout, adv, mask, inputs, micro, normaliser)
                    with self._gradient_sync(index == len(micros) - 1):
                        self.manual_backward(loss)
                    minibatch_loss += float(loss.detach())  # micro-batch losses add up to the minibatch loss
                    for key, value in metrics.items():
                        sums[key] += float(value) * len(micro) / len(rollout)
                minibatch_loss = collectives.mean_of_scalar(minibatch_loss, self.device)  # over the global batch
                max_norm = self.optim.max_grad_norm if self.optim.max_grad_norm is not None else math.inf
                norm = float(fsdp.clip_grad_norm(self.policy.parameters(), max_norm))  # FSDP2: global norm
                if not self.nonfinite.finite(minibatch_loss, norm, self.policy, self.trainer.global_step):
                    optimizer.zero_grad()
                    skipped += 1
                    continue
                sums["loss"] += minibatch_loss
                sums["grad/norm"] += norm
                optimizer.step()
                scheduler.step()
                updates += 1
        out = {key: value / self.optim.ppo_epochs for key, value in sums.items()}
        for per_update in ("loss", "grad/norm"):
            out[per_update] = sums[per_update] / updates if updates else math.nan
        out["train/nonfinite_skipped"] = float(skipped)
        out["train/lr"] = optimizer.param_groups[0]["lr"]
        return {**out, **step_metrics}

    def _gradient_sync(self, sync: bool):
        """DDP all-reduces gradients in the last micro-batch's backward only; the others accumulate locally, so
        ranks may run different numbers of micro-batches."""
        strategy = self.trainer.strategy
        return strategy.block_backward_sync() if isinstance(strategy, ParallelStrategy) and not sync else nullcontext()

    def _micro_loss(self, rollout, adv, mask, inputs, rows, normaliser) -> tuple[Tensor, dict]:
        width = int(rollout.completion_mask[rows].sum(-1).max().clamp_min(1))  # drop all-padding columns
        ids = torch.cat([rollout.prompt_ids[rows], rollout.completion_ids[rows, :width]], 1)
        attn = torch.cat([rollout.prompt_mask[rows], rollout.completion_mask[rows, :width]], 1)
        old_router = inputs["old_router_logp"]
        with training_mode(self.model, True):  # dropout, if any, only in the gradient pass
            out, router = completion_logprobs(
                self.model, ids, attn, width, temperature=self.temperature, with_entropy=True,
                output_router_logits=old_router is not None,
            )  # fmt: skip
        gate_inputs = {}
        if old_router is not None:
            gate_inputs = {
                "router_logp": completion_router_logp(router, len(rows), width),
                "old_router_logp": old_router[:, rows, :width],
            }
        sliced = {k: inputs[k][rows, :width] if inputs[k] is not None else None for k in ("ref_logp", "weight")}
        old = inputs["old_logp"][rows, :width] if inputs["old_logp"] is not None else out.logp.detach()
        return self.objective(
            out.logp, old, adv[rows, :width], mask[rows, :width], normaliser,
            entropy=out.entropy, **sliced, **gate_inputs,
        )  # fmt: skip

    # ---- evaluation and export --------------------------------------------------------------------------------

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        e = self.evaluation
        for kind, n, greedy in (("greedy", 1, True), ("sampled", e.samples, False)):
            rollout = self.rollout(batch, seed=e.seed + batch_idx, greedy=greedy, n=n)
            scored = score(self.rewards, rollout, self.reward_errors)
            reward = self.mixer(scored.values.to(self.device), rollout.group)  # no KL: not training
            size = len(batch["prompt"])
            for name, count in scored.replaced.items():
                self.log(f"val/reward_errors_{kind}/{name}", float(count), batch_size=size, reduce_fx="sum")
            self.log(f"val/reward_{kind}", reward.mean(), batch_size=size, prog_bar=kind == "greedy", sync_dist=True)
            self.log(f"val/pass@1_{kind}", (reward >= e.pass_threshold).float().mean(), batch_size=size, sync_dist=True)

    def on_train_end(self) -> None:
        if self.export != "none":
            folder = Path(self.trainer.log_dir or self.trainer.default_root_dir) / "export"  # log_dir: on every rank
            if self.trainer.is_global_zero:
                export_policy(self.policy, self.tokenizer, folder, merge=self.export == "merged")
