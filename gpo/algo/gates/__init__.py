"""Ratio gates: every surrogate in the family as ``gate(r) x advantage``, aggregated over tokens.

The unified view, as the survey article named in docs/algorithms.md presents the family
(https://ydnyshhh.github.io/posts/policy_optimization): each method optimises ``mean over tokens of f(r_t) A_t`` and
differs only in ``f``, the gate on the importance ratio ``r_t = pi(o_t) / pi_old(o_t)``, and in whether the ratio is a
token's or a sequence's. Where we depart from a paper's text, the gate's docstring says so.
"""

from gpo.algo.gates.base import RatioGate
from gpo.algo.gates.divergence import DivergenceMaskGate
from gpo.algo.gates.router import RouterShiftGate, router_logprobs, router_shift_weight
from gpo.algo.gates.sequence import GeometricMeanGate, SequenceClipGate, VESPOGate
from gpo.algo.gates.token import CISPOGate, ClipGate, DROGate, NoGate, SoftGate

__all__ = [
    "CISPOGate",
    "ClipGate",
    "DROGate",
    "DivergenceMaskGate",
    "GeometricMeanGate",
    "NoGate",
    "RatioGate",
    "RouterShiftGate",
    "SequenceClipGate",
    "SoftGate",
    "VESPOGate",
    "router_logprobs",
    "router_shift_weight",
]
