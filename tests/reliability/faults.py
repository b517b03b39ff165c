"""Reward functions that misbehave on cue, for fault-injection runs in a subprocess (importable by YAML path).

The cue is a file named by an environment variable, so the parent test decides when the fault fires."""

from __future__ import annotations

import os
import time
from pathlib import Path

from lightning import Callback

from gpo.rewards import positional_match

BATCHES = [0]  # training batches finished in this process


class CountBatches(Callback):
    def on_train_batch_end(self, *args, **kwargs) -> None:
        BATCHES[0] += 1


def stall_on_cue(prompts, completions, **columns):
    """``positional_match``, but once the file ``$GPO_FAULT_CUE`` exists: touch ``$GPO_FAULT_CUE.hit`` (the step is
    now between sampling and the update) and sleep ``$GPO_FAULT_STALL_S`` seconds, so the parent can signal the
    process mid-step."""
    cue = os.environ.get("GPO_FAULT_CUE")
    if cue and Path(cue).exists():
        Path(cue + ".hit").touch()
        time.sleep(float(os.environ.get("GPO_FAULT_STALL_S", "600")))
    return positional_match(prompts, completions, **columns)


def stall_rank_0_on_cue(prompts, completions, **columns):
    """``stall_on_cue`` on global rank 0 alone: the other ranks go on to the step's next collective and wait there."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() > 0:
        return positional_match(prompts, completions, **columns)
    return stall_on_cue(prompts, completions, **columns)


class SlowToPickle:
    """Pickling it touches ``marker`` then sleeps: a checkpoint holding one is mid-write for as long as needed."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        Path(self.marker).touch()
        time.sleep(600)
        return (SlowToPickle, (self.marker,))
