"""Algorithm presets: each a named bundle of an advantage estimator, a ratio gate and a loss aggregator.

A preset takes the settings its paper gives it (under the names of flat GRPO configs where they have one, see
docs/algorithms.md) as typed arguments of its own, builds its parts from them, and refuses the combinations the papers
rule out with a message that says what to change. There is no shared bag of settings: a preset has only the arguments it
reads. ``Custom`` composes any three parts freely. In YAML a preset is chosen by class (``algorithm: DAPO``, with
``init_args`` to change its settings) or by its lowercase name for its defaults (``algorithm: dapo``).
"""

from __future__ import annotations

import inspect

from gpo.algo.presets.base import Algorithm, Custom, Parts, PPOClip
from gpo.algo.presets.policy_gradient import GRPO, RLOO, DrGRPO, MaxRL, ReinforcePP
from gpo.algo.presets.trust_region import CISPO, DAPO, DPPO, DRO, GMPO, GOPO, GSPO, RSPO, SAPO, VESPO
from gpo.suggest import did_you_mean

#: The presets that have a default for every setting, by lowercase name (the ``algorithm`` of flat GRPO configs and
#: TRL's ``loss_type`` where they name one): ``algorithm: dapo`` is ``DAPO()``.
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
    "maxrl": MaxRL,
    "gopo": GOPO,
}
#: Every preset class, for ``model.algorithm: CLASS`` (those with a required setting, too).
PRESETS: tuple[type[Algorithm], ...] = (*ALGORITHMS.values(), DPPO, DRO)


def preset(algorithm: Algorithm | str) -> Algorithm:
    """``algorithm`` itself, or the preset of that lowercase name with its defaults."""
    if isinstance(algorithm, Algorithm):
        return algorithm
    if algorithm in ALGORITHMS:
        return ALGORITHMS[algorithm]()
    if algorithm.lstrip().startswith("{"):  # a class given inline that the parser refused, then took as a name
        raise ValueError(
            f"model.algorithm={algorithm!r:.100} is not a name, and as a class it has an error the parser keeps to "
            "itself here (it then read the text as a name): give it as flags (--model.algorithm Custom "
            "--model.algorithm.gate CLASS ...) or in a YAML file, and the error is named."
        )
    without_defaults = {cls.__name__.lower(): cls for cls in PRESETS if cls not in ALGORITHMS.values()}
    if algorithm.lower() in without_defaults:
        cls = without_defaults[algorithm.lower()]
        required = [p.name for p in inspect.signature(cls).parameters.values() if p.default is p.empty]
        raise ValueError(
            f"model.algorithm={algorithm!r}: {cls.__name__} has no default for {', '.join(required)}; choose it by "
            f"class with its settings: algorithm: {{class_path: {cls.__name__}, init_args: {{{required[0]}: ...}}}} "
            f"(--config {cls.__name__.lower()} sets one)."
        )
    by_lowercase = {cls.__name__.lower(): name for name, cls in ALGORITHMS.items()} | {
        name: name for name in ALGORITHMS
    }
    known = by_lowercase.get(algorithm.lower())  # another case, or the class's name: DrGRPO is dr_grpo
    names = [*ALGORITHMS, *(cls.__name__ for cls in PRESETS)]
    guess = f"did you mean {known}? " if known is not None else did_you_mean(algorithm, names, then=" ")
    raise ValueError(
        f"model.algorithm={algorithm!r} is not known; {guess}choose a name for a preset's defaults "
        f"({', '.join(ALGORITHMS)}), a preset class to change its settings "
        f"({', '.join(cls.__name__ for cls in PRESETS)}), or Custom to combine parts."
    )


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
    "Algorithm",
    "Custom",
    "DrGRPO",
    "MaxRL",
    "PPOClip",
    "Parts",
    "ReinforcePP",
    "preset",
]
