"""Algorithm presets: each a named bundle of an advantage estimator, a ratio gate and a loss aggregator.

A preset takes the settings its paper gives it (under seed 000's names where it has one) as typed arguments of its
own, builds its parts from them, and refuses the combinations the papers rule out with a message that says what to
change. There is no shared bag of settings: a preset has only the arguments it reads. ``Custom`` composes any three
parts freely. In YAML a preset is chosen by class (``algorithm: DAPO``, with ``init_args`` to change its settings) or
by the seed's lowercase name for its defaults (``algorithm: dapo``).
"""

from __future__ import annotations

from gpo.algo.presets.base import Algorithm, Custom, Parts, PPOClip
from gpo.algo.presets.policy_gradient import GRPO, RLOO, DrGRPO, MaxRL, ReinforcePP
from gpo.algo.presets.trust_region import CISPO, DAPO, DPPO, DRO, GMPO, GOPO, GSPO, RSPO, SAPO, VESPO

#: The presets by the seeds' lowercase names (seed 000's ``algorithm``, seed 002's TRL ``loss_type``), with defaults.
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
    "vespo": VESPO,
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
    "RLOO",
    "RSPO",
    "SAPO",
    "VESPO",
    "Algorithm",
    "Custom",
    "DrGRPO",
    "MaxRL",
    "PPOClip",
    "Parts",
    "ReinforcePP",
    "preset",
]
