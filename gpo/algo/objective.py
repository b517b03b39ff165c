"""The policy objective of one RL step: token weights, masks, gate, regularisers, sample weights and aggregation."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from gpo.algo.aggregators import LossAggregator
from gpo.algo.contracts import (
    check_requires,
    check_token_parts,
    checked_gate_output,
    checked_mask_output,
    checked_weight_output,
)
from gpo.algo.distillation import TeacherKL
from gpo.algo.gates.base import Metrics, RatioGate
from gpo.algo.masked import masked_mean
from gpo.algo.masks import TokenMask
from gpo.algo.regularizers import EntropyBonus, KLPenalty
from gpo.algo.weighting import TokenWeight

#: The metric counting the tokens the gate's loss covers (after the per-update masks): what its statistics are over.
LOSS_TOKENS = "train/loss_tokens"
#: The metric counting the tokens of the update's loss mask (before the per-update masks), which the other statistics
#: are over: the entropy, the KL term's, distillation's and the per-update masks' own.
MASK_TOKENS = "train/mask_tokens"
#: The keys (or key prefixes) of the statistics over the whole loss mask, weighted by ``MASK_TOKENS`` when combined.
MASK_STATISTICS = ("entropy", "kl/", "distill/", "mask/")
#: What the objective always has in a gradient pass; parts naming only these need nothing more from the trainer.
ALWAYS_GIVEN = frozenset({"logp", "old_logp", "adv", "entropy"})


class PolicyObjective:
    """``loss = aggregate(c_t * (gate_t(A'_t; m_t) + beta * KL_t - coef * H_t))`` over the step's normaliser.

    ``A'_t = w_t A_t - lambda k_t`` with ``w_t`` the product of the ``token_weights`` (dropping weights shrink the mask
    instead: ``loss_mask``) and ``k_t`` the reverse KL to a teacher (``distill``, on-policy distillation); ``gate_t``
    is the ratio gate's per-token loss over the tokens ``m_t`` the per-update ``masks`` keep (masks of step inputs
    shrink the loss mask instead: ``step_mask``); ``KL_t`` the KL estimate towards the reference (``kl`` placed in
    the loss); ``H_t`` the token entropy (``entropy``); ``c_t`` a constant sample weight (the rollout-vs-trainer
    correction, TIS/MIS). A token a per-update mask drops keeps its KL and entropy terms and its place in the
    normaliser, like a clipped token. ``requires`` names every input beyond log-probs, advantages, the mask and the
    entropy that the parts read; the trainer computes exactly those.

    Args:
        gate: the ratio gate.
        aggregator: how token terms are averaged.
        kl: KL penalty towards the reference (the loss term when placed in the loss; see ``KLPenalty``).
        entropy: entropy bonus, constant or adaptive.
        token_weights: per-token weights of the advantage (``OverlongFilter``, ``ReferenceProbWeight``, ...).
        masks: tokens to leave out of the surrogate (``OffPolicySequenceMask``, ``SecondMomentMask``, ...).
        distill: on-policy distillation towards a teacher (``TeacherKL``).
    """

    def __init__(
        self,
        gate: RatioGate,
        aggregator: LossAggregator,
        *,
        kl: KLPenalty | None = None,
        entropy: EntropyBonus | None = None,
        token_weights: Sequence[TokenWeight] = (),
        masks: Sequence[TokenMask] = (),
        distill: TeacherKL | None = None,
    ) -> None:
        check_requires(gate)
        check_token_parts(masks, token_weights)
        self.gate, self.aggregator, self.distill = gate, aggregator, distill
        self.kl = kl if kl is not None and kl.beta > 0 and kl.placement == "loss" else None
        self.entropy = entropy if entropy is not None and entropy.enabled else None
        self.dropping = [w for w in token_weights if w.drops_tokens]
        self.scaling = [w for w in token_weights if not w.drops_tokens]
        self.step_masks = [m for m in masks if not m.per_update]
        self.update_masks = [m for m in masks if m.per_update]
        weights_read = [w.requires for w in self.scaling]  # step inputs (a dropping weight reads the rollout's flags)
        distilled = distill.requires if distill is not None else set()
        needs = [gate.requires, *(m.requires for m in masks), distilled, *weights_read]
        self.requires = frozenset().union(*needs) - ALWAYS_GIVEN | ({"ref_logp"} if self.kl is not None else set())

    @property
    def masks(self) -> list[TokenMask]:
        """Every token mask: the step masks, then the per-update ones."""
        return [*self.step_masks, *self.update_masks]

    @property
    def token_weights(self) -> list[TokenWeight]:
        """Every token weight: the dropping ones, then the scaling ones."""
        return [*self.dropping, *self.scaling]

    @property
    def part_names(self) -> list[str]:
        """What computes the loss from its inputs, each as ``kind Class``: the ratio gate, the aggregator, the token
        masks and weights, the KL and entropy terms and the distillation signal the objective holds."""
        named = [("gate", self.gate), ("aggregator", self.aggregator), ("kl", self.kl), ("entropy", self.entropy),
                 ("distill", self.distill), *(("mask", m) for m in self.masks),
                 *(("token weight", w) for w in self.token_weights)]  # fmt: skip
        return [f"{kind} {type(part).__name__}" for kind, part in named if part is not None]

    def loss_mask(self, mask: Tensor, truncated: Tensor) -> Tensor:
        """``mask[B, T]`` with the tokens the dropping weights take out of the loss (and its normaliser) zeroed."""
        for weight in self.dropping:
            mask = checked_weight_output(weight(mask, **_pick(weight, {"truncated": truncated})), weight, mask)
        return mask

    def step_mask(self, mask: Tensor, adv: Tensor, **inputs: Tensor) -> tuple[Tensor, Metrics]:
        """``mask[B, T]`` with the tokens the step-input masks drop zeroed (they leave the loss and its normaliser)
        and their metrics; ``inputs`` as the masks require (``rollout_logp``, ``train_logp``). Once per step, before
        the normaliser is taken."""
        metrics: Metrics = {}
        for token_mask in self.step_masks:
            out = token_mask(mask, **_pick(token_mask, {"adv": adv, **inputs}))
            keep, mask_metrics = checked_mask_output(out, token_mask, mask)
            mask, metrics = torch.where(keep, mask, 0), {**metrics, **mask_metrics}  # [B, T]
        return mask, metrics

    def weigh(self, adv: Tensor, mask: Tensor, **inputs: Tensor) -> Tensor:
        """``adv[B, T]`` times every scaling weight (fixed for the step), 0 outside ``mask``; ``inputs`` as the
        weights require. Without scaling weights, ``adv`` itself."""
        for weight in self.scaling:
            w = checked_weight_output(weight(mask, **_pick(weight, inputs)), weight, mask)
            adv = torch.where(mask.bool(), adv * w, 0.0)
        return adv

    def __call__(
        self,
        logp: Tensor,
        old_logp: Tensor,
        adv: Tensor,
        mask: Tensor,
        normaliser: Tensor | None = None,
        *,
        ref_logp: Tensor | None = None,
        entropy: Tensor | None = None,
        weight: Tensor | None = None,
        teacher_logp: Tensor | None = None,
        **inputs: Tensor,
    ) -> tuple[Tensor, Metrics]:
        """All tensors ``[B, T]`` (``inputs``: what the gate and masks require, others ignored); returns the scalar
        loss and diagnostics."""
        metrics: Metrics = {}
        if self.distill is not None:
            if teacher_logp is None:
                raise ValueError("distill needs teacher_logp (the teacher's log-probs of the sampled tokens).")
            adv, metrics = self.distill(adv, logp, mask, teacher_logp=teacher_logp)
        given = {**inputs, "logp": logp.detach(), "old_logp": old_logp, "adv": adv, "entropy": entropy,
                 "ref_logp": ref_logp, "teacher_logp": teacher_logp}  # fmt: skip
        kept = mask
        for token_mask in self.update_masks:
            keep, mask_metrics = checked_mask_output(token_mask(kept, **_pick(token_mask, given)), token_mask, kept)
            kept, metrics = torch.where(keep, kept, 0), {**metrics, **mask_metrics}  # [B, T]
        per_token, gate_metrics = checked_gate_output(self.gate(logp, old_logp, adv, kept, **_pick(self.gate, given)),
                                                      self.gate, mask, logp)  # fmt: skip
        metrics = {**metrics, **gate_metrics, LOSS_TOKENS: kept.detach().sum().float(),
                   MASK_TOKENS: mask.detach().sum().float()}  # fmt: skip
        if self.kl is not None:
            if ref_logp is None:
                raise ValueError("the KL loss term needs ref_logp (reference log-probs of the same tokens).")
            kl_term, kl_metrics = self.kl.loss_term(logp, ref_logp, mask, old_logp=old_logp)
            per_token, metrics = per_token + kl_term, {**metrics, **kl_metrics}
        if self.entropy is not None:
            if entropy is None:
                raise ValueError("the entropy bonus needs the token entropy.")
            per_token = per_token + self.entropy.loss_term(entropy, mask)
        if weight is not None:
            per_token = per_token * weight
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy.detach(), mask)
        loss = self.aggregator(per_token, mask, normaliser)
        if not isinstance(loss, Tensor) or loss.ndim != 0:
            shape = list(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(f"the loss aggregator {type(self.aggregator).__name__} returned {shape}, not a scalar "
                             "tensor (LossAggregator.numerator sums its rows to one value).")  # fmt: skip
        if torch.is_grad_enabled() and per_token.requires_grad and not loss.requires_grad:
            raise ValueError(f"the loss aggregator {type(self.aggregator).__name__} returned a loss without gradient "
                             "(detached from per_token_loss): LossAggregator.numerator sums per_token_loss itself, "
                             "not a detached copy or .item().")  # fmt: skip
        return loss, metrics

    @property
    def adapts(self) -> bool:
        """Whether ``end_step`` has anything to adapt (an adaptive entropy coefficient)."""
        return self.entropy is not None and self.entropy.adaptive is not None

    def end_step(self, metrics: Mapping[str, float | Tensor]) -> dict[str, float]:
        """After an RL step's updates: the adaptive entropy coefficient sees the step's mean token entropy
        (``metrics["entropy"]``, averaged over every process); returns its metrics, or nothing without one or
        without a measurement."""
        if not self.adapts or "entropy" not in metrics:
            return {}
        return self.entropy.observe(float(metrics["entropy"]))

    def state_dict(self) -> dict[str, dict[str, float]]:
        """The state that outlives a step (the adaptive entropy coefficient), as plain values for a checkpoint."""
        if not self.adapts:
            return {}
        return {"entropy": self.entropy.adaptive.state_dict()}

    def load_state_dict(self, state: Mapping[str, dict[str, float]]) -> None:
        if "entropy" in state and self.adapts:
            self.entropy.adaptive.load_state_dict(state["entropy"])


def combine_statistics(measured: list[Metrics]) -> Metrics:
    """One value per key from the objective metrics of parts of a step (its micro-batches, or its ranks): the token
    counts (``LOSS_TOKENS``, ``MASK_TOKENS``) summed; keys ending in ``min`` or ``max`` the extremes over the parts
    whose gate covered tokens; every other key the mean weighted by the tokens it is over: ``MASK_TOKENS`` for
    ``MASK_STATISTICS``, the gate's ``LOSS_TOKENS`` for the rest (a part whose masks left the gate no token, whose
    ratio statistics read 0, has no say in them). Token means come out as over the whole step; means over sequences
    (``seq_ratio/mean``, GSPO's clip fractions) are weighted by tokens too, close to but not exactly the step's. A key
    missing from a part counts as 0 there; a single record is returned as it is, with no tensor operation."""
    if len(measured) == 1:
        return dict(measured[0])
    counts = {key: torch.stack([metrics[key] for metrics in measured]) for key in (LOSS_TOKENS, MASK_TOKENS)}  # [K]
    out: Metrics = {key: count.sum() for key, count in counts.items()}
    shares = {key: count / count.sum().clamp_min(1) for key, count in counts.items()}  # [K]: each part's share
    some, zero = counts[LOSS_TOKENS] > 0, torch.zeros_like(counts[LOSS_TOKENS][0])
    for key in dict.fromkeys(key for metrics in measured for key in metrics if key not in counts):
        values = torch.stack([metrics.get(key, zero) for metrics in measured]).float()  # [K]
        if key.endswith(("/min", "/max", "_min", "_max")):  # ratio/min, vespo/weight_max: extremes
            low = key.endswith("min")
            extreme = torch.where(some, values, math.inf if low else -math.inf)
            out[key] = torch.where(some.any(), extreme.amin() if low else extreme.amax(), 0.0)
        else:
            out[key] = (values * shares[MASK_TOKENS if key.startswith(MASK_STATISTICS) else LOSS_TOKENS]).sum()
    return out


def _pick(part: RatioGate | TokenMask | TokenWeight, given: Mapping[str, Tensor | None]) -> dict[str, Tensor]:
    """The inputs ``part.requires`` from ``given``, refusing a missing one with its name."""
    missing = sorted(name for name in part.requires if given.get(name) is None)
    if missing:
        raise ValueError(f"{type(part).__name__} needs {missing}; pass them to the objective by name.")
    return {name: given[name] for name in part.requires}
