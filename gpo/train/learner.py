"""Learner: a scored rollout and its advantages -> optimiser steps on the policy objective."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from lightning import LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor

from gpo.algo import KLPenalty, OverlongFilter, RolloutCorrection, mismatch_metrics
from gpo.algo.gates.base import Metrics
from gpo.algo.objective import ALWAYS_GIVEN, LOSS_TOKENS, MASK_TOKENS, PolicyObjective, combine_statistics
from gpo.models.scorer import TokenScorer
from gpo.models.teacher import Teacher
from gpo.parallel import collectives, fsdp
from gpo.rollout.base import Rollout
from gpo.suggest import did_you_mean
from gpo.train.nonfinite import NonfiniteGuard
from gpo.train.optimization import Optimization

log = logging.getLogger(__name__)

OldLogprobs = Literal["rollout", "trainer"]
EMPTY_LOSS_WARNING = 5  # steps in a row without a token in the loss before the warning
#: Objective inputs the learner computes: ``old_*``, ``ref_logp``, ``rollout_logp`` (the engine's), ``train_logp``
#: (the trainer's before the first update) and ``teacher_logp`` once per step over the rollout; ``router_logp`` and
#: ``topk_logp`` in each gradient pass.
SUPPLIED_INPUTS = frozenset(
    {"router_logp", "old_router_logp", "topk_logp", "old_topk_logp", "ref_logp", "rollout_logp", "train_logp",
     "teacher_logp"}
)  # fmt: skip


@dataclass
class Backend:
    """What the learner needs from the training loop that runs it (Lightning's, in ``GPOModule``)."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    backward: Callable[[Tensor], None]  # Lightning's manual_backward: precision and strategy hooks included
    gradient_sync: Callable[[bool], AbstractContextManager]  # (last micro-batch?) -> DDP's no_sync when not
    sharded: bool  # FSDP2: every rank must run the same number of forward passes
    device: torch.device
    step: int  # the optimiser step count, for messages
    scaler: torch.amp.GradScaler | None  # float16 loss scaling (``trainer.precision: 16-mixed``), or None


def lightning_backend(module: LightningModule) -> Backend:
    """The ``Backend`` of a LightningModule under manual optimisation: its optimiser and scheduler,
    ``manual_backward``, and DDP's ``no_sync`` for all but the last micro-batch (gradients are all-reduced in the
    last micro-batch's backward only; the others accumulate locally, so ranks may run different numbers of them)."""
    strategy = module.trainer.strategy

    def gradient_sync(last: bool) -> AbstractContextManager:
        return strategy.block_backward_sync() if isinstance(strategy, ParallelStrategy) and not last else nullcontext()

    precision = module.trainer.precision_plugin
    scaler = precision.scaler if isinstance(precision, MixedPrecision) else None
    return Backend(module.optimizers(), module.lr_schedulers(), module.manual_backward, gradient_sync,
                   fsdp.is_sharded(strategy), module.device, module.trainer.global_step, scaler)  # fmt: skip


def check_supplied(objective: PolicyObjective) -> None:
    """Refuse a part whose ``requires`` names an input the trainer does not compute (a misspelt name would otherwise
    reach the part as nothing), naming the part and the closest input supplied."""
    supplied = sorted(SUPPLIED_INPUTS | ALWAYS_GIVEN)
    parts = [objective.gate, *objective.masks, *objective.scaling, objective.distill]
    for name in sorted(objective.requires - SUPPLIED_INPUTS):
        who = ", ".join(type(part).__name__ for part in parts if part is not None and name in part.requires)
        guess = did_you_mean(name, supplied, "{!r}", " ")
        raise ValueError(
            f"{who or 'a part of the objective'} requires {name!r}, which the trainer does not compute; "
            f"{guess}it supplies {', '.join(supplied)} (docs/algorithms.md says when each is given)."
        )


class Learner:
    """Optimiser steps on one scored rollout: ``ppo_epochs x number_of_minibatches`` updates of the objective.

    Before the first update, the inputs that stay fixed while the policy moves are computed through the
    ``TokenScorer``: the old-policy log-probs (the sampler's, or the trainer's own), the reference log-probs and
    router log-probs when the objective requires them, the rollout-vs-trainer mismatch and its correction weight.
    Each update splits its minibatch into micro-batches whose gradients add up to the minibatch's (the aggregator's
    normaliser is over the whole minibatch, and over every rank under DDP), syncs gradients once, clips the global
    norm and skips the update when the loss or the gradient is not finite.

    Args:
        scorer: scores the policy (and reference) on the rollout's tokens.
        objective: the per-token objective and its aggregation.
        optim: minibatches, epochs, micro-batch size, gradient clipping, non-finite tolerance.
        old_logprobs: the behaviour policy's log-probs from the ``rollout`` engine, or recomputed by the ``trainer``
            before the first update.
        correction: rollout-vs-trainer importance correction (TIS/MIS).
        kl: the KL penalty, whose ``reward`` placement is applied here to the rollout's reward.
        sampler_shares_weights: the engine samples from the trained module itself, or from its copy in the rollout
            worker of pipelined rollouts: its log-probs come from the trainer's own code, so there is no kernel
            mismatch to measure (a pipeline's lag is in the ratio the gates already see), and no extra pass is spent
            measuring one.
        teacher: scores the sampled tokens for on-policy distillation (when the objective reads ``teacher_logp``).
    """

    def __init__(
        self,
        scorer: TokenScorer,
        objective: PolicyObjective,
        optim: Optimization,
        *,
        old_logprobs: OldLogprobs = "rollout",
        correction: RolloutCorrection | None = None,
        kl: KLPenalty | None = None,
        sampler_shares_weights: bool = True,
        teacher: Teacher | None = None,
    ) -> None:
        check_supplied(objective)
        if "teacher_logp" in objective.requires and teacher is None:
            raise ValueError("the objective distils from a teacher (teacher_logp), but no teacher was given.")
        self.scorer, self.objective, self.optim, self.teacher = scorer, objective, optim, teacher
        self.old_logprobs, self.correction, self.sampler_shares_weights = (
            old_logprobs,
            correction,
            sampler_shares_weights,
        )
        self.reward_kl = kl if kl is not None and kl.beta > 0 and kl.placement == "reward" else None
        self.nonfinite = NonfiniteGuard(optim.max_consecutive_nonfinite)
        self.empty_streak = 0

    def has_loss_tokens(self, mask: Tensor, step: int, *, final: bool = True) -> bool:
        """Whether any rank's ``mask[B, T]`` keeps a token in the loss (one all-reduce). A step without is not trained
        (no optimiser step on an empty loss). A mask that the token masks may still shrink (``final`` False) does not
        end a streak of such steps (``note_loss_tokens``)."""
        return self.note_loss_tokens(float(collectives.reduce_over_ranks(mask.sum(), "sum")) > 0, step, final=final)

    def note_loss_tokens(self, some: bool, step: int, *, final: bool = True) -> bool:
        """Count a step that left ``some`` token in the loss, or none: ``EMPTY_LOSS_WARNING`` steps in a row without
        are warned about (a per-update mask that drops every token trains nothing either). Returns ``some``."""
        if some:
            if final:
                self.empty_streak = 0
            return True
        self.empty_streak += 1
        if self.empty_streak == EMPTY_LOSS_WARNING:
            parts = [*self.objective.dropping, *self.objective.masks]
            overlong = any(isinstance(part, OverlongFilter) for part in parts)
            fix = ("; OverlongFilter drops every completion that reaches max_new_tokens without EOS). Raise "
                   "model.engine.init_args.sampling.max_new_tokens, or loosen or remove" if overlong else "). Loosen "
                   "or remove")  # fmt: skip
            log.warning(
                "optimiser step %d: no token was left in the loss for %d steps in a row, so nothing trained (token "
                "weights and masks that drop tokens: %s%s the part in model.token_weights or model.masks.", step,
                self.empty_streak, ", ".join(type(part).__name__ for part in parts) or "none", fix,
            )  # fmt: skip
        return False

    @property
    def wants_rollout_logprobs(self) -> bool:
        """Whether the engine should return its log-probs (the learner reads them)."""
        return (
            self.old_logprobs == "rollout" or self.correction is not None or "rollout_logp" in self.objective.requires
        )

    def add_kl_penalty(self, rollout: Rollout) -> Rollout:
        """The rollout with ``-beta * sum_t KL_t`` added to its reward, when the KL penalty sits in the reward: over the
        policy's tokens (``loss_mask``; a multi-turn episode's observations are context it did not choose)."""
        if self.reward_kl is not None:
            logp, ref_logp = self.scorer.policy_logp(rollout), self.scorer.reference_logp(rollout)
            penalty = self.reward_kl.reward_penalty(logp, ref_logp, rollout.loss_mask)  # [B]
            rollout.reward, rollout.reward_kl = rollout.reward + penalty, penalty / -self.reward_kl.beta
        return rollout

    def update(self, rollout: Rollout, adv: Tensor, mask: Tensor, backend: Backend) -> dict[str, Tensor] | None:
        """Train on ``rollout`` with advantages ``adv[B, T]`` over ``mask[B, T]``; returns the step's diagnostics as
        0-d tensors (per-update means; ``loss`` and ``grad/norm`` over the updates applied), or None, with no update,
        when the step masks left no token in the loss on any rank.

        The first epoch takes the rows in order, as slices (views, no copies); later epochs shuffle them. Completion
        widths are read on the host once per step, so no micro-batch waits for the device."""
        inputs, fixed_metrics = self.step_inputs(rollout, mask)
        mask, mask_metrics = self.objective.step_mask(mask, adv, **inputs)  # before any normaliser is taken
        final = not self.objective.update_masks  # else the gate's tokens are counted after the updates
        if self.objective.step_masks and not self.has_loss_tokens(mask, backend.step, final=final):
            return None  # an optimiser step on an empty loss would still move the weights (momentum, decay)
        adv = self.objective.weigh(adv, mask, **inputs)
        batch = StepBatch(rollout, adv, mask, inputs, rollout.lengths.tolist())
        zero = torch.zeros((), device=backend.device)
        measured: list[Metrics] = []  # each micro-batch's objective metrics
        losses, norms, skipped, gated = [], [], 0, 0.0
        bounds = collectives.minibatch_bounds(len(rollout), self.optim.number_of_minibatches)
        for epoch in range(self.optim.ppo_epochs):
            order = torch.randperm(len(rollout)) if epoch else None  # None: the rows in order
            for start, stop in bounds:
                applied = self._minibatch(batch, order, start, stop, backend, measured)
                if applied is None:
                    skipped += 1
                else:
                    losses.append(applied.loss)
                    norms.append(applied.grad_norm)
                    gated += applied.gated_tokens
        if self.objective.update_masks:
            self.note_loss_tokens(gated > 0, backend.step)
        out = combine_statistics(measured)
        out["loss"], out["grad/norm"] = (mean(losses), mean(norms)) if losses else (zero + math.nan, zero + math.nan)
        out["train/nonfinite_skipped"] = zero + skipped
        out["train/lr"] = zero + backend.optimizer.param_groups[0]["lr"]
        if backend.scaler is not None:  # 16-mixed: the loss scale the next update starts from
            out["train/loss_scale"] = zero + backend.scaler.get_scale()
        if self.objective.adapts and "entropy" in out:  # the adaptive coefficient follows the mean over every rank
            entropy = collectives.mean_over_ranks(out["entropy"])
            steered = self.objective.end_step({"entropy": entropy})
            out |= {key: zero + value for key, value in steered.items()}
        fixed = {**fixed_metrics, **mask_metrics}
        return {**out, **{key: value.detach().float() for key, value in fixed.items()}}

    def step_inputs(self, rollout: Rollout, mask: Tensor) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Everything the updates of this step need that does not change while the policy moves, and its metrics."""
        single_update = self.optim.ppo_epochs == 1 and self.optim.number_of_minibatches == 1
        use_rollout = self.old_logprobs == "rollout" and rollout.logp is not None
        separate_sampler = rollout.logp is not None and not self.sampler_shares_weights  # a mismatch to log
        requires = self.objective.requires
        need_train_old = (
            self.correction is not None or separate_sampler or not (use_rollout or single_update)
            or "train_logp" in requires
        )  # fmt: skip
        train_old = self.scorer.policy_logp(rollout) if need_train_old else None
        inputs, metrics = {}, {}
        old = rollout.logp if use_rollout else train_old
        if old is not None:  # None: one on-policy update, whose old log-probs are the gradient pass's own, detached
            inputs["old_logp"] = old
        if train_old is not None and rollout.logp is not None:
            if self.correction is not None:  # its metrics include the mismatch's
                inputs["weight"], metrics = self.correction(train_old, rollout.logp, mask)
            else:
                metrics = mismatch_metrics(train_old, rollout.logp, mask)
        if "ref_logp" in requires:
            inputs["ref_logp"] = self.scorer.reference_logp(rollout)
        if "teacher_logp" in requires:
            inputs["teacher_logp"] = self.teacher.logp(rollout)
        if "train_logp" in requires:
            inputs["train_logp"] = train_old
        if "rollout_logp" in requires:
            if rollout.logp is None:
                raise ValueError("a token mask needs the engine's log-probs (rollout_logp), but the rollout has none.")
            inputs["rollout_logp"] = rollout.logp
        topk = self.objective.gate.topk_tokens
        if "old_router_logp" in requires or "old_topk_logp" in requires:
            old = self.scorer.rollout_scores(rollout, router="old_router_logp" in requires, topk=topk)
            inputs |= {"old_router_logp": old.router_logp, "old_topk_logp": old.topk_logp, "topk_ids": old.topk_ids}
        return {k: v for k, v in inputs.items() if v is not None}, metrics

    def _minibatch(
        self, batch: StepBatch, order: Tensor | None, start: int, stop: int, backend: Backend,
        measured: list[Metrics],
    ) -> Update | None:  # fmt: skip
        """One optimiser update on the rows at positions ``start:stop`` of ``order`` (None: the rows in order);
        appends each micro-batch's diagnostics to ``measured``; returns the update's loss, gradient norm and gate
        tokens, or None when it was skipped (not finite). A normaliser that is not positive where the loss mask holds
        tokens is refused, naming the aggregator (the aggregator's floor of 1e-12 would scale the loss up 1e12)."""
        minibatch = batch.rows(order, start, stop)
        normaliser = collectives.ddp_normaliser(self.objective.aggregator.normaliser(batch.mask[minibatch.index]))
        size = self.optim.micro_batch_size or stop - start
        micros = [batch.rows(order, a, min(a + size, stop)) for a in range(start, stop, size)]
        backend.optimizer.zero_grad()
        if backend.sharded:
            fsdp.check_same_count(len(micros), "micro-batches", backend.device)
        counted = []  # per micro-batch: loss, the gate's tokens and the loss mask's, which add up to the minibatch's
        for index, micro in enumerate(micros):
            loss, metrics = self._micro_loss(batch, micro, normaliser)
            with backend.gradient_sync(index == len(micros) - 1):
                backend.backward(loss)
            counted.append(torch.stack([loss.detach().float(), metrics[LOSS_TOKENS], metrics[MASK_TOKENS]]))
            measured.append({key: value.detach() for key, value in metrics.items()})
        totals = collectives.mean_over_ranks(counted[0] if len(counted) == 1 else torch.stack(counted).sum(0))  # [3]
        scale = backend.scaler.get_scale() if backend.scaler is not None else 1.0  # 16-mixed: a second host sync
        norm = self._clip(scale)
        divisor = torch.as_tensor(normaliser, dtype=torch.float32, device=norm.device).reshape(1)
        read = torch.cat([totals, norm.float().reshape(1), divisor]).tolist()  # one host sync per update
        loss_value, gated, masked, norm_value, divisor_value = read
        if masked > 0 and not (math.isfinite(divisor_value) and divisor_value > 0):
            name = type(self.objective.aggregator).__name__
            raise ValueError(f"the loss aggregator {name} gave the normaliser {divisor_value:g} for a minibatch with "
                             "tokens in the loss; LossAggregator.normaliser returns the loss's positive divisor (its "
                             "tokens, sequences or a constant), summed over micro-batches and ranks.")  # fmt: skip
        if scale >= 1.0 and backend.scaler is not None and math.isfinite(loss_value) and not math.isfinite(norm_value):
            # A scale below 1 cannot overflow float16: there the gradient itself is not finite, for the guard below.
            log.info("optimiser step %d: the float16 loss scale %g overflowed the gradients; the scaler skips the "
                     "update and lowers the scale", backend.step, scale)  # fmt: skip
            backend.optimizer.step()  # the scaler sees the overflow: no update, a lower scale
            backend.scheduler.step()
            return None
        inputs = {"advantages": batch.adv, **batch.inputs}  # what the loss read besides the policy's log-probs
        if not self.nonfinite.finite(loss_value, norm_value, self.scorer.policy, backend.step, inputs, self.objective):
            backend.optimizer.zero_grad()
            return None
        backend.optimizer.step()
        backend.scheduler.step()
        return Update(totals[0], norm, gated)

    def _clip(self, scale: float) -> Tensor:
        """Clip the gradients' global norm at ``optim.max_grad_norm`` (FSDP2: over every rank's shards); returns the
        norm before clipping. Under float16 loss scaling the gradients are ``scale`` times the loss's until the
        optimiser step unscales them: the bound is scaled alike, and the norm returned is the unscaled one."""
        max_norm = self.optim.max_grad_norm if self.optim.max_grad_norm is not None else math.inf
        norm = fsdp.clip_grad_norm(self.scorer.policy.parameters(), max_norm * scale)
        return norm if scale == 1.0 else norm / scale  # no division (a kernel) without loss scaling

    def _micro_loss(self, batch: StepBatch, micro: Rows, normaliser: Tensor) -> tuple[Tensor, Metrics]:
        rollout, rows, width = batch.rollout, micro.index, micro.width
        ids = torch.cat([rollout.prompt_ids[rows], rollout.completion_ids[rows, :width]], 1)
        attn = torch.cat([rollout.prompt_mask[rows], rollout.completion_mask[rows, :width]], 1)
        requires = self.objective.requires
        at_ids = batch.inputs["topk_ids"][rows, :width] if "topk_logp" in requires else None
        scores = self.scorer.train_scores(ids, attn, width, router="router_logp" in requires, at_ids=at_ids)
        fixed = {  # [B, T, ...] rows, or [L, B, T, E] for the router
            k: v[:, rows, :width] if k == "old_router_logp" else v[rows, :width] for k, v in batch.inputs.items()
        }
        fixed.pop("topk_ids", None)
        old = fixed.pop("old_logp", None)
        current = {
            k: v for k, v in (("router_logp", scores.router_logp), ("topk_logp", scores.topk_logp)) if k in requires
        }
        return self.objective(
            scores.logp, scores.logp.detach() if old is None else old, batch.adv[rows, :width],
            batch.mask[rows, :width], normaliser, entropy=scores.entropy, **fixed, **current,
        )  # fmt: skip


class Update(NamedTuple):
    """One optimiser update applied: its loss and gradient norm (0-d tensors), and the tokens its gate covered (the
    mean over ranks, on the host: 0 only when it covered none on any rank)."""

    loss: Tensor
    grad_norm: Tensor
    gated_tokens: float


class Rows(NamedTuple):
    """Some of a step's rows: how to index them and their completion width."""

    index: slice | Tensor  # a slice (rows in order: views, no copies) or row indices on the step's device
    width: int  # the longest completion among them (at least 1): all-padding columns are not scored


@dataclass
class StepBatch:
    """What a step's updates read: the rollout, its advantages, loss mask and fixed inputs, and each row's completion
    length on the host (so choosing rows and widths never waits for the device)."""

    rollout: Rollout
    adv: Tensor  # [B, T]
    mask: Tensor  # [B, T]
    inputs: dict[str, Tensor]
    lengths: list[int]  # [B]

    def rows(self, order: Tensor | None, start: int, stop: int) -> Rows:
        """The rows at positions ``start:stop`` of ``order`` (a CPU permutation; None: the rows in order)."""
        if order is None:
            return Rows(slice(start, stop), max([1, *self.lengths[start:stop]]))
        picked = order[start:stop]
        width = max([1, *(self.lengths[row] for row in picked.tolist())])
        return Rows(picked.to(self.mask.device), width)


def mean(values: list[Tensor]) -> Tensor:
    """The mean of 0-d tensors (the one itself when there is one)."""
    return values[0] if len(values) == 1 else torch.stack(values).mean()
