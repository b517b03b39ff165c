"""Every random generator a run draws from, captured into checkpoint-safe values and put back on resume."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_random_state() -> dict[str, Any]:
    """The states of Python's, NumPy's and torch's global generators (CPU and every CUDA device), as tensors and
    plain values that ``torch.load(weights_only=True)`` accepts."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }  # fmt: skip
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_random_state(state: dict[str, Any]) -> None:
    """Put back what ``capture_random_state`` captured."""
    random.setstate(_as_tuples(state["python"]))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["kind"], keys, n["position"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuples(value: Any) -> Any:
    """Python's generator state is nested tuples; a checkpoint round trip may hand lists back."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, list | tuple) else value
