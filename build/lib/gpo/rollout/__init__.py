"""Rollout engines: prompts in, grouped completions (token ids, masks, log-probs) out."""

from gpo.rollout.base import Rollout, RolloutEngine, Sampling
from gpo.rollout.hf import HFEngine
from gpo.rollout.multi_turn import MultiTurnEngine

__all__ = ["HFEngine", "MultiTurnEngine", "Rollout", "RolloutEngine", "Sampling"]
