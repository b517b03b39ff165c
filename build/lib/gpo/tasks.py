"""Synthetic verifiable tasks with partial-credit answers, small enough for a tiny model to learn on a CPU."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

Record = dict[str, str]


def sort_digits(rng: random.Random, length: int = 3) -> Record:
    """``"312="`` -> ``"123"``: sort a string of digits."""
    digits = "".join(rng.choice("0123456789") for _ in range(length))
    return {"prompt": f"{digits}=", "answer": "".join(sorted(digits))}


def reverse_letters(rng: random.Random, length: int = 3) -> Record:
    """``"abc>"`` -> ``"cba"``: reverse a string of letters."""
    letters = "".join(rng.choice("abcdefgh") for _ in range(length))
    return {"prompt": f"{letters}>", "answer": letters[::-1]}


def add_digits(rng: random.Random, length: int = 1) -> Record:
    """``"3+4="`` -> ``"7"``: add two numbers of ``length`` digits."""
    a, b = (rng.randrange(10**length) for _ in range(2))
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


TASKS: dict[str, Callable[..., Record]] = {
    "sort_digits": sort_digits,
    "reverse_letters": reverse_letters,
    "add_digits": add_digits,
}


def make_task(name: str, num_examples: int, *, seed: int = 0, **kwargs) -> list[Record]:
    """``num_examples`` records ``{"prompt", "answer"}`` of task ``name``, reproducible from ``seed``."""
    if name not in TASKS:
        raise ValueError(f"task={name!r} is not known; choose one of {', '.join(TASKS)}.")
    rng = random.Random(seed)
    return [TASKS[name](rng, **kwargs) for _ in range(num_examples)]


def write_jsonl(records: list[Record], path: str | Path) -> Path:
    """Write records one JSON object per line; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
