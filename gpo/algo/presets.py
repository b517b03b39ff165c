"""Algorithm presets: each a named bundle of an advantage estimator, a ratio gate and a loss aggregator.

A preset takes the settings its paper gives it (under seed 000's names where it has one) as typed arguments of its
own, builds its parts from them, and refuses the combinations the papers rule out with a message that says what to
change. There is no shared bag of settings: a preset has only the arguments it reads. ``Custom`` composes any three
parts freely. In YAML a preset is chosen by class (``algorithm: DAPO``, with ``init_args`` to change its settings) or
by the seed's lowercase name for its defaults (``algorithm: dapo``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

from gpo.algo.advantages import (
    AdvantageEstimator,
    BatchWhitenedAdvantage,
    GroupNormAdvantage,
    LeaveOneOutAdvantage,
)
from gpo.algo.aggregators import ConstantNorm, LossAggregator, SequenceMean, TokenMean
from gpo.algo.gates import (
    CISPOGate,
    ClipGate,
    GeometricMeanGate,
    NoGate,
    RatioGate,
    RouterShiftGate,
    SequenceClipGate,
    SoftGate,
)

AdvantageNorm = Literal["group", "batch"]
LossAggMode = Literal["token_mean", "token_sum_norm"]


@dataclass(frozen=True)
class Parts:
    """The three loss parts of an algorithm."""

    advantage: AdvantageEstimator
    gate: RatioGate
    aggregator: LossAggregator


class Algorithm(ABC):
    """An algorithm: the parts it trains with, built for the engine's completion budget."""

    @abstractmethod
    def parts(self, max_new_tokens: int | None = None) -> Parts:
        """The advantage estimator, ratio gate and loss aggregator; ``max_new_tokens`` is the generation budget
        (read by aggregators that normalise by it)."""


class Custom(Algorithm):
    """Any advantage estimator, ratio gate and loss aggregator, combined without a preset's rules.

    Args:
        advantage: how good each completion is relative to its group (default: group mean / std).
        gate: how far the importance ratio is trusted (default: none, the plain policy gradient).
        aggregator: how token terms are averaged (default: mean over sequences of token means).
    """

    def __init__(
        self,
        *,
        advantage: AdvantageEstimator | None = None,
        gate: RatioGate | None = None,
        aggregator: LossAggregator | None = None,
    ) -> None:
        self._parts = Parts(advantage or GroupNormAdvantage(), gate or NoGate(), aggregator or SequenceMean())

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        return self._parts


@dataclass(frozen=True)
class PPOClip:
    """PPO ratio clipping layered on a preset of the policy-gradient family (GRPO, RLOO, REINFORCE++, Dr. GRPO):
    seed 000's ``use_ppo_clip`` with its ``clip_low`` / ``clip_high``, recommended with several updates per rollout.

    Args:
        clip_low: lower clip distance (ratio >= 1 - clip_low).
        clip_high: upper clip distance (ratio <= 1 + clip_high).
        dual_clip: dual-clip constant (> 1) for negative advantages, or None.
    """

    clip_low: float = 0.4
    clip_high: float = 0.5
    dual_clip: float | None = None

    def gate(self) -> ClipGate:
        return ClipGate(clip_low=self.clip_low, clip_high=self.clip_high, dual_clip=self.dual_clip)


def _gate(ppo_clip: PPOClip | None) -> RatioGate:
    """The policy-gradient family's gate: none (the plain policy gradient), or PPO clipping when asked."""
    return NoGate() if ppo_clip is None else ppo_clip.gate()


class GRPO(Algorithm):
    """GRPO (DeepSeekMath, Shao et al. 2024): group mean / std advantages, plain policy gradient, mean over
    sequences of token means. Seed 000's default algorithm.

    Args:
        advantage_norm: divide the centred reward by the ``group``'s std or the whole ``batch``'s.
        ppo_clip: layer PPO ratio clipping on the gradient (``ppo_clip: {}`` for seed 000's 0.4 / 0.5).
    """

    def __init__(self, *, advantage_norm: AdvantageNorm = "group", ppo_clip: PPOClip | None = None) -> None:
        self.advantage, self.gate = GroupNormAdvantage(scale=_check_norm(advantage_norm)), _gate(ppo_clip)

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        return Parts(self.advantage, self.gate, SequenceMean())


