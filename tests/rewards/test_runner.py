"""score: reward functions' values per completion, and each way a reward function can fail under each policy."""

import logging
import math
import threading
import time

import pytest
import torch
from jsonargparse import ArgumentParser

from gpo.rewards import bounded_time, exact_match, positional_match
from gpo.rewards.runner import MAX_SINGLE_ROW_RETRIES, RewardError, RewardErrors, reward_name, score
from gpo.rollout.base import Rollout

PROMPTS = ["12=", "34=", "56=", "78="]
COMPLETIONS = ["3", "7", "11", "15"]
FIX = "model.reward_errors.policy: score"


def make_rollout(prompts=PROMPTS, completions=COMPLETIONS, answers=None) -> Rollout:
    """One completion per prompt; completion ids are the characters' codes, right-padded with 0 to width 3."""
    size = len(prompts)
    ids = torch.zeros(size, 3, dtype=torch.long)
    mask = torch.zeros(size, 3, dtype=torch.long)
    for row, text in enumerate(completions):
        ids[row, : len(text)] = torch.tensor([ord(c) for c in text[:3]])
        mask[row, : len(text)] = 1
    return Rollout(
        prompt_ids=torch.ones(size, 1, dtype=torch.long),
        prompt_mask=torch.ones(size, 1, dtype=torch.long),
        completion_ids=ids,
        completion_mask=mask,
        truncated=torch.zeros(size, dtype=torch.bool),
        group=torch.arange(size),
        prompts=list(prompts),
        completions=list(completions),
        fields={"answer": answers if answers is not None else ["3", "7", "12", "15"]},
    )


def matches(prompts, completions, answer, **_):
    return [float(c == a) for c, a in zip(completions, answer, strict=True)]


def length(prompts, completions, completion_ids, **_):
    return [len(ids) / 4 for ids in completion_ids]


# ---- the good path ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("errors", [RewardErrors(), RewardErrors(policy="score"), RewardErrors(timeout_s=5.0)])
def test_values_are_the_functions_own(errors):
    scored = score([matches, length], make_rollout(), errors)
    # matches: answers 3, 7, 12, 15 vs completions 3, 7, 11, 15; length: 1, 1, 2, 2 tokens (padding dropped) / 4
    expected = torch.tensor([[1.0, 0.25], [1.0, 0.25], [0.0, 0.5], [1.0, 0.5]])
    torch.testing.assert_close(scored.values, expected)
    assert scored.replaced == ({"matches": 0, "length": 0} if errors.policy == "score" else {})


def test_tensors_generators_and_numpy_style_scalars_are_accepted():
    def as_tensor(prompts, completions, **_):
        return torch.tensor([0.5] * len(completions))

    def as_generator(prompts, completions, **_):
        return (torch.tensor(1.5) for _ in completions)

    scored = score([as_tensor, as_generator], make_rollout())
    torch.testing.assert_close(scored.values, torch.tensor([[0.5, 1.5]] * 4))


# ---- each failure kind, under each policy -------------------------------------------------------------------------


def raises(prompts, completions, **_):
    return [1.0 / (len(c) - 2) for c in completions]  # ZeroDivisionError on the 2-character completion "11"


def one_short(prompts, completions, **_):
    return [1.0] * (len(completions) - 1)


def not_a_list(prompts, completions, **_):
    return 0.5


def one_too_many(prompts, completions, **_):
    return [1.0] * (len(completions) + 1)


def text_of_one_character_per_row(prompts, completions, **_):
    return "1" * len(completions)  # iterable, but one string: not a value per row


def zero_dim_tensor(prompts, completions, **_):
    return torch.tensor(0.5)


def pair_on_row_2(prompts, completions, **_):
    return [torch.tensor([1.0, 2.0]) if row == 2 else 2.0 for row in range(len(completions))]


def none_on_row_1(prompts, completions, **_):
    return [None if row == 1 else 2.0 for row in range(len(completions))]


def nan_on_row_2(prompts, completions, **_):
    return [math.nan if row == 2 else 2.0 for row in range(len(completions))]


def inf_on_row_3(prompts, completions, **_):
    return [math.inf if row == 3 else 2.0 for row in range(len(completions))]


def text_on_row_0(prompts, completions, **_):
    return ["1.0" if row == 0 else 2.0 for row in range(len(completions))]


