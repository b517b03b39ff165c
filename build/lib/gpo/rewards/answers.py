"""Final-answer comparison through ``math-verify`` (imported lazily: it pulls in sympy, ~0.5 s)."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

logger = logging.getLogger(__name__)

#: Seconds math-verify may spend parsing one string, and again on each gold/prediction comparison.
MATH_TIMEOUT_S = 5
_warned_unparsable_gold = False


def _timeout() -> int | None:
    """math-verify times out with ``signal.alarm``, which only works in the main thread on POSIX.

    Elsewhere (worker threads, Windows, where it would spawn a process per call) the timeout is disabled,
    so a pathological expression can block that thread; math-verify logs a one-time warning saying so.
    """
    in_main = threading.current_thread() is threading.main_thread()
    return MATH_TIMEOUT_S if in_main and os.name == "posix" else None


def _warn_if_unparsable(gold: str, parsed: list[Any]) -> None:
    global _warned_unparsable_gold
    if not parsed and not _warned_unparsable_gold:
        logger.warning(
            "math_answer: the gold answer %r has no parsable math, so its completions score 0.0 "
            "(warned once; later ones are not reported).",
            gold[:200],
        )
        _warned_unparsable_gold = True


def parse_answer(text: str, timeout: int | None) -> list[Any]:
    """The final answer in ``text`` as sympy (``\\boxed{}`` / "answer:" first, else the last math); ``[]`` if none."""
    from math_verify import parse

    return parse(text, parsing_timeout=timeout)


def math_equal(gold: list[Any], completion: str, timeout: int | None) -> bool:
    """Whether the final answer in ``completion`` equals the parsed ``gold`` answer; errors count as unequal."""
    from math_verify import verify

    prediction = parse_answer(completion, timeout) if gold else []
    return bool(prediction) and verify(gold, prediction, timeout_seconds=timeout)


def math_equal_batch(golds: list[str], completions: list[str]) -> list[bool]:
    """``math_equal`` for each (gold, completion) pair, parsing each distinct gold once (groups share it)."""
    timeout = _timeout()
    parsed: dict[str, list[Any]] = {}
    out = []
    for gold, completion in zip(golds, completions, strict=True):
        if gold not in parsed:
            parsed[gold] = parse_answer(gold, timeout)
            _warn_if_unparsable(gold, parsed[gold])
        out.append(math_equal(parsed[gold], completion, timeout))
    return out
