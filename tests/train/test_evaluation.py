"""What counts as a pass in the held-out evaluation."""

import pytest
import torch

from gpo.train.evaluation import Evaluation, passes


def right(prompts, completions, **_):
    return [0.0] * len(completions)  # the scores below stand for what it returned


def length_penalty(prompts, completions, **_):
    return [0.0] * len(completions)


# three completions: right with a penalty, wrong with a penalty, right with a bonus
SCORES = torch.tensor([[1.0, -0.1], [0.0, -0.1], [1.0, 0.2]])  # [B, K]: right, length_penalty
SUMMED = SCORES.sum(1)  # [0.9, -0.1, 1.2]: the weighted sum with weights 1


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (Evaluation(), [0.0, 0.0, 1.0]),  # the sum at or above 1.0: the penalty fails a right answer
        (Evaluation(pass_threshold=0.9), [1.0, 0.0, 1.0]),
        (Evaluation(pass_reward="right"), [1.0, 0.0, 1.0]),  # the right answers, whatever the penalty
        (Evaluation(pass_reward="length_penalty", pass_threshold=0.0), [0.0, 0.0, 1.0]),
    ],
)
def test_a_pass_reads_the_weighted_sum_or_the_named_reward_alone(settings, expected):
    assert passes(SCORES, SUMMED, [right, length_penalty], settings).tolist() == expected