# function, what the message says, the prompt it names, rows that get the fallback value
WHOLE_CALL = [
    (raises, "raised ZeroDivisionError", "56=", [0, 1, 2, 3]),  # found by scoring rows alone (fail policy only)
    (one_short, "returned 3 values for 4 completions", "12=", [0, 1, 2, 3]),
    (not_a_list, "returned 0.5, not a list, for 4 completions", "12=", [0, 1, 2, 3]),
    (one_too_many, "returned 5 values for 4 completions", "12=", [0, 1, 2, 3]),
    (text_of_one_character_per_row, "returned '1111', not a list, for 4 completions", "12=", [0, 1, 2, 3]),
    (zero_dim_tensor, "returned tensor(0.5000), not a list, for 4 completions", "12=", [0, 1, 2, 3]),
]
# one bad row: the message names it and no others ("; rewards", not "(and 0 more of 4)")
PER_ROW = [
    (none_on_row_1, "returned None for prompt '34=' and completion '7'; rewards", "34=", [1]),
    (nan_on_row_2, "returned nan for prompt '56=' and completion '11'; rewards", "56=", [2]),
    (inf_on_row_3, "returned inf for prompt '78=' and completion '15'; rewards", "78=", [3]),
    (text_on_row_0, "returned '1.0' for prompt '12=' and completion '3'; rewards", "12=", [0]),
    (pair_on_row_2, "returned tensor([1., 2.]) for prompt '56=' and completion '11'; rewards", "56=", [2]),
]


@pytest.mark.parametrize(("fn", "what", "prompt", "rows"), WHOLE_CALL + PER_ROW)
def test_fail_policy_raises_with_the_function_the_prompt_and_the_fix(fn, what, prompt, rows):
    with pytest.raises(RewardError) as caught:
        score([matches, fn], make_rollout())
    message = str(caught.value)
    assert f"reward function {fn.__name__!r} {what}" in message
    assert repr(prompt) in message
    assert FIX in message and "model.reward_errors.value (now 0.0)" in message
    assert isinstance(caught.value, ValueError)


def test_fail_policy_chains_the_original_exception_and_names_the_row_that_raises_alone():
    with pytest.raises(RewardError) as caught:
        score([raises], make_rollout())
    assert isinstance(caught.value.__cause__, ZeroDivisionError)
    assert (
        "raised ZeroDivisionError: float division by zero on a batch of 4 completions; scored alone, prompt '56=' "
        "with completion '11' (row 2) raises ZeroDivisionError" in str(caught.value)
    )


def test_a_service_that_fails_is_reported_once_and_not_called_again_row_by_row():
    from gpo.envs.http import ServiceError

    calls = []

    def judge(prompts, completions, **kwargs):
        calls.append(len(prompts))
        raise ServiceError("the judge at http://127.0.0.1:9 does not answer")

    with pytest.raises(RewardError) as caught:
        score([judge], make_rollout())
    assert calls == [4]  # the batch's call alone: every row would wait for the service again
    assert str(caught.value).count("does not answer") == 1, str(caught.value)
    assert isinstance(caught.value.__cause__, ServiceError)


@pytest.mark.parametrize(("fn", "what", "prompt", "rows"), WHOLE_CALL + PER_ROW)
def test_score_policy_replaces_the_failed_samples_counts_them_and_warns_once(fn, what, prompt, rows, caplog):
    with caplog.at_level(logging.WARNING, logger="gpo.rewards.runner"):
        scored = score([matches, fn], make_rollout(), RewardErrors(policy="score", value=-1.0))
    expected = torch.tensor([-1.0 if row in rows else 2.0 for row in range(4)])
    torch.testing.assert_close(scored.values[:, 1], expected)
    torch.testing.assert_close(scored.values[:, 0], torch.tensor([1.0, 1.0, 0.0, 1.0]))  # the good one untouched
    assert scored.replaced == {"matches": 0, fn.__name__: len(rows)}
    [record] = caplog.records
    assert f"reward function {fn.__name__!r}" in record.getMessage()
    assert f"scored {len(rows)} sample(s) as -1.0" in record.getMessage()
    assert FIX not in record.getMessage()


def test_score_policy_names_the_first_prompt_and_batch_size_of_a_call_that_raised(caplog):
    with caplog.at_level(logging.WARNING, logger="gpo.rewards.runner"):
        score([raises], make_rollout(), RewardErrors(policy="score"))
    [record] = caplog.records
    assert record.getMessage() == (
        "reward function 'raises' raised ZeroDivisionError: float division by zero on a batch of 4 completions "
        "(the first: prompt '12=', completion '3'); scored 4 sample(s) as 0.0."
    )


