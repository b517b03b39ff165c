"""Seeds of a run's random streams: one run seed, and a separate stream for every purpose, step and rank.

``seed_everything`` sets the run's seed; ``model.seed`` (rollout sampling) and ``data.seed`` (data order) default to
it and are overrides. Each stream's seed is ``stream_seed(purpose, seed, *coordinates)``, a hash, so streams of
different purposes, seeds, steps or ranks never coincide (seed 1's step 0 is not seed 0's step 1, as it was with
``seed + step``) and a run replays exactly from its seed alone:

- ``rollout``: ``(seed, step, round, rank)``, the sampling of each round of each step (``Collector``);
- ``data/order``: ``(seed, epoch)``, the order of each epoch (``EpochOrder``); ``data/val_split``: ``(seed,)``, the
  rows held out by ``val_size``; ``data/draws``: ``(seed, pass)``, the extra prompt batches (``PromptDraws``);
  ``data/workers``: ``(seed,)``, the loaders' worker seeds;
- ``eval``: ``(evaluation seed, batch)``, sampled evaluation; its seeds (``model.evaluation.seeds``) are fixed, not
  the run's, so evaluations of different runs sample alike.

Weights that start random (a LoRA adapter) are drawn from torch's global generator, which ``seed_everything`` seeds
before the CLI builds the model.
"""

from __future__ import annotations

import hashlib
import os

import torch


def run_seed(explicit: int | None) -> int:
    """``explicit``, else the run's seed: ``seed_everything`` (Lightning exports it as ``PL_GLOBAL_SEED``), else 0."""
    return explicit if explicit is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))


def stream_seed(name: str, *coordinates: int) -> int:
    """A 63-bit seed for stream ``name`` at ``coordinates`` (e.g. ``stream_seed("rollout", seed, step, round,
    rank)``): BLAKE2b of them, so any change of any coordinate gives an unrelated seed."""
    key = "/".join([name, *map(str, coordinates)]).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def stream_generator(name: str, *coordinates: int) -> torch.Generator:
    """A CPU generator seeded with ``stream_seed(name, *coordinates)``."""
    return torch.Generator().manual_seed(stream_seed(name, *coordinates))
