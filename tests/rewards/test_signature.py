"""Reward functions checked against how they are called and the columns they need, before any sampling."""

import pytest

from gpo.rewards import exact_match, needs_columns
from gpo.rewards.signature import (
    check_reward_columns,
    check_reward_names,
    check_reward_signature,
    required_columns,
)

COLUMNS = {"data.path='train.jsonl'": ["prompt", "answer", "level"]}
COLUMNS_WITH_EXTRA = ["prompt", "answer", "level", "extra"]


def positional_only(prompts, completions, /, **columns):
    return [0.0] * len(completions)


def star_args(*args, **kwargs):
    return [0.0] * len(args[1])


def keyword_only_answer(prompts, completions, *, answer, **columns):
    return [float(c == a) for c, a in zip(completions, answer, strict=True)]


def takes_its_columns_by_name(prompts, completions, answer, level, completion_ids):
    return [0.0] * len(completions)


@pytest.mark.parametrize("fn", [positional_only, star_args, max, exact_match])  # max: no signature to read
def test_a_reward_callable_as_prompts_completions_and_columns_is_accepted(fn):
    check_reward_signature(fn, 0)


def test_a_reward_with_one_positional_parameter_is_refused_naming_its_entry():
    def completions_only(completions, /, **columns):
        return [0.0] * len(completions)

    with pytest.raises(
        TypeError, match=r"model.rewards\[3\] \(completions_only\) takes positional parameters \['completions'\]"
    ):
        check_reward_signature(completions_only, 3)


def test_required_columns_are_the_declared_ones_then_named_parameters_without_a_default():
    @needs_columns("answer")
    def reward(prompts, completions, answer, solution, hint="", *, level, **columns):
        return [0.0] * len(completions)

    # answer declared (and named: once); solution positional-or-keyword, level keyword-only; hint has a default
    assert required_columns(reward) == ["answer", "solution", "level"]
    assert required_columns(keyword_only_answer) == ["answer"]
    assert required_columns(positional_only) == []


def test_a_keyword_only_column_the_dataset_lacks_is_refused_before_sampling():
    with pytest.raises(ValueError, match=r"the reward keyword_only_answer needs column\(s\) \['answer'\]"):
        check_reward_columns([keyword_only_answer], {"data.path='x.jsonl'": ["prompt", "solution"]}, "prompt")
    check_reward_columns([keyword_only_answer], COLUMNS, "prompt")


def test_a_reward_without_kwargs_is_given_every_column_but_the_prompt_plus_completion_ids():
    # the dataset's answer and level, and the trainer's completion_ids; prompt is passed as prompts
    check_reward_columns([takes_its_columns_by_name], COLUMNS, "prompt")
    with pytest.raises(ValueError, match=r"is called with column\(s\) \['extra'\] from data.val_path"):
        check_reward_columns([takes_its_columns_by_name], {"data.val_path": COLUMNS_WITH_EXTRA}, "prompt")


def test_two_rewards_with_one_name_are_refused_and_distinct_names_pass():
    check_reward_names([exact_match, positional_only, star_args])
    with pytest.raises(ValueError, match=r"model.rewards\[0\], model.rewards\[2\] are all named 'exact_match'"):
        check_reward_names([exact_match, positional_only, exact_match])


def test_an_import_path_given_in_python_is_refused_saying_paths_are_for_yaml():
    """The message offered an import path as the fix to a user who had just given one."""
    with pytest.raises(TypeError, match=r"rewards\[0\]='gpo.rewards.exact_match' is not callable; .* is read in YAML; "
                                        r"in Python, import the function"):  # fmt: skip
        check_reward_signature("gpo.rewards.exact_match", 0)