def test_score_policy_counts_every_bad_row_and_says_how_many():
    def two_nans(prompts, completions, **_):
        return [math.nan, 1.0, math.nan, 1.0]

    scored = score([two_nans], make_rollout(), RewardErrors(policy="score", value=0.5))
    torch.testing.assert_close(scored.values[:, 0], torch.tensor([0.5, 1.0, 0.5, 1.0]))
    assert scored.replaced == {"two_nans": 2}
    with pytest.raises(RewardError, match=r"returned nan for prompt '12=' and completion '3' \(and 1 more of 4\)"):
        score([two_nans], make_rollout())


def test_single_row_retries_are_bounded():
    calls = []

    def always_raises(prompts, completions, **_):
        calls.append(len(prompts))
        raise KeyError("answer")

    size = MAX_SINGLE_ROW_RETRIES + 36
    rollout = make_rollout([f"{i}=" for i in range(size)], ["1"] * size, ["1"] * size)
    with pytest.raises(RewardError, match=r"scored alone, prompt '0=' with completion '1' \(row 0\) raises KeyError"):
        score([always_raises], rollout)
    assert calls == [size, 1]  # the batch, then row 0 alone, which already raises

    calls.clear()

    def raises_on_batches(prompts, completions, **_):
        calls.append(len(prompts))
        if len(prompts) > 1:
            raise RuntimeError("needs one prompt")
        return [1.0]

    with pytest.raises(RewardError, match=r"raised RuntimeError: needs one prompt on a batch of 100 completions \("):
        score([raises_on_batches], rollout)
    assert calls == [size] + [1] * MAX_SINGLE_ROW_RETRIES


def test_a_single_row_retry_that_hangs_ends_the_retries():
    calls = []

    def hangs_alone(prompts, completions, **_):
        calls.append(len(prompts))
        if len(prompts) > 1:
            raise RuntimeError("batch")
        time.sleep(0.3)  # past timeout_s: abandoned
        return [1.0]

    with pytest.raises(RewardError, match=r"raised RuntimeError: batch on a batch of 4 completions \(the first"):
        score([hangs_alone], make_rollout(), RewardErrors(timeout_s=0.05))
    assert calls == [4, 1]  # row 0 alone hangs: rows 1-3 are not tried, each for another timeout_s


def test_an_empty_rollout_gives_an_empty_column_per_function():
    scored = score([matches, length], make_rollout([], [], []), RewardErrors(policy="score"))
    assert scored.values.shape == (0, 2) and scored.replaced == {"matches": 0, "length": 0}


def test_a_long_prompt_is_abbreviated_in_the_message():
    prompt = "Q" * 1000 + "tail="
    with pytest.raises(RewardError) as caught:
        score([nan_on_row_2], make_rollout(["a=", "b=", prompt, "c="]))
    message = str(caught.value)
    assert "characters cut" in message and "tail=" in message and "Q" * 101 not in message


def test_a_reward_is_named_by_its_name_attribute_then_its_function_name_then_its_class():
    def plain(prompts, completions, **_):
        return [0.0] * len(completions)

    named = lambda prompts, completions, **_: [0.0] * len(completions)  # noqa: E731
    named.name = "named"  # a lambda's __name__ is '<lambda>': the name attribute wins

    class Scorer:
        def __call__(self, prompts, completions, **_):
            return [0.0] * len(completions)

    assert [reward_name(fn) for fn in (plain, named, Scorer())] == ["plain", "named", "Scorer"]


# ---- timeout -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["fail", "score"])
def test_a_reward_function_that_hangs_is_abandoned_after_timeout_s(policy, caplog):
    release = threading.Event()

    def hangs(prompts, completions, **_):
        release.wait(10)
        return [1.0] * len(completions)

    errors = RewardErrors(policy=policy, value=-2.0, timeout_s=0.1)
    try:
        with caplog.at_level(logging.WARNING, logger="gpo.rewards.runner"):
            if policy == "fail":
                with pytest.raises(RewardError) as caught:
                    score([matches, hangs], make_rollout(), errors)
                message = str(caught.value)
                assert FIX in message
            else:
                scored = score([matches, hangs], make_rollout(), errors)
                torch.testing.assert_close(scored.values[:, 1], torch.full((4,), -2.0))
                assert scored.replaced == {"matches": 0, "hangs": 4}
                [record] = caplog.records
                message = record.getMessage()
    finally:
        release.set()  # let the abandoned thread finish rather than outlive the test
    assert (
        "reward function 'hangs' did not return within timeout_s=0.1 on a batch of 4 completions "
        "(the first: prompt '12=', completion '3'); its thread is abandoned" in message
    )


