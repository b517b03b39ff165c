"""The preset contract: the parts an algorithm trains with, ``Custom`` to combine any, and PPO clipping as a layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

from gpo.algo.advantages import AdvantageEstimator, GroupNormAdvantage
from gpo.algo.aggregators import LossAggregator, SequenceMean
from gpo.algo.contracts import check_call, check_instance, check_requires
from gpo.algo.gates import ClipGate, NoGate, RatioGate

AdvantageNorm = Literal["group", "batch"]


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
        for slot, part in (("advantage", advantage), ("gate", gate), ("aggregator", aggregator)):
            if part is not None:
                check_part(slot, part)
        self._parts = Parts(advantage or GroupNormAdvantage(), gate or NoGate(), aggregator or SequenceMean())

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        return self._parts


#: Each slot of ``Custom``: the kind of part it takes and the arguments ``__call__`` is given by position.
SLOTS: dict[str, tuple[type, tuple[str, ...]]] = {
    "advantage": (AdvantageEstimator, ("reward[B]", "group[B]", "mask[B, T]")),
    "gate": (RatioGate, ("logp[B, T]", "old_logp[B, T]", "adv[B, T]", "mask[B, T]")),
    "aggregator": (LossAggregator, ("per_token_loss[B, T]", "mask[B, T]", "normaliser")),
}


def check_part(slot: str, part: object) -> None:
    """Refuse, when ``Custom`` is built, a part of another kind, a class instead of an instance, or one whose
    ``__call__`` cannot take the arguments the trainer gives it (by position; a gate's ``requires`` by name)."""
    kind, arguments = SLOTS[slot]
    elsewhere = {other: f"did you mean {key}=?" for key, (other, _) in SLOTS.items() if key != slot}
    check_instance(f"Custom({slot}={{}})", part, kind, elsewhere)
    named = frozenset()
    if isinstance(part, RatioGate):  # a gate's requires are given by name
        check_requires(part)
        named = part.requires
    check_call(f"Custom({slot}={{}})", part, arguments, named)


@dataclass(frozen=True)
class PPOClip:
    """PPO ratio clipping layered on a preset of the policy-gradient family (GRPO, RLOO, REINFORCE++, Dr. GRPO).

    MaxRL takes it too. It is ``use_ppo_clip`` with its ``clip_low`` / ``clip_high`` in flat GRPO configs,
    recommended with several updates per rollout.

    Args:
        clip_low: lower clip distance (ratio >= 1 - clip_low).
        clip_high: upper clip distance (ratio <= 1 + clip_high).
        dual_clip: dual-clip constant (> 1) for negative advantages, or None.
    """

    clip_low: float = 0.4
    clip_high: float = 0.5
    dual_clip: float | None = None

    def __post_init__(self) -> None:
        self.gate()  # refused here, where the settings are, not by the preset that builds the gate later

    def gate(self) -> ClipGate:
        return ClipGate(clip_low=self.clip_low, clip_high=self.clip_high, dual_clip=self.dual_clip)


def gate_for(ppo_clip: PPOClip | None) -> RatioGate:
    """The policy-gradient family's gate: none (the plain policy gradient), or PPO clipping when asked."""
    if ppo_clip is not None and not isinstance(ppo_clip, PPOClip):
        raise TypeError(
            f"ppo_clip={ppo_clip!r:.40} takes gpo.algo.PPOClip(...) (its clip_low, clip_high, dual_clip) or None; "
            "in YAML: ppo_clip: {} for its defaults."
        )
    return NoGate() if ppo_clip is None else ppo_clip.gate()


def check_norm(advantage_norm: str) -> Literal["group", "batch"]:
    if advantage_norm not in ("group", "batch"):
        raise ValueError(f"advantage_norm={advantage_norm!r} is not valid; choose 'group' or 'batch'.")
    return advantage_norm
