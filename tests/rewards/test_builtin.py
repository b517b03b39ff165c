"""Built-in rewards: hand-worked scores, edge cases and error messages."""

import math
import subprocess
import sys
import threading
import time

import pytest

from gpo.rewards import LengthPenalty, RegexFormat, env_reward, exact_match, math_answer, positional_match
from gpo.rewards.answers import MathChild

PROMPTS = ["q"] * 4
IDS = [[1]] * 4  # the trainer always passes completion_ids


def check(scores, n):
    assert len(scores) == n
    assert all(isinstance(s, float) and not math.isnan(s) for s in scores)


# --- exact_match ---


def test_exact_match_strips_whitespace_and_ignores_unknown_columns():
    completions = ["42", " 42\n", "", "42.0"]
    scores = exact_match(PROMPTS, completions, answer=["42", "42", "42", " 42 "], completion_ids=IDS, source=["a"] * 4)
    check(scores, 4)
    assert scores == [1.0, 1.0, 0.0, 0.0]


def test_exact_match_empty_completion_matches_only_empty_answer():
    assert exact_match(["q", "q"], ["", "  "], answer=["", "x"]) == [1.0, 0.0]


def test_exact_match_number_answers_are_formatted_as_text():
    assert exact_match(["q", "q"], ["7", "7.0"], answer=[7, 7]) == [1.0, 0.0]


def test_missing_answer_column_names_function_column_and_available_ones():
    with pytest.raises(ValueError) as e:
        exact_match(PROMPTS, ["a"] * 4, completion_ids=IDS, solution=["a"] * 4)
    assert str(e.value) == "exact_match needs a column 'answer'; the dataset has: completion_ids, solution"
    for fn in (math_answer, positional_match):
        expected = rf"^{fn.__name__} needs a column 'answer'; the dataset has: completion_ids$"
        with pytest.raises(ValueError, match=expected):
            fn(PROMPTS, ["a"] * 4, completion_ids=IDS)


@pytest.mark.parametrize("fn", [exact_match, math_answer, positional_match])
def test_wrong_length_or_none_answer_is_an_error(fn):
    with pytest.raises(ValueError, match=r"column 'answer' has 3 values for 4 completions"):
        fn(PROMPTS, ["1"] * 4, answer=["1"] * 3)
    with pytest.raises(ValueError, match=r"column 'answer' is None at row 1"):
        fn(["q", "q"], ["1", "1"], answer=["1", None])


# --- math_answer ---


def test_math_answer_equivalent_forms():
    completions = [
        r"The answer is \boxed{\frac{1}{2}}",  # gold 0.5
        "so it is 0.5",  # gold \frac{1}{2}
        r"First 41, no wait: \boxed{42}",  # boxed wins
        "The total is 1000.",  # gold 1,000
        r"$\boxed{1+x^2}$",  # gold x^2+1, symbolic
        "#### 72",  # GSM8K style
    ]
    golds = ["0.5", r"\frac{1}{2}", "42", "1,000", "$x^2+1$", "72"]
    scores = math_answer(["q"] * 6, completions, answer=golds, completion_ids=[[1]] * 6, level=[3] * 6)
    check(scores, 6)
    assert scores == [1.0] * 6


def test_math_answer_wrong_empty_or_unparsable_scores_zero():
    completions = [r"\boxed{3}", "", "   ", "no numbers here", "42 apples, not 7", "hello"]
    golds = ["4", "4", "4", "4", "42", "hello"]  # last number wins; a gold with no math never matches
    scores = math_answer(["q"] * 6, completions, answer=golds)
    check(scores, 6)
    assert scores == [0.0] * 6


def test_math_answer_in_the_main_thread_starts_no_child_process(monkeypatch):
    monkeypatch.setattr("gpo.rewards.answers._child", None)  # any use of the child would fail
    assert math_answer(["q", "q"], [r"\boxed{5}", "4"], answer=["5", "5"]) == [1.0, 0.0]


PATHOLOGICAL = r"\boxed{9^{9^{9^{9}}}}"  # unbounded, sympy computes it for over 100 s holding the GIL


