"""Rollout engines: prompts in, grouped completions (token ids, masks, log-probs) out; and the Collector that scores
them. Names are imported on first use, so ``gpo.rollout.base`` (what callbacks need) does not pull in the engines."""

from gpo import lazy_exports

_HOMES = {
    "Collector": "gpo.rollout.collector",
    "HFEngine": "gpo.rollout.hf",
    "MultiTurnEngine": "gpo.rollout.multi_turn",
    "Rollout": "gpo.rollout.base",
    "RolloutEngine": "gpo.rollout.base",
    "Sampling": "gpo.rollout.base",
}

__getattr__, __dir__, __all__ = lazy_exports("gpo.rollout", _HOMES, globals())
