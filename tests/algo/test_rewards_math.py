"""Reward mixers and token weights."""

import importlib
import statistics
from pathlib import Path

import pytest
import torch
import yaml

from gpo.algo import (
    EnvEventOutcomeBlend,
    GroupNormalizedSum,
    NoGate,
    OverlongFilter,
    PolicyObjective,
    ReferenceProbWeight,
    TokenMean,
    WeightedSum,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SCORES = torch.tensor([[1.0, 10.0], [0.0, 30.0], [1.0, 20.0], [0.0, 20.0]])
GROUP = torch.tensor([0, 0, 1, 1])


def test_weighted_sum_hand_worked():
    # 1*0.5 + 10*0.1 = 1.5; 0 + 3 = 3; 0.5 + 2 = 2.5; 0 + 2 = 2
    reward = WeightedSum(weights=[0.5, 0.1])(SCORES, GROUP)
    torch.testing.assert_close(reward, torch.tensor([1.5, 3.0, 2.5, 2.0]))
    torch.testing.assert_close(WeightedSum()(SCORES, GROUP), SCORES.sum(-1))


def test_gdpo_normalises_each_reward_within_its_group():
    # group 0: reward 0 is (1, 0) -> (+1, -1); reward 1 is (10, 30) -> (-1, +1)
    # group 1: reward 0 is (1, 0) -> (+1, -1); reward 1 is (20, 20) -> constant -> (0, 0)
    # weights (1, 0.5): (1 - 0.5, -1 + 0.5, 1 + 0, -1 + 0)
    reward = GroupNormalizedSum(weights=[1.0, 0.5])(SCORES, GROUP)
    torch.testing.assert_close(reward, torch.tensor([0.5, -0.5, 1.0, -1.0]))


def test_gdpo_keeps_the_low_variance_reward_that_a_plain_sum_drowns():
    # in group 1 the 0/1 correctness decides everything under GDPO; the plain sum is dominated by the 10x scale
    plain = WeightedSum()(SCORES, GROUP)
    assert plain[1] > plain[0]  # raw sum prefers the wrong answer in group 0
    gdpo = GroupNormalizedSum()(SCORES, GROUP)
    assert gdpo[0] == gdpo[1] == 0  # the two signals cancel exactly once both are on the same scale


def test_gdpo_config_advantage_is_the_normalised_sum_whitened_over_the_batch():
    """configs/gdpo.yaml (GroupNormalizedSum, then GRPO with advantage_norm: batch) against GDPO's advantage written
    out: ``A_i = sum_k w_k (s_ik - mean_g s_k) / std_g s_k``, then ``(A_i - mean A) / std A`` over the batch
    (population stds), as TRL's normalize_then_sum computes it."""
    scores = [[1.0, 10.0], [0.0, 30.0], [1.0, 25.0], [0.0, 20.0], [1.0, 20.0], [1.0, 5.0]]
    groups, weights = [0, 0, 0, 1, 1, 1], [1.0, 0.5]

    def normalised(i, k):
        column = [scores[j][k] for j in range(6) if groups[j] == groups[i]]
        return (scores[i][k] - statistics.fmean(column)) / statistics.pstdev(column)

    summed = [sum(w * normalised(i, k) for k, w in enumerate(weights)) for i in range(6)]
    expected = [(a - statistics.fmean(summed)) / statistics.pstdev(summed) for a in summed]
    config = yaml.safe_load((CONFIGS / "gdpo.yaml").read_text())["model"]
    mixer = GroupNormalizedSum(**config["mixer"]["init_args"])
    module, _, name = config["algorithm"]["class_path"].rpartition(".")
    algorithm = getattr(importlib.import_module(module), name)(**config["algorithm"]["init_args"])
    advantage = algorithm.parts().advantage
    group = torch.tensor(groups)
    got = advantage(mixer(torch.tensor(scores), group), group, torch.ones(6, 1))[:, 0]
    torch.testing.assert_close(got.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-6)


def test_env_event_outcome_blend():
    scores = torch.tensor([[1.0, 0.5, 0.0], [0.0, 1.0, 1.0]])
    reward = EnvEventOutcomeBlend(env=1.0, event=0.2, outcome=0.5)(scores, torch.tensor([0, 0]))
    torch.testing.assert_close(reward, torch.tensor([1.1, 0.7]))
    with pytest.raises(ValueError, match="3 score columns"):
        EnvEventOutcomeBlend()(SCORES, GROUP)


def test_mixer_weight_count_must_match():
    with pytest.raises(ValueError, match="3 weights for 2 reward columns"):
        WeightedSum(weights=[1, 2, 3])(SCORES, GROUP)


def test_overlong_filter_drops_truncated_rows():
    mask = torch.ones(3, 4)
    filtered = OverlongFilter()(mask, truncated=torch.tensor([False, True, False]))
    torch.testing.assert_close(filtered, torch.tensor([[1.0] * 4, [0.0] * 4, [1.0] * 4]))


def test_reference_prob_weight_hand_worked():
    # pi_ref = 0.9 -> weight 0.1; pi_ref = 0.25 -> 0.75; padding 0
    ref_logp = torch.tensor([[0.9, 0.25, 0.5]]).log()
    weight = ReferenceProbWeight()(torch.tensor([[1, 1, 0]]), ref_logp=ref_logp)
    torch.testing.assert_close(weight, torch.tensor([[0.1, 0.75, 0.0]]))


def test_the_objective_applies_dropping_weights_to_the_mask_and_scaling_weights_to_the_advantage():
    objective = PolicyObjective(NoGate(), TokenMean(), token_weights=[OverlongFilter(), ReferenceProbWeight()])
    assert objective.requires == {"ref_logp"}
    mask = torch.ones(2, 2)
    torch.testing.assert_close(
        objective.loss_mask(mask, torch.tensor([True, False])), torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    )
    # 2 x (1 - 0.9) = 0.2, 2 x (1 - 0.25) = 1.5; -1 x 0.5 = -0.5 twice
    adv = torch.tensor([[2.0, 2.0], [-1.0, -1.0]])
    ref_logp = torch.tensor([[0.9, 0.25], [0.5, 0.5]]).log()
    torch.testing.assert_close(objective.weigh(adv, mask, ref_logp=ref_logp), torch.tensor([[0.2, 1.5], [-0.5, -0.5]]))
