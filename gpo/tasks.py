"""Synthetic verifiable tasks generated from a seed: tiny partial-credit ones for a tiny model on a CPU, and
arithmetic questions for a small pretrained instruct model (``Arithmetic``)."""

from __future__ import annotations

import json
import operator
import random
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

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


class GeneratedTask(ABC):
    """Prompt rows made from a seed instead of read from a file: ``data.path`` and ``data.val_path`` accept one
    (``{class_path: gpo.tasks.Arithmetic, init_args: {...}}``), so a run needs no preparation step."""

    @abstractmethod
    def records(self) -> list[Record]:
        """The rows: a ``prompt`` column and the columns the rewards read (e.g. ``answer``)."""


OPERATIONS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}


class Arithmetic(GeneratedTask):
    """``What is 47 + 38? End your reply with 'Answer: <number>'.`` -> answer ``85``.

    Questions for a small instruct model, asked through its chat template (the data module applies it) and
    scored by ``gpo.rewards.math_answer`` on the ``answer`` column plus a format reward such as
    ``gpo.rewards.RegexFormat`` on ``instruction``'s layout. Each problem ``(a, op, b)`` belongs to the ``test``
    split when ``crc32("a op b") % 8 == 0`` (about one in eight), else to ``train``: held-out questions never
    appear in training, whatever the sizes and seeds. Subtraction puts the larger operand first (no negative
    answers).

    Args:
        size: distinct problems to draw.
        split: ``train`` or ``test`` (the held-out eighth of all problems).
        seed: which problems are drawn, and in what order.
        digits: digits of each operand (2: 10 to 99).
        operations: the operations to draw from: any of ``+``, ``-``, ``*``.
        instruction: appended to each question: the answer format the rewards check.
    """

    def __init__(
        self,
        *,
        size: int,
        split: Literal["train", "test"] = "train",
        seed: int = 0,
        digits: int = 2,
        operations: Sequence[str] = ("+",),
        instruction: str = "End your reply with 'Answer: <number>'.",
    ) -> None:
        if size < 1:
            raise ValueError(f"Arithmetic: size={size} must be >= 1 (distinct problems to draw).")
        if split not in ("train", "test"):
            raise ValueError(f"Arithmetic: split={split!r} is not valid; choose 'train' or 'test'.")
        if not 1 <= digits <= 6:
            raise ValueError(f"Arithmetic: digits={digits} must be in 1..6 (digits of each operand).")
        unknown = [op for op in operations if op not in OPERATIONS]
        if unknown or not operations:
            raise ValueError(
                f"Arithmetic: operations={list(operations)} must be a non-empty list of {list(OPERATIONS)}."
            )
        self.size, self.split, self.seed, self.digits = size, split, seed, digits
        self.operations, self.instruction = list(operations), instruction

    def records(self) -> list[Record]:
        rng = random.Random(self.seed)
        low, high = (10 ** (self.digits - 1) if self.digits > 1 else 0), 10**self.digits
        drawn: dict[str, Record] = {}
        for _ in range(200 * self.size):  # enough draws to find every problem of a small split, almost surely
            a, b, op = rng.randrange(low, high), rng.randrange(low, high), rng.choice(self.operations)
            a, b = (b, a) if op == "-" and b > a else (a, b)
            problem = f"{a} {op} {b}"
            if problem not in drawn and self.split_of(problem) == self.split:
                drawn[problem] = {"prompt": f"What is {problem}? {self.instruction}".strip(),
                                  "answer": str(OPERATIONS[op](a, b))}  # fmt: skip
                if len(drawn) == self.size:
                    return list(drawn.values())
        raise ValueError(
            f"Arithmetic: size={self.size}, but only {len(drawn)} distinct {self.split} problems with "
            f"{self.digits}-digit operands and operations {self.operations} were found; lower size, or allow more "
            "digits or operations."
        )

    @staticmethod
    def split_of(problem: str) -> Literal["train", "test"]:
        """``test`` for about one problem in eight, chosen by a hash of its text (stable across Python runs)."""
        return "test" if zlib.crc32(problem.encode()) % 8 == 0 else "train"

    def __repr__(self) -> str:
        return (
            f"Arithmetic(size={self.size}, split={self.split!r}, seed={self.seed}, digits={self.digits}, "
            f"operations={self.operations}, instruction={self.instruction!r})"
        )
