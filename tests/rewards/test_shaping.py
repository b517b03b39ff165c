"""Shaping rewards: DAPO's soft overlong punishment and the duplicate penalty, as reward functions."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpo.rewards import DuplicatePenalty, SoftOverlongPunishment
from tests.algo.strategies import fuzz


def ids_of(lengths):
    return [[5] * n for n in lengths]


def test_soft_overlong_punishment_piecewise():
    # L_max = 10, L_cache = 4: safe up to 6; ramp (6 - |y|) / 4; -1 past 10
    lengths = [3, 6, 7, 8, 10, 11]
    reward = SoftOverlongPunishment(max_length=10, cache_length=4)
    out = reward(["p"] * 6, ["c"] * 6, completion_ids=ids_of(lengths))
    assert out == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    assert reward.__name__ == "soft_overlong"
    for cache_length in (0, 12):  # a ramp of no width would divide by zero; one wider than L_max starts below 0
        with pytest.raises(ValueError, match=f"cache_length={cache_length} must be in"):
            SoftOverlongPunishment(max_length=10, cache_length=cache_length)


@fuzz()
@given(data=st.data(), max_length=st.integers(1, 40))
def test_soft_overlong_punishment_is_a_ramp_from_0_to_minus_1(data, max_length):
    cache = data.draw(st.integers(1, max_length))
    lengths = data.draw(st.lists(st.integers(0, max_length + 10), min_size=1, max_size=12))
    out = SoftOverlongPunishment(max_length=max_length, cache_length=cache)(
        ["p"] * len(lengths), ["c"] * len(lengths), completion_ids=ids_of(lengths)
    )
    safe = max_length - cache
    for n, penalty in zip(lengths, out, strict=True):
        expected = 0.0 if n <= safe else -1.0 if n > max_length else (safe - n) / cache
        assert penalty == pytest.approx(expected, abs=1e-12) and -1 <= penalty <= 0
    by_length = [p for _, p in sorted(zip(lengths, out, strict=True))]
    assert all(a >= b for a, b in itertools.pairwise(by_length)), "longer is never punished less"


def test_duplicate_penalty_within_a_prompts_completions_only():
    prompts = ["a", "a", "a", "a", "b", "b"]
    ids = [[5, 6], [5, 6], [5, 7], [5, 6], [5, 6, 9], [5, 6]]
    # prompt a: rows 1 and 3 repeat row 0, row 2 differs; prompt b: row 4 is longer, row 5 first of its kind there
    out = DuplicatePenalty(penalty=-0.5)(prompts, ["x"] * 6, completion_ids=ids)
    assert out == [0.0, -0.5, 0.0, -0.5, 0.0, 0.0]
    for penalty in (1, float("nan"), float("-inf")):  # a non-finite reward fails the run at the first repeat
        with pytest.raises(ValueError, match=f"penalty={penalty} must be a finite number <= 0"):
            DuplicatePenalty(penalty=penalty)


@fuzz()
@given(data=st.data(), penalty=st.floats(-5, 0))
def test_duplicate_penalty_hits_every_repeat_after_the_first(data, penalty):
    rows = data.draw(st.lists(st.tuples(st.sampled_from("ab"), st.lists(st.integers(0, 2), max_size=3)), min_size=1))
    prompts, ids = [p for p, _ in rows], [t for _, t in rows]
    out = DuplicatePenalty(penalty=penalty)(prompts, ["x"] * len(rows), completion_ids=ids)
    seen, expected = set(), []
    for key in zip(prompts, map(tuple, ids), strict=True):
        expected.append(penalty if key in seen else 0.0)
        seen.add(key)
    assert out == expected