@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_a_slow_reward_function_is_reported_while_the_run_waits(caplog, timeout_s):
    def slow(prompts, completions, **_):
        time.sleep(0.3)
        return [1.0] * len(completions)

    errors = RewardErrors(timeout_s=timeout_s, warn_after_s=0.05)
    with caplog.at_level(logging.WARNING, logger="gpo.rewards.runner"):
        scored = score([slow], make_rollout(), errors)
    torch.testing.assert_close(scored.values[:, 0], torch.ones(4))  # it finished: its values count
    [record] = caplog.records
    limit = " (no timeout_s set)" if timeout_s is None else "; it is stopped after timeout_s=5.0"
    assert record.getMessage() == (
        "reward function 'slow' on a batch of 4 completions (the first: prompt '12=', completion '3') is still "
        f"running after 0 s{limit}; the run waits for it."
    )


def test_a_call_that_returns_before_warn_after_s_is_never_reported(caplog):
    with caplog.at_level(logging.WARNING, logger="gpo.rewards.runner"):
        score([matches], make_rollout(), RewardErrors(timeout_s=None, warn_after_s=0.05))
        time.sleep(0.1)  # past warn_after_s: a report left armed after the call would fire by now
    assert caplog.records == []


def test_a_reported_call_is_still_abandoned_after_timeout_s_in_all():
    release = threading.Event()

    def hangs(prompts, completions, **_):
        release.wait(10)
        return [1.0] * len(completions)

    errors = RewardErrors(policy="score", timeout_s=1.0, warn_after_s=0.9)
    started = time.perf_counter()
    try:
        scored = score([hangs], make_rollout(), errors)
    finally:
        release.set()
    # 0.9 s to the report, then 0.1 s more: 1.0 s in all, not warn_after_s + timeout_s = 1.9 s
    assert time.perf_counter() - started < 1.6
    assert scored.replaced == {"hangs": 4}


def test_an_abandoned_call_runs_in_a_daemon_thread_that_cannot_hold_the_process_open():
    release = threading.Event()

    def hangs(prompts, completions, **_):
        release.wait(10)
        return [1.0] * len(completions)

    try:
        score([hangs], make_rollout(), RewardErrors(policy="score", timeout_s=0.05))
        abandoned = [thread for thread in threading.enumerate() if thread.name == "reward hangs"]
        assert abandoned and all(thread.daemon for thread in abandoned)
    finally:
        release.set()


def test_the_default_timeout_is_finite():
    assert 0 < RewardErrors().timeout_s < float("inf") and RewardErrors().warn_after_s < RewardErrors().timeout_s


def test_a_reward_declared_bounded_runs_in_the_calling_thread_and_others_in_a_timed_one():
    threads = {}

    def record(name):
        def reward(prompts, completions, **_):
            threads[name] = threading.current_thread()
            return [1.0] * len(completions)

        reward.__name__ = name
        return reward

    scores = score([bounded_time(record("declared")), record("plain")], make_rollout(), RewardErrors(timeout_s=5.0))
    assert scores.values.tolist() == [[1.0, 1.0]] * 4
    assert threads["declared"] is threading.current_thread() and threads["plain"] is not threading.current_thread()
    assert exact_match.bounded_time and positional_match.bounded_time  # built-ins that are one pass over strings


def test_an_exception_inside_the_timeout_thread_reaches_the_caller():
    with pytest.raises(RewardError, match="raised ZeroDivisionError") as caught:
        score([raises], make_rollout(), RewardErrors(timeout_s=5.0))
    assert isinstance(caught.value.__cause__, ZeroDivisionError)


# ---- settings ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": "skip"}, "model.reward_errors.policy='skip' is not valid; choose 'fail' or 'score'"),
        ({"value": math.nan}, "model.reward_errors.value=nan must be a finite number"),
        (
            {"timeout_s": 0.0},
            r"model.reward_errors.timeout_s=0.0 must be a number of seconds > 0, or null for no limit",
        ),
        ({"timeout_s": math.inf}, r"model.reward_errors.timeout_s=inf must be a number of seconds > 0, or null"),
        ({"warn_after_s": 0.0}, r"model.reward_errors.warn_after_s=0.0 must be a number of seconds > 0"),
        ({"warn_after_s": math.inf}, r"model.reward_errors.warn_after_s=inf must be a number of seconds > 0"),
    ],
)
def test_invalid_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RewardErrors(**kwargs)


def test_settings_parse_from_the_command_line_and_yaml():
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--reward_errors", type=RewardErrors, default=RewardErrors())
    config = parser.parse_args(["--reward_errors.policy=score", "--reward_errors.timeout_s=2.5"])
    assert parser.instantiate(config).reward_errors == RewardErrors(policy="score", timeout_s=2.5)
    config = parser.parse_string("reward_errors: {policy: score, value: -1}")
    assert parser.instantiate(config).reward_errors == RewardErrors(policy="score", value=-1.0)
