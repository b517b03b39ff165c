"""VLLMWeightSync: push the policy's weights into a vLLM rollout engine during training, and check that they took."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from lightning import LightningModule, Trainer
from typing_extensions import override

from gpo.algo.masked import masked_mean
from gpo.callbacks.settings import check_count, check_number, check_texts
from gpo.models.weights import checkpoint_weights, full_parameters
from gpo.train.hooks import WeightSync, require_source
from gpo.train.metrics import log_due, publish

DEFAULT_PROBE_PROMPTS = ("Sort 3 1 2:", "The capital of France is", "1 + 1 =", "def f(x):")


class VLLMWeightSync(WeightSync):
    """Keeps a rollout engine's own copy of the weights in step with the policy, and checks it.

    The engines that hold their own copy are ``VLLMEngine`` and ``VLLMServerEngine``; the check
    verifies now and then that engine and trainer give the same log-probs.

    When: once at the start of training (the engine starts from the checkpoint on disk, the policy may have been
    resumed), then at the end of each training batch after which ``weight_sync_interval`` or more optimiser steps
    (``trainer.global_step``) have passed since the last sync: the next rollout is the first to use them. With an
    interval above 1 the engine samples from weights up to that many steps old; ``old_logprobs: rollout`` or a
    ``correction`` (TIS/MIS) accounts for it. Held-out evaluation samples from the engine too: before each one
    (``gpo validate`` of a checkpoint included) the weights are pushed unless this process already pushed them at
    this step.

    What: the full weights under the transformers checkpoint's names (``gpo.models.weights.checkpoint_weights``). A LoRA
    policy is pushed as merged weights ``W + scale * B @ A``, computed aside without touching the trained model;
    loading the adapter alone into vLLM (its LoRA mode) is not supported yet. Sharded policies are gathered
    first: DTensor parameters (FSDP2, tensor parallel) with ``full_tensor()``, FSDP1 inside ``summon_full_params``;
    every rank takes part in the gathering. An engine that serves all ranks (``serves_all_ranks``: one vLLM
    server, the multi-process setup) is updated by global rank 0 alone while the others wait at a barrier; any
    other engine by every rank (``VLLMEngine`` runs in single-process training only). After an update the engine
    resets its prefix cache.

    Verification, at the first sync and every ``verify_every_k``-th after it: greedy completions of
    ``probe_prompts`` from the engine (up to its ``max_new_tokens``) with its log-probs (vLLM applies no
    temperature to greedy decoding, so both sides score at temperature 1), scored again by the trainer's model;
    logs ``weight_sync/logprob_diff_max`` and ``weight_sync/logprob_diff_mean`` (absolute differences over the
    completion tokens) and raises RuntimeError when the maximum exceeds ``max_logprob_diff``. Float32 engine and
    trainer agree to about 1e-5; bfloat16 differs by up to about 0.3, hence the default. Also logged:
    ``weight_sync/count`` and ``weight_sync/seconds`` (time of the push). A sync's metrics are written to the
    loggers when it verifies (the first sync, at train start, at step 0) and when it happens at a step that logs
    (``trainer.log_every_n_steps``), so a row holds a verification exactly when one was made. With an episodic engine
    (``MultiTurnEngine``) each probe plays an episode: give ``probe_prompts`` the environment accepts as tasks.

    What the LightningModule must provide (gpo's ``GPOModule`` does): ``gpo.train.hooks.RolloutSource``'s ``engine``
    (a ``RolloutEngine`` with weights of its own), ``policy`` (the trained model, peft or not) and ``scorer`` (a
    ``TokenScorer`` of it); and ``tokenizer`` (for the probe prompts).

    Args:
        weight_sync_interval: optimiser steps between syncs (>= 1).
        verify_every_k: verify at every k-th sync (the first sync included); 0 never verifies.
        probe_prompts: texts of the probe batch (tokenized with the module's tokenizer). With several vLLM servers,
            probe ``i`` goes to server ``i mod S``: give at least as many probes as servers so each one is checked.
        max_logprob_diff: largest accepted |engine - trainer| log-prob on the probe.
    """

    def __init__(
        self,
        *,
        weight_sync_interval: int = 1,
        verify_every_k: int = 10,
        probe_prompts: Sequence[str] = DEFAULT_PROBE_PROMPTS,
        max_logprob_diff: float = 0.5,
    ) -> None:
        check_count("weight_sync_interval", weight_sync_interval, 1, "optimiser steps between syncs")
        check_count("verify_every_k", verify_every_k, 0, "syncs between verifications; 0 never verifies")
        check_texts("probe_prompts", probe_prompts, "the probe batch's prompts")
        if verify_every_k and not probe_prompts:
            raise ValueError("probe_prompts is empty; give at least one prompt, or set verify_every_k=0.")
        check_number("max_logprob_diff", max_logprob_diff, "the largest accepted log-prob difference", above=0.0)
        self.weight_sync_interval, self.verify_every_k = weight_sync_interval, verify_every_k
        self.probe_prompts = list(probe_prompts)
        self.max_logprob_diff = max_logprob_diff
        self.syncs, self.synced_at_step = 0, 0
        self.pushed_at: int | None = None  # the global step of the weights this process last pushed (not saved)

    # ---- hooks ------------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        require_source(self, pl_module, ("engine", "policy", "scorer", "tokenizer"))
        if pl_module.engine.shares_policy_weights:  # refused here, not at the first sync after the model summary
            raise ValueError(
                f"VLLMWeightSync: the engine {type(pl_module.engine).__name__} samples from the trained policy itself "
                "and holds no weights to sync; remove the callback, or sample with VLLMEngine or VLLMServerEngine."
            )

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._sync_if_behind(trainer, pl_module)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._sync_if_behind(trainer, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step - self.synced_at_step >= self.weight_sync_interval:
            self.sync(trainer, pl_module)

    # ---- the sync and its check -------------------------------------------------------------------------------

    def _sync_if_behind(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Before training or an evaluation: push unless this process pushed the weights of this step already."""
        if self.pushed_at != trainer.global_step:
            self.sync(trainer, pl_module, between_batches=True)

    def sync(self, trainer: Trainer, pl_module: LightningModule, between_batches: bool = False) -> None:
        """Push the policy's weights into the engine now; verify when this sync is due for it. ``between_batches``:
        before training or an evaluation, not at a batch's end (logged only when it verifies: no batch's logging is
        due)."""
        engine = pl_module.engine
        started = time.perf_counter()
        with full_parameters(trainer.strategy.model or pl_module):
            weights = checkpoint_weights(pl_module.policy)
            if trainer.global_rank == 0 or not engine.serves_all_ranks:
                engine.update_weights(weights.items())
        if engine.serves_all_ranks:
            trainer.strategy.barrier("vllm_weight_sync")
        self.syncs, self.synced_at_step = self.syncs + 1, trainer.global_step
        self.pushed_at = trainer.global_step
        metrics = {"weight_sync/count": float(self.syncs), "weight_sync/seconds": time.perf_counter() - started}
        verified = self.verify_every_k > 0 and (self.syncs - 1) % self.verify_every_k == 0
        if verified:
            metrics.update(self.verify(pl_module))
        # To the loggers when logging is due, and at each verification: a verification is logged exactly where it
        # happened, and only there.
        log = verified or (not between_batches and log_due(trainer))
        publish(trainer, {key: torch.tensor(value) for key, value in metrics.items()}, log=log, progress=())

    @torch.no_grad()
    def verify(self, pl_module: LightningModule) -> dict[str, float]:
        """Engine vs trainer log-probs on the probe batch; RuntimeError past ``max_logprob_diff``."""
        prompt_ids = [pl_module.tokenizer(text).input_ids for text in self.probe_prompts]
        rollout = pl_module.engine.generate(prompt_ids, 1, greedy=True, logprobs=True).to(pl_module.device)
        trainer_logp = pl_module.scorer.rollout_scores(rollout, temperature=1.0).logp  # greedy: no temperature
        mask = rollout.loss_mask  # the sampled tokens: a multi-turn transcript's environment tokens have no logp
        diff = (rollout.logp - trainer_logp.float()).abs() * mask  # [B, T]
        worst, mean = float(diff.max()), float(masked_mean(diff, mask))
        if worst > self.max_logprob_diff:
            raise RuntimeError(
                f"VLLMWeightSync: after sync {self.syncs} the rollout engine's log-probs differ from the trainer's by "
                f"up to {worst:.3g} (mean {mean:.3g}) on the probe prompts, above max_logprob_diff="
                f"{self.max_logprob_diff}. The engine is not sampling from the trained weights: check that the "
                "weight names match the checkpoint's and that the engine and trainer dtypes agree."
            )
        return {"weight_sync/logprob_diff_max": worst, "weight_sync/logprob_diff_mean": mean}

    # ---- checkpointing ----------------------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"syncs": self.syncs, "synced_at_step": self.synced_at_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.syncs, self.synced_at_step = int(state_dict["syncs"]), int(state_dict["synced_at_step"])
