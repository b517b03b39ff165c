"""The policy objective of one micro-batch: gate, regularisers, sample weights and aggregation in one place."""

from __future__ import annotations

from torch import Tensor

from gpo.algo.aggregators import LossAggregator
from gpo.algo.gates.base import Metrics, RatioGate
from gpo.algo.masked import masked_mean
from gpo.algo.regularizers import EntropyBonus, KLPenalty


class PolicyObjective:
    """``loss = aggregate(w_t * (gate_t + beta * KL_t - c * H_t))`` over the step's normaliser.

    ``gate_t`` is the ratio gate's per-token loss, ``KL_t`` the KL estimate towards the reference (when
    ``kl`` is set and reference log-probs are given), ``H_t`` the token entropy (when ``entropy`` is set) and
    ``w_t`` an optional constant sample weight (rollout-vs-trainer correction).

    Args:
        gate: the ratio gate.
        aggregator: how token terms are averaged.
        kl: KL penalty used as a loss term (its reward placement is applied before advantages instead).
        entropy: entropy bonus.
    """

    def __init__(
        self,
        gate: RatioGate,
        aggregator: LossAggregator,
        *,
        kl: KLPenalty | None = None,
        entropy: EntropyBonus | None = None,
    ) -> None:
        self.gate, self.aggregator = gate, aggregator
        self.kl = kl if kl is not None and kl.beta > 0 and kl.placement == "loss" else None
        self.entropy = entropy if entropy is not None and entropy.coef > 0 else None

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
        """All tensors ``[B, T]`` (router inputs as the gate needs); returns the scalar loss and diagnostics."""
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
