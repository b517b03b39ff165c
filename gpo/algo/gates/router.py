"""RSPO: GMPO's geometric mean, with tokens down-weighted by how far the MoE router moved."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor

from gpo.algo.gates.base import Metrics, masked_loss, token_log_ratio
from gpo.algo.gates.sequence import GeometricMeanGate
from gpo.algo.masked import masked_stats, sequence_mean


def router_logprobs(router_logits: Sequence[Tensor], batch_size: int) -> Tensor:
    """Stack a mixture-of-experts model's per-layer router logits into log routing probabilities.

    transformers' MoE models (Qwen2-MoE, Mixtral, ...) called with ``output_router_logits=True`` return one
    ``[B * S, E]`` tensor per MoE layer; this gives ``[L, B, S, E]`` log-softmax over experts. Position ``s``
    routes the hidden state that predicts token ``s + 1``, so slice it exactly like the logits.
    """
    layers = [logits.float().log_softmax(-1).reshape(batch_size, -1, logits.shape[-1]) for logits in router_logits]
    return torch.stack(layers)  # [L, B, S, E]


def router_shift_weight(router_logp: Tensor, old_router_logp: Tensor, top_k: int, gamma_min: float) -> Tensor:
    """RSPO's router-shift ratio ``gamma[B, T]`` (no grad).

    ``gamma_t = max(gamma_min, exp(-(1/L) sum_l (1/K) sum_k |log r_l(e_lk) - log r_old_l(e_lk)|))`` where
    ``e_l1..e_lK`` are the top-``K`` experts of the old router at layer ``l``. Inputs are ``[L, B, T, E]``.
    """
    with torch.no_grad():
        experts = old_router_logp.topk(top_k, dim=-1).indices  # [L, B, T, K]
        shift = (router_logp.gather(-1, experts) - old_router_logp.gather(-1, experts)).abs()  # [L, B, T, K]
        gamma = (-shift.mean(-1).mean(0)).exp()  # [B, T]
        return gamma.clamp(min=gamma_min)


class RouterShiftGate(GeometricMeanGate):
    """RSPO (Zhang et al. 2025, "Towards Stable and Effective Reinforcement Learning for Mixture-of-Experts").

    ``score_i = [prod_t W_t]^(s / |o_i|) * [prod_t gamma_t]^(1 / |o_i|) * A_i`` with GMPO's token clipping
    ``W_t = min(w_t^s, clip(w_t, e^-clip_low, e^clip_high)^s)``, ``s = sgn(A_i)``, and the router-shift ratio
    ``gamma_t`` from ``router_shift_weight`` (floored at ``gamma_min``, stop-gradient), applied after clipping. In
    log space: ``log(score_i / A_i) = mean_t l_t + mean_t log gamma_t`` with ``l_t = min(log w_t, clip_high)`` if
    ``A_i >= 0`` else ``max(log w_t, -clip_low)``: every sequence is damped by ``geomean(gamma) <= 1``.

    Two departures from the formula as the survey article we followed writes it
    (https://ydnyshhh.github.io/posts/policy_optimization), ``[prod_t (W_t * gamma_t)]^(s / |o_i|)``:

    * ``gamma`` takes no sign exponent. Under it a negative-advantage sequence would be scaled by
      ``geomean(gamma)^-1 >= 1``, pushed harder the more its routing drifted, while the same article says three times
      what ``gamma`` is for: it "down-weights tokens whose routing changed too much", is "a routing-drift penalty:
      the more the router changed for token t, the less RSPO lets that token push the policy update", and acts
      "only as a sample weight". We follow that: the weight damps both signs.
    * The article writes ``clip(w_t^s, eps_1, eps_2)``, clipping the ratio after the sign power; then ``eps_1`` never
      binds (``min(x, clip(x, a, b)) = min(x, b)``) and ``eps_2`` bounds both sides, so a negative-advantage
      token's ratio would be floored at ``1/eps_2``. We clip ``w_t`` itself, as GMPO does (the article's GMPO section,
      and RSPO keeps GMPO's token clipping): ``clip_low`` bounds how far a ratio may fall (negative advantages),
      ``clip_high`` how far it may rise (positive ones).

    Inputs beyond the log-probs: ``router_logp`` and ``old_router_logp``, ``[L, B, T, E]`` log routing
    probabilities at the completion's positions (see ``router_logprobs``).

    Args:
        top_k: experts per token the model routes to (its ``num_experts_per_tok``).
        gamma_min: floor on ``gamma`` (our default; the sources we read give no value).
        clip_low, clip_high: GMPO's log-space token clip.
    """

    requires: ClassVar[frozenset[str]] = frozenset({"router_logp", "old_router_logp"})

    def __init__(self, *, top_k: int = 2, gamma_min: float = 0.5, clip_low: float = 0.4, clip_high: float = 0.4):
        super().__init__(clip_low=clip_low, clip_high=clip_high)
        if top_k < 1:
            raise ValueError(f"top_k={top_k} must be >= 1 (the model's num_experts_per_tok).")
        if not 0 < gamma_min <= 1:
            raise ValueError(f"gamma_min={gamma_min} must be in (0, 1].")
        self.top_k, self.gamma_min = top_k, gamma_min

    def __call__(
        self, logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, router_logp: Tensor, old_router_logp: Tensor
    ) -> tuple[Tensor, Metrics]:
        if router_logp.shape[1:3] != logp.shape:
            raise ValueError(
                f"router_logp has shape {tuple(router_logp.shape)}; expected [layers, {logp.shape[0]}, "
                f"{logp.shape[1]}, experts] to match logp."
            )
        log_ratio = token_log_ratio(logp, old_logp, mask)
        seq_adv = sequence_mean(adv, mask)  # [B]
        clipped = self.clipped_log_ratio(log_ratio, seq_adv)  # [B, T]
        gamma = router_shift_weight(router_logp, old_router_logp, self.top_k, self.gamma_min)  # [B, T]
        log_score = sequence_mean(clipped, mask) + sequence_mean(gamma.log(), mask)  # [B]
        score = seq_adv * log_score.exp()
        metrics = self.clip_metrics(log_ratio, seq_adv, mask)
        metrics.update({f"router_shift/{key}": value for key, value in masked_stats(gamma, mask).items()})
        return masked_loss(-score[:, None].expand_as(logp), mask), metrics
