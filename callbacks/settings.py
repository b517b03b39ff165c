"""Checks of the callbacks' settings, each refusal naming the setting, what it must be and what it means. Given in
Python, a setting has no parser to check its type: ``window=2.5`` would fail steps later, far from it, and a string
where a list of texts belongs would be read as its characters."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def check_count(name: str, value: Any, minimum: int, meaning: str, *, none: str | None = None) -> None:
    """Refuse ``value`` unless it is an int (not a bool) of at least ``minimum``, or None where ``none`` says what
    None stands for."""
    if value is None and none is not None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        alternative = f", or None {none}" if none is not None else ""
        raise ValueError(f"{name}={value!r} must be an int >= {minimum} ({meaning}){alternative}.")


def check_number(name: str, value: Any, meaning: str, *, above: float = -math.inf, at_least: float = -math.inf,
                 below: float = math.inf, at_most: float = math.inf) -> None:  # fmt: skip
    """Refuse ``value`` unless it is a finite number (not a bool) within the bounds given."""
    within = at_least <= value <= at_most and above < value < below if isinstance(value, int | float) else False
    if isinstance(value, bool) or not within or not math.isfinite(value):
        bounds = [f"> {above:g}"] * (above > -math.inf) + [f">= {at_least:g}"] * (at_least > -math.inf)
        bounds += [f"< {below:g}"] * (below < math.inf) + [f"<= {at_most:g}"] * (at_most < math.inf)
        raise ValueError(f"{name}={value!r} must be a finite number{' ' if bounds else ''}{' and '.join(bounds)} "
                         f"({meaning}).")  # fmt: skip


def check_texts(name: str, value: Any, meaning: str) -> None:
    """Refuse ``value`` unless it is a list (or other sequence) of strings, not a string itself."""
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name}={value!r:.60} must be a list of strings ({meaning}).")
