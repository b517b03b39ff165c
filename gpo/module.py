"""GPOModule: the LightningModule that owns the policy and runs one group-based RL step per batch of prompts."""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from lightning import LightningModule
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

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
    overlong_filter,
)
from gpo.algo.gates import router_logprobs
from gpo.policy import completion_logprobs
from gpo.rollout.base import Rollout, RolloutEngine
from gpo.rollout.hf import HFEngine
from gpo.scoring import RewardFn, reward_name, score

OldLogprobs = Literal["rollout", "batch"]
SUPPLIED_GATE_INPUTS = frozenset({"router_logp", "old_router_logp"})


@dataclass(frozen=True)
class Optimization:
    """How one rollout batch becomes optimiser steps.

    Args:
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        max_grad_norm: clip the global gradient norm to this (None: no clipping).
        number_of_minibatches: optimiser steps per rollout batch and epoch (the batch is split this many ways).
        ppo_epochs: passes over the rollout batch.
        micro_batch_size: completions per forward/backward pass (None: a whole minibatch at once); it changes
            memory only, never the gradient.
    """

    lr: float = 1e-6
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    number_of_minibatches: int = 1
    ppo_epochs: int = 1
    micro_batch_size: int | None = None

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be > 0.")
        for name in ("number_of_minibatches", "ppo_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={self.micro_batch_size} must be >= 1 (or None).")