def off_the_main_thread(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in another thread; the main thread counts its own half-second ticks meanwhile."""
    result, ticks = {}, 0
    thread = threading.Thread(target=lambda: result.update(value=fn(*args, **kwargs)), daemon=True)
    thread.start()
    while thread.is_alive() and ticks < 120:
        time.sleep(0.5)
        ticks += 1
    return result.get("value"), ticks


def test_math_answer_off_the_main_thread_scores_alike_and_bounds_a_pathological_answer():
    completions, golds = ["0.5", r"\boxed{5}", "x = 5", "none", PATHOLOGICAL], [r"\frac{1}{2}", *["5"] * 4]
    in_main = math_answer(["q"] * 4, completions[:4], answer=golds[:4])  # the pathological one: 5 s, then 0.0
    started = time.monotonic()
    off_main, ticks = off_the_main_thread(math_answer, ["q"] * 5, completions, answer=golds)
    assert off_main == [*in_main, 0.0] == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert time.monotonic() - started < 30 and ticks >= 2  # bounded, and the main thread ran meanwhile


def test_a_math_child_that_overruns_is_stopped_and_the_next_request_starts_a_new_one(caplog):
    child = MathChild()
    assert child.check(["5"], [r"\boxed{5}"]) == [True]
    first = child.process
    with caplog.at_level("WARNING"):
        assert child.check(["5"], [PATHOLOGICAL], deadline_s=0.5) == [False]  # its own bound is 5 s
    assert "took over 0.5 s in its child process, which was stopped; they score 0.0" in caplog.text
    assert first.poll() is not None and child.check(["5", "5"], ["5", "4"]) == [True, False]
    child.process.kill()


def test_a_math_child_that_fails_by_itself_is_an_error_not_zero_scores(monkeypatch):
    child = MathChild()
    failing = [sys.executable, "-c", "import sys; sys.stdin.readline(); sys.exit(3)"]
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    monkeypatch.setattr(child, "_start", lambda: subprocess.Popen(failing, **pipes))
    with pytest.raises(RuntimeError, match=r"child process ended with exit code 3 while comparing 1 completions"):
        child.check(["5"], ["5"])


# --- positional_match ---


def test_positional_match_hand_worked():
    completions = ["12345", "12335", "123", "1234567", "", " 12345 ", "54321"]
    scores = positional_match(["q"] * 7, completions, answer=["12345"] * 7, completion_ids=[[1]] * 7, extra=[0] * 7)
    check(scores, 7)
    # 5/5; 4/5 (one digit wrong); 3/5 (short); extras don't add; empty; stripped; only the middle 3 matches
    assert scores == pytest.approx([1.0, 0.8, 0.6, 1.0, 0.0, 1.0, 0.2])


def test_positional_match_empty_answer_is_an_error():
    with pytest.raises(ValueError, match=r"column 'answer' is empty at row 1"):
        positional_match(["q", "q"], ["1", "1"], answer=["1", "  "])


# --- RegexFormat ---


def test_regex_format_search_and_full_match():
    completions = ["<think>a\nb</think><answer>4</answer>", "x <answer>4</answer> y", "", "<answer></answer>"]
    search = RegexFormat(pattern=r"<answer>.+</answer>", reward=0.5)
    full = RegexFormat(pattern=r"<think>.*</think><answer>.+</answer>", full_match=True, name="format")
    assert search(PROMPTS, completions, completion_ids=IDS, answer=["4"] * 4) == [0.5, 0.5, 0.0, 0.0]
    assert full(PROMPTS, completions) == [1.0, 0.0, 0.0, 0.0]  # DOTALL: the newline inside <think> is fine
    assert (search.name, search.__name__, full.name) == ("regex_format", "regex_format", "format")


def test_regex_format_rejects_bad_pattern_and_reward():
    with pytest.raises(ValueError, match=r"pattern '\(a' is not a valid regular expression"):
        RegexFormat(pattern="(a")
    with pytest.raises(ValueError, match="finite"):
        RegexFormat(pattern="a", reward=float("nan"))


# --- LengthPenalty ---


def test_length_penalty_hand_worked():
    penalty = LengthPenalty(max_tokens=3, penalty_per_token=0.5)
    ids = [[], [1, 2, 3], [1, 2, 3, 4], list(range(10))]
    scores = penalty(PROMPTS, ["", "a", "b", "c"], completion_ids=ids, answer=["x"] * 4)
    check(scores, 4)
    assert scores == [0.0, 0.0, -0.5, -3.5]
    assert all(math.copysign(1.0, s) == 1.0 for s in scores[:2])  # +0.0, not -0.0
    assert penalty.__name__ == "length_penalty"


def test_length_penalty_bounds_are_allowed():
    completions, ids = ["", "a", "b"], [[], [1], [1, 2, 3]]
    every_token = LengthPenalty(max_tokens=0, penalty_per_token=0.25)
    assert every_token(["q"] * 3, completions, completion_ids=ids) == [0.0, -0.25, -0.75]  # 0, 1 and 3 tokens * 0.25
    free = LengthPenalty(max_tokens=1, penalty_per_token=0.0)
    assert free(["q"] * 3, completions, completion_ids=ids) == [0.0, 0.0, 0.0]


def test_length_penalty_column_errors():
    penalty = LengthPenalty(max_tokens=3)
    with pytest.raises(ValueError, match=r"^length_penalty needs a column 'completion_ids'; the dataset has: answer$"):
        penalty(["q"], ["a"], answer=["a"])
    with pytest.raises(ValueError, match=r"column 'completion_ids' has 1 values for 2 completions"):
        penalty(["q", "q"], ["a", "b"], completion_ids=[[1]])
    with pytest.raises(ValueError, match=r"column 'completion_ids' has 2 values for 1 completions"):
        penalty(["q"], ["a"], completion_ids=[[1], [2]])


@pytest.mark.parametrize(
    "kwargs",
    [{"max_tokens": -1}, {"max_tokens": 2.5}, {"max_tokens": True}, {"max_tokens": 4, "penalty_per_token": -0.1}],
)
def test_length_penalty_rejects_bad_args(kwargs):
    with pytest.raises(ValueError, match="LengthPenalty"):
        LengthPenalty(**kwargs)


def test_length_penalty_rejects_infinite_penalty():
    with pytest.raises(ValueError, match="penalty_per_token"):
        LengthPenalty(max_tokens=4, penalty_per_token=float("inf"))


# --- env_reward ---


def test_env_reward_is_the_episode_return_and_says_which_engine_fills_it():
    assert env_reward(["q", "q"], ["a", "b"], env_return=[1, -0.5]) == [1.0, -0.5]
    with pytest.raises(ValueError, match=r"needs the 'env_return' column .* a gpo.rollout.MultiTurnEngine"):
        env_reward(["q"], ["a"], answer=["a"], completion_ids=[[1]])


def test_empty_batch_gives_empty_scores():
    for fn in (exact_match, math_answer, positional_match, RegexFormat(pattern="a"), LengthPenalty(max_tokens=1)):
        assert fn([], [], answer=[], completion_ids=[]) == []


def test_rewards_configure_from_class_path_and_init_args():
    from collections.abc import Callable

    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--rewards", type=list[Callable])
    config = [
        "gpo.rewards.exact_match",
        {"class_path": "gpo.rewards.RegexFormat", "init_args": {"pattern": "a+", "reward": 0.5, "name": "has_a"}},
        {"class_path": "gpo.rewards.LengthPenalty", "init_args": {"max_tokens": 1}},
    ]
    cfg = parser.parse_object({"rewards": config})
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    rewards = instantiate(cfg).rewards
    assert [fn.__name__ for fn in rewards] == ["exact_match", "has_a", "length_penalty"]
    assert [fn(["q"], ["aa"], answer=["aa"], completion_ids=[[1, 2]]) for fn in rewards] == [[1.0], [0.5], [-0.01]]
