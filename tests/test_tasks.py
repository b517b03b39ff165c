import json
import random

import pytest

from gpo.tasks import add_digits, make_task, reverse_letters, sort_digits, write_jsonl


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
