"""Presets that bound how far an update strays from the sampling policy: clipped, soft or sequence-level ratios,
divergence masks and quadratic penalties."""

from __future__ import annotations

from gpo.algo.advantages import GroupNormAdvantage, RankAdvantage
from gpo.algo.aggregators import SequenceMean, TokenMean
from gpo.algo.gates import (
    CISPOGate,
    ClipGate,
    DivergenceMaskGate,
    DROGate,
    GeometricMeanGate,
    RouterShiftGate,
    SequenceClipGate,
    SoftGate,
    VESPOGate,
)
from gpo.algo.gates.divergence import DivergenceMode
from gpo.algo.presets.base import AdvantageNorm, Algorithm, Parts, check_norm


class DAPO(Algorithm):
    """DAPO (Yu et al. 2025): PPO clipping with a higher upper bound (clip-higher) and a token-mean loss.

    Its other parts are separate: dynamic sampling (``gpo.callbacks.DynamicSampling``), overlong filtering
    (``gpo.algo.OverlongFilter`` in ``token_weights``) and soft overlong punishment (a reward function,
    ``gpo.rewards.SoftOverlongPunishment``).

    Args:
        clip_low: lower clip distance (ratio >= 1 - clip_low).
        clip_high: upper clip distance (ratio <= 1 + clip_high), above ``clip_low`` in the paper.
        dual_clip: dual-clip constant (> 1) for negative advantages, or None.
        advantage_norm: divide the centred reward by the ``group``'s std or the whole ``batch``'s.
    """

    def __init__(
        self,
        *,
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        dual_clip: float | None = None,
        advantage_norm: AdvantageNorm = "group",
    ) -> None:
        self.gate = ClipGate(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
        self.advantage = GroupNormAdvantage(scale=check_norm(advantage_norm))

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        return Parts(self.advantage, self.gate, TokenMean())


class CISPO(Algorithm):
    """CISPO (MiniMax-M1, 2025): a clamped, detached importance weight times the log-probability gradient.

    The weight is clamped to ``[1 - clip_low, 1 + clip_high]``; token-mean loss: no token is ever dropped. It
    handles the ratio itself, so there is no PPO clipping to layer on it.

    Args:
        clip_low: lower clamp distance.
        clip_high: upper clamp distance.
        advantage_norm: divide the centred reward by the ``group``'s std or the whole ``batch``'s.
    """

    def __init__(
        self, *, clip_low: float = 0.4, clip_high: float = 0.5, advantage_norm: AdvantageNorm = "group"
    ) -> None:
        self.gate = CISPOGate(clip_low=clip_low, clip_high=clip_high)
        self.advantage = GroupNormAdvantage(scale=check_norm(advantage_norm))

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        return Parts(self.advantage, self.gate, TokenMean())


class GSPO(Algorithm):
    """GSPO (Zheng et al. 2025): the length-normalised sequence ratio, clipped; sequence-mean loss.

    The paper used clip distances of 3e-4 / 4e-4; the defaults here are 0.4 / 0.5, those of flat GRPO configs.

    Args:
        clip_low: lower clip distance of the sequence ratio.
        clip_high: upper clip distance of the sequence ratio.
        per_token_advantage: GSPO-token: the sequence ratio's value with per-token advantages (needs them, e.g.
            multi-turn step rewards).
        advantage_norm: divide the centred reward by the ``group``'s std or the whole ``batch``'s.
    """

    def __init__(
        self,
        *,
        clip_low: float = 0.4,
        clip_high: float = 0.5,
        per_token_advantage: bool = False,
        advantage_norm: AdvantageNorm = "group",
    ) -> None:
        self.gate = SequenceClipGate(clip_low=clip_low, clip_high=clip_high, per_token_advantage=per_token_advantage)
        self.advantage = GroupNormAdvantage(scale=check_norm(advantage_norm))

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        return Parts(self.advantage, self.gate, SequenceMean())


class SAPO(Algorithm):
    """SAPO (Gao et al. 2025): a sigmoid soft gate on the ratio instead of a hard clip; sequence-mean loss.

    The gate is sharper for negative advantages.

    Args:
        tau_pos: gate temperature for positive advantages (``sapo_tau_pos`` in flat GRPO configs).
        tau_neg: gate temperature for negative advantages (``sapo_tau_neg`` in flat GRPO configs).
        advantage_norm: divide the centred reward by the ``group``'s std or the whole ``batch``'s.
    """

    def __init__(self, *, tau_pos: float = 1.0, tau_neg: float = 1.05, advantage_norm: AdvantageNorm = "group") -> None:
        self.gate = SoftGate(tau_pos=tau_pos, tau_neg=tau_neg)
        self.advantage = GroupNormAdvantage(scale=check_norm(advantage_norm))

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        return Parts(self.advantage, self.gate, SequenceMean())


class GMPO(Algorithm):
    """GMPO (Zhao et al. 2025): the geometric mean of token ratios, each clipped in log space; sequence-mean loss.

    Args:
        clip_low: lower clip distance in log space.
        clip_high: upper clip distance in log space.
        advantage_norm: divide the centred reward by the ``group``'s std or the whole ``batch``'s.
    """

    def __init__(
        self, *, clip_low: float = 0.4, clip_high: float = 0.4, advantage_norm: AdvantageNorm = "group"
    ) -> None:
        self.gate = GeometricMeanGate(clip_low=clip_low, clip_high=clip_high)
        self.advantage = GroupNormAdvantage(scale=check_norm(advantage_norm))

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        return Parts(self.advantage, self.gate, SequenceMean())


class RSPO(Algorithm):
    """RSPO (Zhang et al. 2025): GMPO times a router-shift weight, for mixture-of-experts policies.

    The trainer computes the router log-probs the gate needs.

    Args:
        top_k: experts per token (the model's ``num_experts_per_tok``).
        gamma_min: floor of the router-shift weight.
        clip_low: lower clip distance in log space.
        clip_high: upper clip distance in log space.
        advantage_norm: divide the centred reward by the ``group``'s std or the whole ``batch``'s.
    """

    def __init__(
        self,
        *,
        top_k: int = 2,
        gamma_min: float = 0.5,
        clip_low: float = 0.4,
        clip_high: float = 0.4,
        advantage_norm: AdvantageNorm = "group",
    ) -> None:
        self.gate = RouterShiftGate(top_k=top_k, gamma_min=gamma_min, clip_low=clip_low, clip_high=clip_high)
        self.advantage = GroupNormAdvantage(scale=check_norm(advantage_norm))

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        return Parts(self.advantage, self.gate, SequenceMean())


class VESPO(Algorithm):
    """VESPO: a smooth weight of the sequence importance weight on the policy gradient.

    Shen et al. 2026, "VESPO: Variational Sequence-Level Soft Policy Optimization" (arXiv 2602.10693). The weight is
    ``W^k exp(lambda (1 - W))`` of the sequence importance weight ``W``; token-mean loss, as TRL's ``loss_type="vespo"``
    normalises it. Defaults are TRL's.

    Args:
        k_pos, lambda_pos: kernel shape and rate where the sequence advantage is >= 0.
        k_neg, lambda_neg: kernel shape and rate where it is < 0.
        advantage_norm: divide the centred reward by the ``group``'s std or the whole ``batch``'s.
    """

    def __init__(
        self,
        *,
        k_pos: float = 2.0,
        lambda_pos: float = 3.0,
        k_neg: float = 3.0,
        lambda_neg: float = 2.0,
        advantage_norm: AdvantageNorm = "group",
    ) -> None:
        self.gate = VESPOGate(k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg, lambda_neg=lambda_neg)
        self.advantage = GroupNormAdvantage(scale=check_norm(advantage_norm))

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        return Parts(self.advantage, self.gate, TokenMean())


class DPPO(Algorithm):
    """DPPO: a trust region on a divergence estimate between ``pi`` and ``pi_old`` instead of on the ratio.

    Divergence proximal policy optimisation: Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement
    Learning" (arXiv 2602.04879). The estimate is taken at each position (the paper's binary and top-k TV/KL
    approximations); token-mean loss (our choice; the sources we read give none).

    Args:
        mode: ``binary_tv``, ``binary_kl``, ``topk_tv`` or ``topk_kl``.
        threshold: the trust-region radius ``delta`` (no default: the sources we read give none).
        top_k: old-policy tokens with a bin of their own in the ``topk_*`` modes.
        advantage_norm: divide the centred reward by the ``group``'s std or the whole ``batch``'s.
    """

    def __init__(
        self,
        *,
        mode: DivergenceMode = "binary_tv",
        threshold: float,
        top_k: int = 20,
        advantage_norm: AdvantageNorm = "group",
    ) -> None:
        self.gate = DivergenceMaskGate(mode=mode, threshold=threshold, top_k=top_k)
        self.advantage = GroupNormAdvantage(scale=check_norm(advantage_norm))

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        return Parts(self.advantage, self.gate, TokenMean())


class GOPO(Algorithm):
    """GOPO (group ordinal policy optimisation): advantages from each completion's rank in its group.

    Choi et al. 2026, "GOPO: Policy Optimization using Ranked Rewards" (arXiv 2602.03876). The ranks are mapped linearly
    onto ``[-1, 1]``, under PPO's clipped objective; sequence-mean loss as GRPO.

    Args:
        clip_low: lower clip distance (ratio >= 1 - clip_low).
        clip_high: upper clip distance (ratio <= 1 + clip_high).
    """

    def __init__(self, *, clip_low: float = 0.2, clip_high: float = 0.2) -> None:
        self.gate = ClipGate(clip_low=clip_low, clip_high=clip_high)

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        return Parts(RankAdvantage(), self.gate, SequenceMean())


class DRO(Algorithm):
    """DRO (direct reward optimisation, Richemond et al. 2024): a quadratic pull towards the sampling policy.

    The per-token loss is ``-(A log pi - beta/2 (log pi - log pi_old)^2)``, instead of clipping; token-mean loss.

    Args:
        beta: weight of the quadratic penalty (no default).
        advantage_norm: divide the centred reward by the ``group``'s std or the whole ``batch``'s.
    """

    def __init__(self, *, beta: float, advantage_norm: AdvantageNorm = "group") -> None:
        self.gate = DROGate(beta=beta)
        self.advantage = GroupNormAdvantage(scale=check_norm(advantage_norm))

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        return Parts(self.advantage, self.gate, TokenMean())
