"""Final-answer comparison through ``math-verify`` (imported lazily: it pulls in sympy, ~0.5 s).

math-verify bounds its parsing and comparisons with ``signal.alarm``, which works only in a process's main thread on
POSIX. Off the main thread (the reward runner's timed calls, pipelined rollouts' sampler thread) its bounds are off,
and a completion such as ``\\boxed{9^{9^{9^{9}}}}`` keeps sympy computing while it holds the GIL (over 100 s here),
which stops the whole trainer. There the comparisons run in a child process instead (``MathChild``), in its main
thread with the bounds on; a child that overruns even so is killed.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)

#: Seconds math-verify may spend parsing one string, and again on each gold/prediction comparison.
MATH_TIMEOUT_S = 5
_warned_unparsable_gold = False


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
    """``math_equal`` for each (gold, completion) pair, each bounded by ``MATH_TIMEOUT_S``: here in the main thread
    (or on Windows, where math-verify bounds them with processes of its own), else in the child process."""
    if threading.current_thread() is threading.main_thread() or os.name != "posix":
        return _bounded_batch(golds, completions, MATH_TIMEOUT_S)
    return _child.check(golds, completions)


def _bounded_batch(golds: list[str], completions: list[str], timeout: int | None) -> list[bool]:
    """``math_equal`` for each pair, parsing each distinct gold once (groups share it)."""
    parsed: dict[str, list[Any]] = {}
    out = []
    for gold, completion in zip(golds, completions, strict=True):
        if gold not in parsed:
            parsed[gold] = parse_answer(gold, timeout)
            _warn_if_unparsable(gold, parsed[gold])
        out.append(math_equal(parsed[gold], completion, timeout))
    return out


class MathChild:
    """The child process that compares answers off the main thread: one JSON line ``{"golds": [...],
    "completions": [...]}`` in, one JSON list of booleans out (``serve_comparisons``). Started on first use (about
    2 s: Python and sympy), shared by the threads of this process one request at a time, and stopped when this
    process ends (its input closes). A request unanswered after ``MATH_TIMEOUT_S`` per parse and comparison, plus
    ``START_S``, kills the child: that batch scores False with a warning, and the next request starts a new child.
    A child that ends by itself (an error, printed on stderr) raises, for ``model.reward_errors`` to handle."""

    START_S = 30.0

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def check(self, golds: list[str], completions: list[str], deadline_s: float | None = None) -> list[bool]:
        if not completions:
            return []
        if deadline_s is None:
            deadline_s = MATH_TIMEOUT_S * (2 * len(completions) + len(set(golds))) + self.START_S
        request = json.dumps({"golds": golds, "completions": completions}) + "\n"
        with self.lock:
            process = self.process = self.process if self._alive() else self._start()
            process.stdin.write(request)
            process.stdin.flush()
            answer = _read_line(process.stdout, deadline_s)
            if answer == "":  # the child ended: an error of its own, printed on stderr, not a slow comparison
                self.process = None
                raise RuntimeError(
                    f"math_answer's child process ended with exit code {process.wait()} while comparing "
                    f"{len(completions)} completions; its error is printed above."
                )
            if answer is None:
                process.kill()
                process.wait()
                self.process = None
                logger.warning(
                    "math_answer: comparing %d completions took over %g s in its child process, which was stopped; "
                    "they score 0.0 (the first: %r).", len(completions), deadline_s, completions[0][:200],
                )  # fmt: skip
                return [False] * len(completions)
        return json.loads(answer)

    def _alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _start(self) -> subprocess.Popen:
        source_root = str(Path(__file__).resolve().parents[2])  # where this gpo is imported from
        path = os.pathsep.join(p for p in (source_root, os.environ.get("PYTHONPATH", "")) if p)
        return subprocess.Popen(
            [sys.executable, "-c", "from gpo.rewards.answers import serve_comparisons; serve_comparisons()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env={**os.environ, "PYTHONPATH": path},
        )  # fmt: skip


def _read_line(stream: IO[str], deadline_s: float) -> str | None:
    """The next line of ``stream`` within ``deadline_s`` seconds: ``""`` when the stream ends, None on time out."""
    ready, _, _ = select.select([stream], [], [], deadline_s)
    return stream.readline() if ready else None


_child = MathChild()


def serve_comparisons() -> None:
    """The child's loop: a request per input line, an answer per output line. Anything else the comparisons print
    goes to stderr."""
    answers, sys.stdout = sys.stdout, sys.stderr
    for line in sys.stdin:
        request = json.loads(line)
        answers.write(json.dumps(_bounded_batch(request["golds"], request["completions"], MATH_TIMEOUT_S)) + "\n")
        answers.flush()
