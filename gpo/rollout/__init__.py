"""Rollout engines: prompts in, grouped completions (token ids, masks, log-probs) out."""

from gpo.rollout.base import Rollout, RolloutEngine, Sampling
from gpo.rollout.hf import HFEngine

__all__ = ["HFEngine", "Rollout", "RolloutEngine", "Sampling"]