class RLOO(Algorithm):
    """RLOO (Ahmadian et al. 2024): leave-one-out baseline, ``n / (n - 1)`` x the mean-centred reward. Its baseline
    is a group statistic, so there is no batch normalisation (seed 000 refuses it; use ``ReinforcePP`` for that).

    Args:
        ppo_clip: layer PPO ratio clipping on the gradient.
    """

    def __init__(self, *, ppo_clip: PPOClip | None = None) -> None:
        self.gate = _gate(ppo_clip)

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        return Parts(LeaveOneOutAdvantage(), self.gate, SequenceMean())


class ReinforcePP(Algorithm):
    """REINFORCE++ (Hu et al. 2025): group mean subtracted, then whitened over the whole batch (batch
    normalisation is part of the method, so there is no setting for it).

    Args:
        ppo_clip: layer PPO ratio clipping on the gradient.
    """

    def __init__(self, *, ppo_clip: PPOClip | None = None) -> None:
        self.gate = _gate(ppo_clip)

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        return Parts(BatchWhitenedAdvantage(), self.gate, SequenceMean())


class DrGRPO(Algorithm):
    """Dr. GRPO (Liu et al. 2025): mean-centred advantages (no std), and no length normalisation with
    ``token_sum_norm``: the token sum divided by ``samples x max_completion_length``.

    Args:
        loss_agg_mode: ``token_mean`` (mean over the step's tokens) or ``token_sum_norm``.
        max_completion_length: the constant of ``token_sum_norm``; None: the engine's ``max_new_tokens``.
        ppo_clip: layer PPO ratio clipping on the gradient.
    """

    def __init__(
        self,
        *,
        loss_agg_mode: LossAggMode = "token_mean",
        max_completion_length: int | None = None,
        ppo_clip: PPOClip | None = None,
    ) -> None:
        if loss_agg_mode not in ("token_mean", "token_sum_norm"):
            raise ValueError(
                f"DrGRPO: loss_agg_mode={loss_agg_mode!r} is not valid; choose 'token_mean' or 'token_sum_norm'."
            )
        if max_completion_length is not None and loss_agg_mode != "token_sum_norm":
            raise ValueError(
                f"DrGRPO: max_completion_length={max_completion_length} is read only with loss_agg_mode: "
                "token_sum_norm; set that, or remove max_completion_length."
            )
        self.loss_agg_mode, self.max_completion_length, self.gate = (
            loss_agg_mode,
            max_completion_length,
            _gate(ppo_clip),
        )

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        aggregator: LossAggregator = TokenMean()
        if self.loss_agg_mode == "token_sum_norm":
            length = self.max_completion_length or max_new_tokens
            if length is None:
                raise ValueError(
                    "DrGRPO: loss_agg_mode 'token_sum_norm' divides by num_samples x max_completion_length; set "
                    "max_completion_length (the generation budget in tokens)."
                )
            aggregator = ConstantNorm(max_length=length)
        return Parts(GroupNormAdvantage(scale="none"), self.gate, aggregator)


