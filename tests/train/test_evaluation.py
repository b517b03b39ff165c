"""What counts as a pass in the held-out evaluation, and the metrics an evaluation reports."""

from types import SimpleNamespace

import pytest
import torch

from gpo.rollout import Sampling
from gpo.train.evaluation import Evaluation, evaluate, log_evaluation, passes


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


class StubCollector:
    """What ``evaluate`` reads of a ``Collector``: it hands out the given scores ``[B, K]`` (first the greedy pass's,
    then each seed's), records how it was asked to sample, and counts one reward error per scored batch."""

    def __init__(self, *scores):
        self.rewards, self.mixer = [right, length_penalty], SimpleNamespace(weights=None)
        self.engine = SimpleNamespace(sampling=Sampling(temperature=0.5, top_p=0.5))
        self.scores, self.calls = list(scores), []

    def sample(self, batch, *, seed, greedy=False, n=None, sampling=None):
        self.calls.append({"seed": seed, "greedy": greedy, "n": n, "sampling": sampling})
        return SimpleNamespace(group=torch.arange(len(batch["prompt"])).repeat_interleave(n))  # [B]

    def score(self, rollout, errors):
        rollout.scores = self.scores.pop(0)  # [B, K]
        rollout.reward = torch.zeros(len(rollout.scores))  # the mixer's, which the evaluation does not read
        assert rollout.scores.shape[0] == rollout.group.shape[0]
        errors.update({"right": 1})
        return rollout


def test_an_evaluation_averages_pass_at_k_over_the_seeds_and_counts_each_passs_reward_errors():
    """Two prompts, k=2 samples each, two seeds; a pass is a weighted sum of at least 0.5.

    greedy: sums [0.75, -0.25]: pass@1 = 1/2, the reward's mean 0.25, right's 0.5, the penalty's -0.25.
    seed 1: sums [1.0, 0.0 | 0.0, 0.0]: pass@1 = 1/4, pass@2 = 1/2 (prompt 0 has one pass), reward 0.25.
    seed 2: sums [1.0, 1.0 | 0.0, 1.0]: pass@1 = 3/4, pass@2 = 2/2, reward 0.75.
    """
    greedy = torch.tensor([[1.0, -0.25], [0.0, -0.25]])  # [B, K]: right, length_penalty
    seed_1 = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    seed_2 = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    collector = StubCollector(greedy, seed_1, seed_2)
    settings = Evaluation(samples=2, pass_threshold=0.5, seeds=(1, 2), top_p=0.9)
    got = {k: round(float(v), 6) for k, v in evaluate(collector, {"prompt": ["a", "b"]}, 0, settings).items()}
    assert got == {
        "val/reward_greedy": 0.25,
        "val/pass@1_greedy": 0.5,
        "val/reward_greedy/right": 0.5,
        "val/reward_greedy/length_penalty": -0.25,
        "val/reward_errors_greedy/right": 1.0,
        "val/reward_sampled": 0.5,  # (0.25 + 0.75) / 2
        "val/pass@1_sampled": 0.5,  # (1/4 + 3/4) / 2
        "val/pass@2": 0.75,  # (1/2 + 1) / 2
        "val/reward_sampled/right": 0.5,
        "val/reward_sampled/length_penalty": 0.0,
        "val/reward_errors_sampled/right": 2.0,  # one per seed, the greedy pass's not among them
    }
    greedy_call, *sampled_calls = collector.calls
    assert (greedy_call["greedy"], greedy_call["n"]) == (True, 1)
    assert [(c["greedy"], c["n"]) for c in sampled_calls] == [(False, 2), (False, 2)]
    # the evaluation's own top-p, the engine's temperature where the evaluation sets none
    assert all(c["sampling"] == Sampling(temperature=0.5, top_p=0.9) for c in sampled_calls)
    assert len({c["seed"] for c in collector.calls}) == 3  # each seed samples a stream of its own


def test_a_single_reward_is_not_logged_again_under_its_own_name():
    collector = StubCollector(torch.tensor([[1.0]]), torch.tensor([[1.0]]))
    collector.rewards = [right]
    got = evaluate(collector, {"prompt": ["a"]}, 0, Evaluation(samples=1))
    assert sorted(got) == sorted(["val/reward_greedy", "val/pass@1_greedy", "val/reward_errors_greedy/right",
                                  "val/reward_sampled", "val/pass@1_sampled", "val/pass@1",
                                  "val/reward_errors_sampled/right"])  # fmt: skip


def test_reward_error_counts_are_summed_over_batches_and_ranks_and_the_other_metrics_averaged():
    logged = []
    module = SimpleNamespace(log=lambda name, value, **how: logged.append((name, how)))
    metrics = {"val/reward_greedy": 0.5, "val/pass@2": 1.0, "val/reward_errors_sampled/right": 2.0}
    log_evaluation(module, {name: torch.tensor(value) for name, value in metrics.items()}, prompts=3)
    assert logged == [  # Lightning averages a metric over the batches (weighted by batch_size) unless told to sum
        ("val/reward_greedy", {"batch_size": 3, "prog_bar": True, "sync_dist": True}),
        ("val/pass@2", {"batch_size": 3, "prog_bar": False, "sync_dist": True}),
        ("val/reward_errors_sampled/right", {"batch_size": 3, "reduce_fx": "sum", "sync_dist": True}),
    ]


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"samples": 0}, "samples=0 must be >= 1"),
        ({"pass_threshold": float("inf")}, "pass_threshold=inf must be a finite number"),
        ({"seeds": ()}, "seeds is empty; give at least one seed"),
    ],
)
def test_an_evaluation_that_could_not_count_a_pass_is_refused_under_its_own_key(setting, message):
    with pytest.raises(ValueError, match=rf"^model\.evaluation\.{message}"):
        Evaluation(**setting)
