"""Seeds of a run's random streams: one run seed, and a separate stream for every purpose, step and rank.

A stream's seed is a hash of its name and coordinates, so the streams of different run seeds never overlap (seed 1's
step 0 is not seed 0's step 1, as it was with ``seed + step``) and a run replays exactly from its seed alone.
"""

from __future__ import annotations

import hashlib
import os


def run_seed(explicit: int | None) -> int:
    """``explicit``, else the run's seed: ``seed_everything`` (Lightning exports it as ``PL_GLOBAL_SEED``), else 0."""
    return explicit if explicit is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))


def stream_seed(name: str, *coordinates: int) -> int:
    """A 63-bit seed for stream ``name`` at ``coordinates`` (e.g. ``stream_seed("rollout", seed, step, round,
    rank)``): BLAKE2b of them, so any change of any coordinate gives an unrelated seed."""
    key = "/".join([name, *map(str, coordinates)]).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
