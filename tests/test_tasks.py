import json
import random
import zlib

import pytest

from gpo.tasks import Arithmetic, add_digits, make_task, reverse_letters, sort_digits, write_jsonl


def test_tasks_produce_correct_answers():
    rng = random.Random(0)
    for _ in range(50):
        r = sort_digits(rng, length=4)
        assert r["prompt"].endswith("=") and r["answer"] == "".join(sorted(r["prompt"][:-1]))
        r = reverse_letters(rng)
        assert r["answer"] == r["prompt"][:-1][::-1]
        r = add_digits(rng, length=2)
        a, b = r["prompt"][:-1].split("+")
        assert int(r["answer"]) == int(a) + int(b)


def test_make_task_is_reproducible_and_writes_jsonl(tmp_path):
    first, second = make_task("sort_digits", 20, seed=3), make_task("sort_digits", 20, seed=3)
    assert first == second and first != make_task("sort_digits", 20, seed=4)
    path = write_jsonl(first, tmp_path / "data" / "train.jsonl")
    assert [json.loads(line) for line in path.read_text().splitlines()] == first


def test_unknown_task_lists_the_known_ones():
    with pytest.raises(ValueError, match="sort_digits, reverse_letters, add_digits"):
        make_task("sort_words", 3)


# ---- Arithmetic: questions for a small instruct model, generated from a seed ------------------------------------


def solve(prompt: str) -> int:
    """The answer of ``What is A op B? ...``, computed from the question's text."""
    a, op, b = prompt.removeprefix("What is ").split("?")[0].split()
    return {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


def test_arithmetic_answers_its_questions_in_the_stated_format():
    rows = Arithmetic(size=300, operations=["+", "-", "*"], seed=1).records()
    assert len({r["prompt"] for r in rows}) == 300
    for r in rows:
        assert r["prompt"].endswith("? End your reply with 'Answer: <number>'.")
        assert int(r["answer"]) == solve(r["prompt"]) and int(r["answer"]) >= 0  # subtraction: larger first
        a, _, b = r["prompt"].removeprefix("What is ").split("?")[0].split()
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99
    assert {r["prompt"].split()[3] for r in rows} == {"+", "-", "*"}


def test_arithmetic_splits_problems_by_their_hash_so_held_out_ones_never_train():
    train = {r["prompt"] for r in Arithmetic(size=4000, seed=0).records()}
    test = Arithmetic(size=500, split="test", seed=5).records()
    assert not train & {r["prompt"] for r in test}
    for r in test:  # the held-out eighth: crc32 of "a op b" divisible by 8
        problem = r["prompt"].removeprefix("What is ").split("?")[0]
        assert zlib.crc32(problem.encode()) % 8 == 0


def test_arithmetic_is_reproducible_from_its_seed_and_a_smaller_set_is_a_prefix():
    first = Arithmetic(size=50, seed=3, instruction="").records()
    assert first == Arithmetic(size=50, seed=3, instruction="").records()
    assert first != Arithmetic(size=50, seed=4, instruction="").records()
    assert Arithmetic(size=20, seed=3, instruction="").records() == first[:20]
    assert first[0]["prompt"].endswith("?")  # no instruction: the bare question


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"size": 0}, r"size=0 must be >= 1"),
        ({"size": 5, "split": "dev"}, r"split='dev' is not valid; choose 'train' or 'test'"),
        ({"size": 5, "digits": 0}, r"digits=0 must be in 1..6"),
        ({"size": 5, "operations": ["/"]}, r"operations=\['/'\] must be a non-empty list of \['\+', '-', '\*'\]"),
    ],
)
def test_arithmetic_refuses_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Arithmetic(**kwargs)


def test_arithmetic_says_when_the_split_has_fewer_problems_than_asked():
    one_digit = {f"{a} + {b}" for a in range(10) for b in range(10)}
    held_out = sum(zlib.crc32(p.encode()) % 8 == 0 for p in one_digit)
    assert held_out == 18  # of the 100 one-digit sums
    assert len(Arithmetic(size=held_out, split="test", digits=1).records()) == held_out
    with pytest.raises(ValueError, match=rf"size={held_out + 1}, but only {held_out} distinct test problems"):
        Arithmetic(size=held_out + 1, split="test", digits=1).records()
