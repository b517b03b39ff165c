"""Token masks: which tokens the policy-gradient surrogate trains on, for stale, mismatched or uninformative tokens."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import Tensor

from gpo.algo.gates.base import Metrics, fraction
from gpo.algo.masked import masked_mean, sequence_mean
from gpo.algo.state import PartState

#: Inputs a mask may read that exist only in a gradient pass: reading one makes it a per-update mask.
PASS_INPUTS = frozenset({"logp", "old_logp", "entropy"})


class TokenMask(PartState, ABC):
    """Keeps or drops tokens: ``keep[B, T]`` (bool, no gradient, False outside the mask given).

    A mask reads, by keyword, the ``[B, T]`` inputs it names in ``requires``:

    - in each gradient pass only: ``logp`` (the current policy), ``entropy`` (its token entropy), ``old_logp``;
    - fixed for the step: ``adv``, ``rollout_logp`` (the engine's log-probs of the sampled tokens) and
      ``train_logp`` (the trainer's log-probs of the same tokens before the step's first update).

    A mask that reads a gradient-pass input (``per_update``) is applied in every pass to the surrogate only: its
    tokens give the ratio gate nothing, but stay in the loss normaliser (fixed before the passes begin) and in the
    KL and entropy terms, like a clipped token (TRL's off-policy and entropy masks). A mask that reads only step
    inputs is applied once per step to the loss mask itself: its tokens leave the whole loss and its normaliser,
    like ``OverlongFilter``'s (AReaL's M2PO mask). Several masks apply in order, each to what the previous kept.
    """

    requires: ClassVar[frozenset[str]] = frozenset()

    @property
    def per_update(self) -> bool:
        """Whether the mask reads the current policy, so must be recomputed in each gradient pass."""
        return bool(self.requires & PASS_INPUTS)

    @abstractmethod
    def __call__(self, mask: Tensor, **inputs: Tensor) -> tuple[Tensor, Metrics]:
        """``mask[B, T]`` and the inputs in ``requires`` -> ``(keep[B, T] bool, metrics)``."""


class OffPolicySequenceMask(TokenMask):
    """DeepSeek-V3.2's off-policy sequence mask for negative-advantage completions.

    It drops the negative-advantage tokens of completions the current
    policy has moved far away from (TRL's ``off_policy_mask_threshold``).

    ``M_{i,t} = 0`` if ``A_{i,t} < 0`` and ``(1/|o_i|) sum_t log(pi_old(o_t) / pi(o_t)) > threshold``, else 1: the
    sequence mean of the sampled-token (k1) estimate of ``KL(pi_old || pi)``, from the current ``logp`` in each
    gradient pass. Positive-advantage completions are never masked. ``pi_old`` is ``old_logp``: the paper takes the
    inference engine's sampling probabilities so the mask sees both staleness and engine-vs-trainer mismatch,
    which in gpo means ``old_logprobs: rollout``.

    Args:
        threshold: the paper's ``delta`` on the mean log-ratio (no default; TRL's docs give 0.5 as an example).
    """

    requires = frozenset({"logp", "old_logp", "adv"})

    def __init__(self, *, threshold: float) -> None:
        if not threshold > 0:
            raise ValueError(f"threshold={threshold} must be > 0 (a mean log-ratio, e.g. 0.5).")
        self.threshold = threshold

    def __call__(self, mask: Tensor, *, logp: Tensor, old_logp: Tensor, adv: Tensor) -> tuple[Tensor, Metrics]:
        with torch.no_grad():
            on = mask.bool()
            log_ratio = torch.where(on, old_logp - logp, 0.0)  # [B, T], log(pi_old / pi)
            seq_kl = sequence_mean(log_ratio, mask)  # [B]
            dropped = on & (adv < 0) & (seq_kl > self.threshold)[:, None]  # [B, T]
            metrics = {
                "mask/off_policy_frac": fraction(dropped, mask),
                "mask/off_policy_kl_mean": masked_mean(seq_kl, on.any(-1)),
            }
            return on & ~dropped, metrics


class SecondMomentMask(TokenMask):
    """M2PO (Zheng et al. 2025): the most extreme tokens masked until the log-ratio's second moment is bounded.

    AReaL calls it ``m2_threshold``. The tokens dropped are those with the most extreme log-ratio until
    the second moment of the log-ratio over the kept tokens is at most ``bound``.

    With ``d_t = log pi_train(o_t) - log pi_rollout(o_t)`` over the step's real tokens, sorted by ``d_t^2``
    descending, the fewest leading tokens are dropped such that ``mean_{kept} d_t^2 <= bound``; outliers go,
    moderate off-policy tokens stay. As in AReaL, ``pi_train`` is the trainer's policy at the start of the step
    (its proximal policy) and ``pi_rollout`` the behaviour policy, so the mask is fixed for the step and its
    tokens leave the normaliser. The moment is over this process's rows of the step. Ties at the cut are broken
    by position. Departures from AReaL: the bound is inclusive (AReaL stops at a mean strictly below it), and
    when even the smallest ``d_t^2`` exceeds the bound every token is dropped (AReaL keeps the smallest one).

    Args:
        bound: ``tau_M2``, the largest second moment kept (AReaL's example config: 0.04).
    """

    requires = frozenset({"train_logp", "rollout_logp"})

    def __init__(self, *, bound: float = 0.04) -> None:
        if not bound > 0:
            raise ValueError(f"bound={bound} must be > 0 (AReaL's M2PO example uses 0.04).")
        self.bound = bound

    def __call__(self, mask: Tensor, *, train_logp: Tensor, rollout_logp: Tensor) -> tuple[Tensor, Metrics]:
        with torch.no_grad():
            on = mask.bool()
            squared = (train_logp.double() - rollout_logp.double())[on] ** 2  # [N], the real tokens in row order
            order = squared.argsort(descending=True, stable=True)  # [N]
            ranked = squared[order]  # [N], largest first
            count = torch.arange(len(ranked), 0, -1, dtype=ranked.dtype, device=ranked.device)  # [N]: left after k
            rest_mean = ranked.flip(0).cumsum(0).flip(0) / count  # [N]: mean of ranked[k:]
            within = (rest_mean <= self.bound).nonzero()
            cut = int(within[0]) if len(within) else len(ranked)
            kept = torch.ones_like(squared, dtype=torch.bool)  # [N]
            kept[order[:cut]] = False
            keep = on.clone()  # [B, T]
            keep[on] = kept
            zero = squared.new_zeros(())
            metrics = {
                "mask/m2_frac": fraction(on & ~keep, mask),
                "mask/m2": squared.mean() if len(squared) else zero,
                "mask/m2_kept": squared[kept].mean() if kept.any() else zero,
            }
            return keep, {key: value.float() for key, value in metrics.items()}


class MismatchBandMask(TokenMask):
    """IcePop's mask: tokens whose engine-vs-trainer ratio leaves a band are left out of the loss.

    The masking is two-sided (Ring-1T, arXiv 2510.18855): a token is kept only
    if the trainer and the engine roughly agree on it.

    ``k_t = pi_train(o_t) / pi_rollout(o_t)`` (the trainer's policy before the step's first update over the
    engine's); the token is kept iff ``low <= k_t <= high``. IcePop's weight is ``M(k) = k 1[low <= k <= high]``:
    this part is the indicator; the factor ``k`` inside the band is ``RolloutCorrection(mode="tis",
    level="token", cap=high)``, whose cap never binds on a kept token. Fixed for the step, so the dropped tokens
    leave the normaliser. The band ``[0.5, 5]`` is IcePop's as TRL's tests label it (TRL's ``clip_min`` /
    ``clip_max`` of its ``token_mask`` mode).

    Args:
        low: smallest ratio kept (IcePop's ``alpha``), in ``(0, 1]``.
        high: largest ratio kept (IcePop's ``beta``), at least 1.
    """

    requires = frozenset({"train_logp", "rollout_logp"})

    def __init__(self, *, low: float = 0.5, high: float = 5.0) -> None:
        if not 0 < low <= 1 <= high:
            raise ValueError(f"low={low}, high={high} must satisfy 0 < low <= 1 <= high (IcePop: 0.5 and 5).")
        self.low, self.high = low, high

    def __call__(self, mask: Tensor, *, train_logp: Tensor, rollout_logp: Tensor) -> tuple[Tensor, Metrics]:
        with torch.no_grad():
            on = mask.bool()
            ratio = torch.where(on, train_logp - rollout_logp, 0.0).exp()  # [B, T]
            inside = (ratio >= self.low) & (ratio <= self.high)  # [B, T]
            return on & inside, {"mask/mismatch_frac": fraction(on & ~inside, mask)}


class HighEntropyMask(TokenMask):
    """Train only on the highest-entropy tokens ("Beyond the 80/20 rule", Wang et al. 2025).

    TRL calls it ``top_entropy_quantile``. The tokens kept are the forks of a reasoning path, where the policy is
    undecided.

    ``keep_t = H_t >= q``, ``q`` the ``(1 - quantile)``-quantile (linear interpolation, ``torch.quantile``) of the
    token entropies ``H`` over the real tokens of the micro-batch on this process (TRL: the micro-batch, gathered
    over processes). So ``quantile=0.2`` keeps the top 20%, 1 keeps every token, 0 only the most uncertain ones.
    The entropy is the current policy's, from the gradient pass, so the mask is per update: the dropped tokens
    still count in the normaliser and in the KL and entropy terms (TRL also limits its entropy bonus to them).
    As the quantile is over the micro-batch, the micro-batch size changes which tokens are kept.

    Args:
        quantile: fraction of the tokens kept, in ``[0, 1]`` (the paper's ``rho``: 0.2).
    """

    requires = frozenset({"entropy"})

    def __init__(self, *, quantile: float = 0.2) -> None:
        if not 0 <= quantile <= 1:
            raise ValueError(
                f"quantile={quantile} must be in [0, 1] (the fraction of tokens kept; the paper uses 0.2)."
            )
        self.quantile = quantile

    def __call__(self, mask: Tensor, *, entropy: Tensor) -> tuple[Tensor, Metrics]:
        with torch.no_grad():
            on = mask.bool()
            entropy = entropy.to(torch.promote_types(entropy.dtype, torch.float32))  # torch.quantile: float, double
            values = entropy[on]  # [N]
            if not len(values):
                zero = values.new_zeros(())
                return on, {"mask/entropy_threshold": zero, "mask/entropy_kept_frac": zero}
            threshold = torch.quantile(values, 1 - self.quantile)  # []
            keep = on & (entropy >= threshold)  # [B, T]
            return keep, {"mask/entropy_threshold": threshold, "mask/entropy_kept_frac": fraction(keep, mask)}