class GPOModule(LightningModule):
    """Group-based policy optimisation of a transformers causal LM.

    Each training step: sample ``group_size`` completions per prompt with the rollout engine, score them with
    the reward functions, mix the scores into one reward, compute advantages, then take
    ``number_of_minibatches x ppo_epochs`` optimiser steps with the gate and aggregator.

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
        kl: KL penalty towards the initial policy (loads a frozen reference copy when ``beta > 0``).
        entropy: entropy bonus.
        correction: rollout-vs-trainer importance correction (TIS/MIS), for engines with their own weights.
        mask_truncated_completions: drop completions without EOS from the loss (DAPO's overlong filtering).
        dtype: dtype the policy is loaded in (``float32``, ``bfloat16``, ``float16``).
        tokenizer: tokenizer folder or object; default: the policy's folder.
        seed: seeds the rollout sampling of each step (``seed + global_step``).
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
        dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        tokenizer: str | PreTrainedTokenizerBase | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        if not rewards:
            raise ValueError("rewards is empty; give at least one reward function (e.g. gpo.rewards.exact_match).")
        if group_size < 2:
            raise ValueError(f"group_size={group_size}: group-relative advantages need at least 2 completions.")
        if ppo_clip_ref_logprobs not in ("rollout", "batch"):
            raise ValueError(f"ppo_clip_ref_logprobs={ppo_clip_ref_logprobs!r} is not valid; choose rollout or batch.")
        self.engine = engine or HFEngine()
        knobs = replace(knobs or AlgorithmKnobs(), group_size=group_size)
        budget = getattr(getattr(self.engine, "sampling", None), "max_new_tokens", None)
        if knobs.max_completion_length is None and budget is not None:
            knobs = replace(knobs, max_completion_length=budget)
        preset = build_algorithm(algorithm, knobs)
        self.advantage = advantage or preset.advantage
        self.gate = gate or preset.gate
        self.aggregator = aggregator or preset.aggregator
        unsupported = set(self.gate.requires) - SUPPLIED_GATE_INPUTS
        if unsupported:
            raise ValueError(
                f"gate {type(self.gate).__name__} needs {sorted(unsupported)}, which the trainer does not compute "
                f"yet (it supplies {sorted(SUPPLIED_GATE_INPUTS)})."
            )
        self.rewards = list(rewards)
        self.mixer = mixer or WeightedSum()
        self.group_size, self.optim = group_size, optim or Optimization()
        self.ppo_clip_ref_logprobs = ppo_clip_ref_logprobs
        self.kl, self.entropy, self.correction = kl, entropy, correction
        self.mask_truncated_completions, self.seed = mask_truncated_completions, seed
        self.policy = self._load_policy(policy, dtype)
        tokenizer = tokenizer if tokenizer is not None else policy if isinstance(policy, str) else None
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.reference = self._load_reference(policy, dtype) if kl is not None and kl.beta > 0 else None

    @staticmethod
    def _load_policy(policy: str | PreTrainedModel, dtype: str) -> PreTrainedModel:
        if isinstance(policy, PreTrainedModel):
            return policy
        return AutoModelForCausalLM.from_pretrained(policy, dtype=getattr(torch, dtype))

    @staticmethod
    def _load_reference(policy: str | PreTrainedModel, dtype: str) -> PreTrainedModel:
        """A frozen copy of the initial policy (only built when the KL term is on)."""
        reference = (
            copy.deepcopy(policy) if isinstance(policy, PreTrainedModel) else GPOModule._load_policy(policy, dtype)
        )
        return reference.requires_grad_(False).eval()

    def setup(self, stage: str) -> None:
        if self.tokenizer is None:
            raise ValueError("GPOModule was given a loaded model without a tokenizer; pass tokenizer=.")
        self.engine.setup(self.policy, self.tokenizer)

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.optim.lr, weight_decay=self.optim.weight_decay)

    @property
    def temperature(self) -> float:
        sampling = getattr(self.engine, "sampling", None)
        return sampling.temperature if sampling is not None else 1.0

    # ---- one step -----------------------------------------------------------------------------------------------

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        started = time.perf_counter()
        rollout = self.rollout(batch, seed=self.seed + self.global_step)
        rollout_time = time.perf_counter() - started
        scores = score(self.rewards, rollout).to(self.device)  # [B, K]
        reward = self.mixer(scores, rollout.group)  # [B]
        if self.kl is not None and self.kl.placement == "reward" and self.reference is not None:
            reward = reward + self.kl.reward_penalty(
                self._old_logp(rollout), self._ref_logp(rollout), rollout.completion_mask
            )
        scoring_time = time.perf_counter() - started - rollout_time
        self._call_rollout_hooks(rollout)
        mask = rollout.completion_mask.float()
        if self.mask_truncated_completions:
            mask = overlong_filter(mask, rollout.truncated)
        adv = self.advantage(reward, rollout.group, mask)  # [B, T]
        metrics = self._optimise(rollout, adv, mask)
        metrics.update(self._rollout_metrics(rollout, scores, reward, adv, mask))
        metrics["time/rollout_s"] = rollout_time
        metrics["time/scoring_s"] = scoring_time
        metrics["time/training_s"] = time.perf_counter() - started - rollout_time - scoring_time
        self.log_dict({k: float(v) for k, v in metrics.items()}, on_step=True, prog_bar=False)
        self.log("reward", float(reward.mean()), prog_bar=True, on_step=True)

    def rollout(self, batch: dict[str, Any], *, seed: int | None = None, greedy: bool = False, n: int | None = None):
        """Sample completions for a batch of prompts and attach texts and dataset fields."""
        n = n or self.group_size
        rollout = self.engine.generate(batch["prompt_ids"], n, seed=seed, greedy=greedy).to(self.device)
        rollout.prompts = [p for p in batch["prompt"] for _ in range(n)]
        rollout.completions = self.tokenizer.batch_decode(
            rollout.completion_ids.masked_fill(rollout.completion_mask == 0, self.tokenizer.pad_token_id or 0),
            skip_special_tokens=True,
        )
        rollout.fields = {key: [v for v in values for _ in range(n)] for key, values in batch["fields"].items()}
        return rollout

    def _call_rollout_hooks(self, rollout: Rollout) -> None:
        for callback in self.trainer.callbacks:
            hook = getattr(callback, "on_rollout_end", None)
            if hook is not None:
                hook(self.trainer, self, rollout)

    def _old_logp(self, rollout: Rollout) -> Tensor:
        if self.ppo_clip_ref_logprobs == "rollout" and rollout.logp is not None:
            return rollout.logp
        return self._score_tokens(self.policy, rollout)

    def _ref_logp(self, rollout: Rollout) -> Tensor:
        return self._score_tokens(self.reference, rollout)

    @torch.no_grad()
    def _score_tokens(self, model: PreTrainedModel, rollout: Rollout) -> Tensor:
        """``model``'s log-probs ``[B, T]`` of the rollout's completion tokens at the sampling temperature."""
        width = rollout.completion_ids.shape[1]
        out, _ = completion_logprobs(
            model, rollout.input_ids, rollout.attention_mask, width, temperature=self.temperature
        )
        return out.logp

    @torch.no_grad()
    def _router_logp(self, rollout: Rollout) -> Tensor:
        """The sampling policy's log routing probabilities at the completion positions, ``[L, B, T, E]``."""
        width = rollout.completion_ids.shape[1]
        _, router = completion_logprobs(
            self.policy, rollout.input_ids, rollout.attention_mask, width, output_router_logits=True
        )
        if router is None:
            raise ValueError(f"gate {type(self.gate).__name__} needs router logits; the policy is not a MoE model.")
        return completion_router_logp(router, len(rollout), width)

    def _optimise(self, rollout: Rollout, adv: Tensor, mask: Tensor) -> dict[str, Tensor]:
        """``ppo_epochs x number_of_minibatches`` optimiser steps on one rollout; returns averaged diagnostics."""
        single_update = self.optim.ppo_epochs == 1 and self.optim.number_of_minibatches == 1
        on_policy = single_update and self.ppo_clip_ref_logprobs == "batch"
        old_logp = None if on_policy else self._old_logp(rollout)
        old_router = self._router_logp(rollout) if "old_router_logp" in self.gate.requires else None
        ref_logp = self._ref_logp(rollout) if self.reference is not None and self.kl.placement == "loss" else None
        optimizer = self.optimizers()
        sums: dict[str, float] = defaultdict(float)
        updates = 0
        for _ in range(self.optim.ppo_epochs):
            order = (
                torch.randperm(len(rollout), device=self.device) if not single_update else torch.arange(len(rollout))
            )
            for rows in order.chunk(self.optim.number_of_minibatches):
                normaliser = self.aggregator.normaliser(mask[rows])
                optimizer.zero_grad()
                for micro in rows.split(self.optim.micro_batch_size or len(rows)):
                    olds = (old_logp, ref_logp, old_router)
                    loss, metrics = self._micro_loss(rollout, adv, mask, olds, micro, normaliser)
                    self.manual_backward(loss)
                    sums["loss"] += float(loss)  # micro-batch losses add up to the minibatch loss
                    for key, value in metrics.items():
                        sums[key] += float(value) * len(micro) / len(rollout)
                if self.optim.max_grad_norm is not None:
                    norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.optim.max_grad_norm)
                    sums["grad/norm"] += float(norm)
                optimizer.step()
                updates += 1
        out = {key: value / self.optim.ppo_epochs for key, value in sums.items()}
        for per_update in ("loss", "grad/norm"):
            if per_update in sums:
                out[per_update] = sums[per_update] / updates
        return out

    def _micro_loss(self, rollout, adv, mask, olds, rows, normaliser) -> tuple[Tensor, dict]:
        old_logp, ref_logp, old_router = olds
        width = int(rollout.completion_mask[rows].sum(-1).max().clamp_min(1))  # drop all-padding columns
        ids = torch.cat([rollout.prompt_ids[rows], rollout.completion_ids[rows, :width]], 1)
        attn = torch.cat([rollout.prompt_mask[rows], rollout.completion_mask[rows, :width]], 1)
        need_entropy = self.entropy is not None and self.entropy.coef > 0
        out, router = completion_logprobs(
            self.policy,
            ids,
            attn,
            width,
            temperature=self.temperature,
            with_entropy=True,
            output_router_logits=old_router is not None,
        )
        logp, m = out.logp, mask[rows, :width]
        old = logp.detach() if old_logp is None else old_logp[rows, :width]
        extras = {}
        if old_router is not None:
            extras["router_logp"] = completion_router_logp(router, len(rows), width)
            extras["old_router_logp"] = old_router[:, rows, :width]
        per_token, metrics = self.gate(logp, old, adv[rows, :width], m, **extras)
        if ref_logp is not None:
            kl_term, kl_metrics = self.kl.loss_term(logp, ref_logp[rows, :width], m)
            per_token, metrics = per_token + kl_term, {**metrics, **kl_metrics}
        if need_entropy:
            per_token = per_token + self.entropy.loss_term(out.entropy, m)
        if self.correction is not None and rollout.logp is not None and old_logp is not None:
            weight, corr_metrics = self.correction(old, rollout.logp[rows, :width], m)
            per_token, metrics = per_token * weight, {**metrics, **corr_metrics}
        loss = self.aggregator(per_token, m, normaliser)
        metrics["entropy"] = (out.entropy.detach() * m).sum() / m.sum().clamp_min(1)
        return loss, metrics

    def _rollout_metrics(self, rollout, scores, reward, adv, mask) -> dict[str, Tensor]:
        lengths = rollout.lengths.float()
        metrics = {
            "reward/mean": reward.mean(),
            "reward/std": reward.std() if len(reward) > 1 else reward.new_zeros(()),
            "completion/len_mean": lengths.mean(),
            "completion/len_max": lengths.max(),
            "completion/truncated_frac": rollout.truncated.float().mean(),
            "adv/mean": (adv * mask).sum() / mask.sum().clamp_min(1),
            "adv/abs_mean": (adv.abs() * mask).sum() / mask.sum().clamp_min(1),
        }
        for k, fn in enumerate(self.rewards):
            metrics[f"reward/{reward_name(fn)}"] = scores[:, k].mean()
        return metrics


def completion_router_logp(router_logits: tuple[Tensor, ...], batch_size: int, width: int) -> Tensor:
    """Router log-probs ``[L, B, T, E]`` aligned with the last ``width`` tokens (shifted like the logits)."""
    return router_logprobs(router_logits, batch_size)[:, :, -width - 1 : -1]
