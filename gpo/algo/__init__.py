"""gpo.algo: the math of group-based policy optimisation, in pure torch.

Four kinds of part compose every algorithm: an ``AdvantageEstimator``, a ``RatioGate``, a ``LossAggregator`` and
a ``RewardMixer``; presets (``GRPO``, ``DAPO``, ...) are named bundles of the first three. The ``PolicyObjective``
adds token weights, ``TokenMask``s, the KL and entropy terms and on-policy distillation. This package imports
torch only.
"""

from gpo.algo.advantages import (
    AdvantageEstimator,
    BatchWhitenedAdvantage,
    GroupNormAdvantage,
    LeaveOneOutAdvantage,
    MeanScaledAdvantage,
    RankAdvantage,
)
from gpo.algo.aggregators import ConstantNorm, LossAggregator, SequenceMean, SequenceSum, TokenMean
from gpo.algo.correction import RolloutCorrection, mismatch_metrics
from gpo.algo.distillation import TeacherKL
from gpo.algo.gates import (
    CISPOGate,
    ClipGate,
    DivergenceMaskGate,
    DROGate,
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
from gpo.algo.masks import HighEntropyMask, MismatchBandMask, OffPolicySequenceMask, SecondMomentMask, TokenMask
from gpo.algo.mixers import EnvEventOutcomeBlend, GroupNormalizedSum, RewardMixer, WeightedSum
from gpo.algo.objective import PolicyObjective
from gpo.algo.presets import (
    ALGORITHMS,
    CISPO,
    DAPO,
    DPPO,
    DRO,
    GMPO,
    GOPO,
    GRPO,
    GSPO,
    PRESETS,
    RLOO,
    RSPO,
    SAPO,
    VESPO,
    Algorithm,
    Custom,
    DrGRPO,
    MaxRL,
    Parts,
    PPOClip,
    ReinforcePP,
    preset,
)
from gpo.algo.regularizers import AdaptiveEntropy, EntropyBonus, KLPenalty, kl_estimate
from gpo.algo.turns import StepRewards
from gpo.algo.weighting import OverlongFilter, ReferenceProbWeight, TokenWeight

__all__ = [
    "ALGORITHMS",
    "CISPO",
    "DAPO",
    "DPPO",
    "DRO",
    "GMPO",
    "GOPO",
    "GRPO",
    "GSPO",
    "PRESETS",
    "RLOO",
    "RSPO",
    "SAPO",
    "VESPO",
    "AdaptiveEntropy",
    "AdvantageEstimator",
    "Algorithm",
    "BatchWhitenedAdvantage",
    "CISPOGate",
    "ClipGate",
    "ConstantNorm",
    "Custom",
    "DROGate",
    "DivergenceMaskGate",
    "DrGRPO",
    "EntropyBonus",
    "EnvEventOutcomeBlend",
    "GeometricMeanGate",
    "GroupNormAdvantage",
    "GroupNormalizedSum",
    "HighEntropyMask",
    "KLPenalty",
    "LeaveOneOutAdvantage",
    "LossAggregator",
    "MaxRL",
    "MeanScaledAdvantage",
    "MismatchBandMask",
    "NoGate",
    "OffPolicySequenceMask",
    "OverlongFilter",
    "PPOClip",
    "Parts",
    "PolicyObjective",
    "RankAdvantage",
    "RatioGate",
    "ReferenceProbWeight",
    "ReinforcePP",
    "RewardMixer",
    "RolloutCorrection",
    "RouterShiftGate",
    "SecondMomentMask",
    "SequenceClipGate",
    "SequenceMean",
    "SequenceSum",
    "SoftGate",
    "StepRewards",
    "TeacherKL",
    "TokenLogProbs",
    "TokenMask",
    "TokenMean",
    "TokenWeight",
    "VESPOGate",
    "WeightedSum",
    "kl_estimate",
    "linear_token_logprobs",
    "mismatch_metrics",
    "preset",
    "router_logprobs",
    "router_shift_weight",
    "token_logprobs",
]
