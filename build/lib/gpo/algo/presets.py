"""Algorithm presets: named bundles of an advantage estimator, a ratio gate and a loss aggregator.

A preset is only a choice of parts with its defaults, plus the place where combinations the papers rule
out are refused with a message that says what to change. Knob names follow the flat configs users know
(``advantage_norm``, ``use_ppo_clip``, ``clip_low``/``clip_high``, ``dr_grpo_loss_agg_mode``, ...).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from gpo.algo.advantages import (
    AdvantageEstimator,
    BatchWhitenedAdvantage,
    GroupNormAdvantage,
    LeaveOneOutAdvantage,
)
from gpo.algo.aggregators import ConstantNorm, LossAggregator, SequenceMean, TokenMean
from gpo.algo.gates import CISPOGate, ClipGate, GeometricMeanGate, NoGate, RatioGate, SequenceClipGate, SoftGate
from gpo.algo.gates.router import RouterShiftGate

log = logging.getLogger(__name__)

ALGORITHMS: tuple[str, ...] = (
    "grpo",
    "rloo",
    "reinforce_pp",
    "dr_grpo",
    "dapo",
    "cispo",
    "gspo",
    "sapo",
    "gmpo",
    "rspo",
)
PPO_CLIP_COMPATIBLE: tuple[str, ...] = ("grpo", "rloo", "reinforce_pp", "dr_grpo")
OWN_RATIO_HANDLING: tuple[str, ...] = ("cispo", "gspo", "sapo", "gmpo", "rspo")

AdvantageNorm = Literal["group", "batch"]


@dataclass(frozen=True)
class Algorithm:
    """The three loss parts of one algorithm."""

    name: str
    advantage: AdvantageEstimator
    gate: RatioGate
    aggregator: LossAggregator


@dataclass(frozen=True)
class AlgorithmKnobs:
    """The flat knobs a preset reads. Defaults follow the seed configs where they give one.

    Args:
        group_size: completions per prompt (>= 2: a group of one has no baseline).
        advantage_norm: ``group`` or ``batch`` std for GRPO-style advantages; ``rloo`` allows only ``group``;
            ``reinforce_pp`` always uses ``batch``. None means the preset's default.
        use_ppo_clip: layer PPO ratio clipping on ``grpo``, ``rloo``, ``reinforce_pp`` or ``dr_grpo`` (``dapo``
            always clips; ``cispo``, ``gspo``, ``sapo``, ``gmpo`` and ``rspo`` refuse it).
        clip_low: lower clip distance (ratio >= 1 - clip_low). None means the preset's default.
        clip_high: upper clip distance (ratio <= 1 + clip_high). None means the preset's default.
        dual_clip: dual-clip constant for PPO clipping (> 1), or None.
        dr_grpo_loss_agg_mode: ``token_mean`` or ``token_sum_norm`` (divide by samples x max_completion_length).
        max_completion_length: generation budget; needed by ``token_sum_norm``.
        sapo_tau_pos: SAPO gate temperature for positive advantages.
        sapo_tau_neg: SAPO gate temperature for negative advantages.
        moe_top_k: experts per token, for RSPO's router-shift weight.
        rspo_gamma_min: floor of RSPO's router-shift weight.
    """

    group_size: int = 8
    advantage_norm: AdvantageNorm | None = None
    use_ppo_clip: bool = False
    clip_low: float | None = None
    clip_high: float | None = None
    dual_clip: float | None = None
    dr_grpo_loss_agg_mode: Literal["token_mean", "token_sum_norm"] = "token_mean"
    max_completion_length: int | None = None
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    moe_top_k: int = 2
    rspo_gamma_min: float = 0.5


def build_algorithm(name: str = "grpo", knobs: AlgorithmKnobs | None = None) -> Algorithm:
    """The parts of preset ``name`` configured by ``knobs``; raises ValueError on a refused combination, and on a
    knob set away from its default that the preset does not read."""
    k = knobs or AlgorithmKnobs()
    _validate(name, k)
    return Algorithm(name, _advantage(name, k), _gate(name, k), _aggregator(name, k))


def _validate(name: str, k: AlgorithmKnobs) -> None:
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm={name!r} is not known; choose one of {', '.join(ALGORITHMS)}.")
    if k.group_size < 2:
        raise ValueError(
            f"group_size={k.group_size}: group-relative advantages need at least 2 completions per prompt; "
            "set it to >= 2 (2 already works, 8 is the usual default)."
        )
    if k.advantage_norm not in (None, "group", "batch"):
        raise ValueError(f"advantage_norm={k.advantage_norm!r} is not valid; choose 'group' or 'batch'.")
    if name == "rloo" and k.advantage_norm == "batch":
        raise ValueError(
            "algorithm='rloo' needs per-group normalisation: its leave-one-out baseline is a group statistic. "
            "Set advantage_norm='group' (or leave it unset), or use algorithm='reinforce_pp' for batch norm."
        )
    if k.use_ppo_clip and name in OWN_RATIO_HANDLING:
        raise ValueError(
            f"use_ppo_clip=True is not compatible with algorithm={name!r}, which has its own ratio handling. "
            f"Remove use_ppo_clip (tune clip_low/clip_high instead), or layer PPO clipping on one of "
            f"{', '.join(PPO_CLIP_COMPATIBLE)}."
        )
    unused = _unused_knobs(name, k)
    if unused:
        knob, readers = unused[0]
        raise ValueError(
            f"{knob}={getattr(k, knob)!r} has no effect with algorithm={name!r}; it is read by {readers}. "
            f"Remove {knob}, or choose an algorithm that reads it."
        )
    if k.dr_grpo_loss_agg_mode not in ("token_mean", "token_sum_norm"):
        raise ValueError(
            f"dr_grpo_loss_agg_mode={k.dr_grpo_loss_agg_mode!r} is not valid; choose 'token_mean' or 'token_sum_norm'."
        )
    if name == "dr_grpo" and k.dr_grpo_loss_agg_mode == "token_sum_norm" and k.max_completion_length is None:
        raise ValueError(
            "dr_grpo_loss_agg_mode='token_sum_norm' divides by num_samples x max_completion_length; "
            "set max_completion_length (the generation budget in tokens)."
        )


def _unused_knobs(name: str, k: AlgorithmKnobs) -> list[tuple[str, str]]:
    """Knobs set away from their default that preset ``name`` never reads (a setting that silently does
    nothing), each with the presets that do read it."""
    ppo_clip = name == "dapo" or (name in PPO_CLIP_COMPATIBLE and k.use_ppo_clip)
    clip_range = ppo_clip or name in ("cispo", "gspo", "gmpo", "rspo")
    with_ppo_clip = f"use_ppo_clip=True on {', '.join(PPO_CLIP_COMPATIBLE)}"
    clip_readers = f"dapo, cispo, gspo, gmpo, rspo, or {with_ppo_clip}"
    readers = {  # knob: (read by this preset, who reads it)
        "advantage_norm": (name != "dr_grpo", "every preset but dr_grpo (which divides by no std)"),
        "clip_low": (clip_range, clip_readers),
        "clip_high": (clip_range, clip_readers),
        "dual_clip": (ppo_clip, f"dapo, or {with_ppo_clip}"),
        "dr_grpo_loss_agg_mode": (name == "dr_grpo", "dr_grpo"),
        "sapo_tau_pos": (name == "sapo", "sapo"),
        "sapo_tau_neg": (name == "sapo", "sapo"),
        "moe_top_k": (name == "rspo", "rspo"),
        "rspo_gamma_min": (name == "rspo", "rspo"),
    }
    default = AlgorithmKnobs()
    return [
        (knob, who) for knob, (read, who) in readers.items() if not read and getattr(k, knob) != getattr(default, knob)
    ]


def _advantage(name: str, k: AlgorithmKnobs) -> AdvantageEstimator:
    if name == "rloo":
        return LeaveOneOutAdvantage()
    if name == "reinforce_pp":
        if k.advantage_norm == "group":
            log.warning("algorithm='reinforce_pp' requires batch-level normalisation; advantage_norm set to 'batch'.")
        return BatchWhitenedAdvantage()
    if name == "dr_grpo":
        return GroupNormAdvantage(scale="none")
    return GroupNormAdvantage(scale=k.advantage_norm or "group")


def _clip(k: AlgorithmKnobs, low: float, high: float) -> tuple[float, float]:
    return (low if k.clip_low is None else k.clip_low, high if k.clip_high is None else k.clip_high)


def _gate(name: str, k: AlgorithmKnobs) -> RatioGate:
    if name in PPO_CLIP_COMPATIBLE:
        if not k.use_ppo_clip:
            return NoGate()
        low, high = _clip(k, 0.4, 0.5)
        return ClipGate(clip_low=low, clip_high=high, dual_clip=k.dual_clip)
    if name == "dapo":
        low, high = _clip(k, 0.2, 0.28)
        return ClipGate(clip_low=low, clip_high=high, dual_clip=k.dual_clip)
    if name == "cispo":
        low, high = _clip(k, 0.4, 0.5)
        return CISPOGate(clip_low=low, clip_high=high)
    if name == "gspo":
        low, high = _clip(k, 0.4, 0.5)
        return SequenceClipGate(clip_low=low, clip_high=high)
    if name == "sapo":
        return SoftGate(tau_pos=k.sapo_tau_pos, tau_neg=k.sapo_tau_neg)
    low, high = _clip(k, 0.4, 0.4)
    if name == "gmpo":
        return GeometricMeanGate(clip_low=low, clip_high=high)
    return RouterShiftGate(top_k=k.moe_top_k, gamma_min=k.rspo_gamma_min, clip_low=low, clip_high=high)


def _aggregator(name: str, k: AlgorithmKnobs) -> LossAggregator:
    if name == "dr_grpo":
        if k.dr_grpo_loss_agg_mode == "token_sum_norm":
            return ConstantNorm(max_length=k.max_completion_length)
        return TokenMean()
    if name in ("dapo", "cispo"):
        return TokenMean()
    return SequenceMean()
