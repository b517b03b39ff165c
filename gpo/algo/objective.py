"""The policy objective of one RL step: token weights, gate, regularisers, sample weights and aggregation."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gpo.algo.aggregators import LossAggregator
from gpo.algo.gates.base import Metrics, RatioGate
from gpo.algo.masked import masked_mean
from gpo.algo.regularizers import EntropyBonus, KLPenalty
from gpo.algo.weighting import TokenWeight


class PolicyObjective:
    """``loss = aggregate(c_t * (gate_t(A'_t) + beta * KL_t - coef * H_t))`` over the step's normaliser.

    ``A'_t = w_t A_t`` with ``w_t`` the product of the ``token_weights`` (dropping weights shrink the mask instead:
    ``loss_mask``); ``gate_t`` is the ratio gate's per-token loss; ``KL_t`` the KL estimate towards the reference
    (``kl`` placed in the loss); ``H_t`` the token entropy (``entropy``); ``c_t`` a constant sample weight (the
    rollout-vs-trainer correction, TIS/MIS). ``requires`` names every input beyond log-probs, advantages and the
    mask that the gate, the KL term and the weights read; the trainer computes exactly those.

    Args:
        gate: the ratio gate.
        aggregator: how token terms are averaged.
        kl: KL penalty towards the reference (the loss term when placed in the loss; see ``KLPenalty``).
        entropy: entropy bonus.
        token_weights: per-token weights of the advantage (``OverlongFilter``, ``ReferenceProbWeight``, ...).
    """

    def __init__(
        self,
        gate: RatioGate,
        aggregator: LossAggregator,
        *,
        kl: KLPenalty | None = None,
        entropy: EntropyBonus | None = None,
        token_weights: Sequence[TokenWeight] = (),
    ) -> None:
        self.gate, self.aggregator = gate, aggregator
        self.kl = kl if kl is not None and kl.beta > 0 and kl.placement == "loss" else None
        self.entropy = entropy if entropy is not None and entropy.coef > 0 else None
        self.dropping = [w for w in token_weights if w.drops_tokens]
        self.scaling = [w for w in token_weights if not w.drops_tokens]
        needs_reference = self.kl is not None or any("ref_logp" in w.requires for w in self.scaling)
        self.requires = frozenset(gate.requires) | ({"ref_logp"} if needs_reference else set())

    def loss_mask(self, mask: Tensor, truncated: Tensor) -> Tensor:
        """``mask[B, T]`` with the tokens the dropping weights take out of the loss (and its normaliser) zeroed."""
        for weight in self.dropping:
            mask = weight(mask, truncated=truncated)
        return mask

    def weigh(self, adv: Tensor, mask: Tensor, **inputs: Tensor) -> Tensor:
        """``adv[B, T]`` times every scaling weight (fixed for the step), 0 outside ``mask``; ``inputs`` as the
        weights require. Without scaling weights, ``adv`` itself."""
        for weight in self.scaling:
            w = weight(mask, **{name: inputs[name] for name in weight.requires})
            adv = torch.where(mask.bool(), adv * w, torch.zeros_like(adv))
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
        **gate_inputs: Tensor,
    ) -> tuple[Tensor, Metrics]:
        """All tensors ``[B, T]`` (gate inputs as the gate needs); returns the scalar loss and diagnostics."""
        per_token, metrics = self.gate(logp, old_logp, adv, mask, **gate_inputs)
        if self.kl is not None:
            if ref_logp is None:
                raise ValueError("the KL loss term needs ref_logp (reference log-probs of the same tokens).")
            kl_term, kl_metrics = self.kl.loss_term(logp, ref_logp, mask)
            per_token, metrics = per_token + kl_term, {**metrics, **kl_metrics}
        if self.entropy is not None:
            if entropy is None:
                raise ValueError("the entropy bonus needs the token entropy.")
            per_token = per_token + self.entropy.loss_term(entropy, mask)
        if weight is not None:
            per_token = per_token * weight
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy.detach(), mask)
        return self.aggregator(per_token, mask, normaliser), metrics
