"""gpo.algo: the math of group-based policy optimisation, in pure torch.

Four kinds of part compose every algorithm: an ``AdvantageEstimator``, a ``RatioGate``, a
``LossAggregator`` and a ``RewardMixer``. This package imports torch only.
"""

from gpo.algo.advantages import (
    AdvantageEstimator,
    BatchWhitenedAdvantage,
    GroupNormAdvantage,
    LeaveOneOutAdvantage,
    RankAdvantage,
)
from gpo.algo.aggregators import ConstantNorm, LossAggregator, SequenceMean, SequenceSum, TokenMean
from gpo.algo.correction import RolloutCorrection, mismatch_metrics
from gpo.algo.gates import (
    CISPOGate,
    ClipGate,
    DivergenceMaskGate,
    GeometricMeanGate,
    NoGate,
    RatioGate,
    RouterShiftGate,
    SequenceClipGate,
    SoftGate,
    VESPOGate,
    router_logprobs,
    router_shift_weight,
)
from gpo.algo.logprobs import TokenLogProbs, linear_token_logprobs, token_logprobs
from gpo.algo.mixers import EnvEventOutcomeBlend, GroupNormalizedSum, RewardMixer, WeightedSum
from gpo.algo.presets import ALGORITHMS, Algorithm, AlgorithmKnobs, build_algorithm
from gpo.algo.regularizers import EntropyBonus, KLPenalty, kl_estimate
from gpo.algo.shaping import DuplicatePenalty, SoftOverlongPunishment
from gpo.algo.weighting import ReferenceProbWeight, overlong_filter

__all__ = [
    "ALGORITHMS",
    "AdvantageEstimator",
    "Algorithm",
    "AlgorithmKnobs",
    "BatchWhitenedAdvantage",
    "CISPOGate",
    "ClipGate",
    "ConstantNorm",
    "DivergenceMaskGate",
    "DuplicatePenalty",
    "EntropyBonus",
    "EnvEventOutcomeBlend",
    "GeometricMeanGate",
    "GroupNormAdvantage",
    "GroupNormalizedSum",
    "KLPenalty",
    "LeaveOneOutAdvantage",
    "LossAggregator",
    "NoGate",
    "RankAdvantage",
    "RatioGate",
    "ReferenceProbWeight",
    "RewardMixer",
    "RolloutCorrection",
    "RouterShiftGate",
    "SequenceClipGate",
    "SequenceMean",
    "SequenceSum",
    "SoftGate",
    "SoftOverlongPunishment",
    "TokenLogProbs",
    "TokenMean",
    "VESPOGate",
    "WeightedSum",
    "build_algorithm",
    "kl_estimate",
    "linear_token_logprobs",
    "mismatch_metrics",
    "overlong_filter",
    "router_logprobs",
    "router_shift_weight",
    "token_logprobs",
]