class DAPO(Algorithm):
    """DAPO (Yu et al. 2025): PPO clipping with a higher upper bound (clip-higher) and a token-mean loss. Its other
    parts are separate: dynamic sampling (``gpo.callbacks.DynamicSampling``), overlong filtering
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
        self.advantage = GroupNormAdvantage(scale=_check_norm(advantage_norm))

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        return Parts(self.advantage, self.gate, TokenMean())


class CISPO(Algorithm):
    """CISPO (MiniMax-M1, 2025): the importance weight clamped to ``[1 - clip_low, 1 + clip_high]`` and detached,
    times the log-probability gradient, token-mean loss: no token is ever dropped. It handles the ratio itself, so
    there is no PPO clipping to layer on it.

    Args:
        clip_low: lower clamp distance.
        clip_high: upper clamp distance.
        advantage_norm: divide the centred reward by the ``group``'s std or the whole ``batch``'s.
    """

    def __init__(
        self, *, clip_low: float = 0.4, clip_high: float = 0.5, advantage_norm: AdvantageNorm = "group"
    ) -> None:
        self.gate = CISPOGate(clip_low=clip_low, clip_high=clip_high)
        self.advantage = GroupNormAdvantage(scale=_check_norm(advantage_norm))

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        return Parts(self.advantage, self.gate, TokenMean())


class GSPO(Algorithm):
    """GSPO (Zheng et al. 2025): the length-normalised sequence ratio, clipped; sequence-mean loss. The paper used
    clip distances of 3e-4 / 4e-4; seed 000's defaults are 0.4 / 0.5.

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
        self.advantage = GroupNormAdvantage(scale=_check_norm(advantage_norm))

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        return Parts(self.advantage, self.gate, SequenceMean())


class SAPO(Algorithm):
    """SAPO (Gao et al. 2025): a sigmoid soft gate on the ratio instead of a hard clip, sharper for negative
    advantages; sequence-mean loss.

    Args:
        tau_pos: gate temperature for positive advantages (seed 000's ``sapo_tau_pos``).
        tau_neg: gate temperature for negative advantages (seed 000's ``sapo_tau_neg``).
        advantage_norm: divide the centred reward by the ``group``'s std or the whole ``batch``'s.
    """

    def __init__(self, *, tau_pos: float = 1.0, tau_neg: float = 1.05, advantage_norm: AdvantageNorm = "group") -> None:
        self.gate = SoftGate(tau_pos=tau_pos, tau_neg=tau_neg)
        self.advantage = GroupNormAdvantage(scale=_check_norm(advantage_norm))

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
        self.advantage = GroupNormAdvantage(scale=_check_norm(advantage_norm))

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        return Parts(self.advantage, self.gate, SequenceMean())


class RSPO(Algorithm):
    """RSPO (Zhang et al. 2025): GMPO times a router-shift weight, for mixture-of-experts policies; the trainer
    computes the router log-probs the gate needs.

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
        self.advantage = GroupNormAdvantage(scale=_check_norm(advantage_norm))

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        return Parts(self.advantage, self.gate, SequenceMean())


#: The presets by seed 000's lowercase name, each with its defaults.
ALGORITHMS: dict[str, type[Algorithm]] = {
    "grpo": GRPO,
    "rloo": RLOO,
    "reinforce_pp": ReinforcePP,
    "dr_grpo": DrGRPO,
    "dapo": DAPO,
    "cispo": CISPO,
    "gspo": GSPO,
    "sapo": SAPO,
    "gmpo": GMPO,
    "rspo": RSPO,
}


def preset(algorithm: Algorithm | str) -> Algorithm:
    """``algorithm`` itself, or the preset of that lowercase name with its defaults."""
    if isinstance(algorithm, Algorithm):
        return algorithm
    if algorithm not in ALGORITHMS:
        classes = ", ".join(cls.__name__ for cls in ALGORITHMS.values())
        raise ValueError(
            f"model.algorithm={algorithm!r} is not known; choose one of {', '.join(ALGORITHMS)} (the presets with "
            f"their defaults), a preset class ({classes}) to change its settings, or Custom to combine parts."
        )
    return ALGORITHMS[algorithm]()


def _check_norm(advantage_norm: str) -> Literal["group", "batch"]:
    if advantage_norm not in ("group", "batch"):
        raise ValueError(f"advantage_norm={advantage_norm!r} is not valid; choose 'group' or 'batch'.")
    return advantage_norm
