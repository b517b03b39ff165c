"""Step rewards of multi-turn episodes: turn credit, the group baseline over taken turns, per-token spreading."""

import math

import pytest
import torch

from gpo.algo import SequenceClipGate, StepRewards
from gpo.algo.turns import spread_over_tokens, turn_advantage, turn_credit


def test_turn_credit_modes_hand_worked():
    rewards = torch.tensor([[0.0, 0.5, 1.0], [0.25, 0.0, 0.0]])
    valid = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # decision_stepwise: each turn its own reward (the invalid third turn of row 1 is 0)
    assert turn_credit(rewards, valid, "decision_stepwise").tolist() == [[0.0, 0.5, 1.0], [0.25, 0.0, 0.0]]
    # env_sparse: reward-to-go, row 0: 0 + .5 + 1 = 1.5, .5 + 1 = 1.5, 1; row 1: .25, 0, (invalid) 0
    assert turn_credit(rewards, valid, "env_sparse").tolist() == [[1.5, 1.5, 1.0], [0.25, 0.0, 0.0]]
    with pytest.raises(ValueError, match="decision_stepwise"):
        turn_credit(rewards, valid, "off")
    # a turn not taken is NaN in the rollout's turn_rewards: it must not reach the sums
    nan = torch.where(valid.bool(), rewards, math.nan)
    assert turn_credit(nan, valid, "env_sparse").tolist() == [[1.5, 1.5, 1.0], [0.25, 0.0, 0.0]]


def test_turn_advantage_centres_on_the_group_mean_of_taken_turns():
    credit = torch.tensor([[1.0, 3.0], [2.0, 0.0], [5.0, 5.0]])
    valid = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    group = torch.tensor([0, 0, 1])
    # group 0 took turns with credit 1, 3, 2: mean 2; group 1: 5, 5, mean 5. beta = 0.5
    adv = turn_advantage(credit, valid, group, beta=0.5)
    assert adv.tolist() == [[-0.5, 0.5], [0.0, 0.0], [0.0, 0.0]]


def test_spread_over_tokens():
    per_turn = torch.tensor([[1.0, 2.0]])
    turn_index = torch.tensor([[0, 0, -1, -1, 1, -1]])  # two policy turns, an observation between, padding after
    assert spread_over_tokens(per_turn, turn_index).tolist() == [[1.0, 1.0, 0.0, 0.0, 2.0, 0.0]]


def test_per_turn_advantages_reach_their_turns_under_gspo_token():
    """With ratio 1 the GSPO-token gradient of token t is -A_t / |o| * grad logp_t: each turn pushed by its own
    advantage, environment tokens (mask 0) by nothing."""
    logp = torch.tensor([[-1.0, -1.0, -2.0, -1.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])  # token 1 is an environment token
    adv = torch.tensor([[2.0, 0.0, -1.0, -1.0]])  # turn 0: +2, turn 1: -1
    loss, _ = SequenceClipGate(per_token_advantage=True)(logp, logp.detach(), adv, mask)
    (loss * mask).sum().div(mask.sum()).backward()
    assert logp.grad[0].tolist() == pytest.approx([-2 / 3, 0.0, 1 / 3, 1 / 3])  # token mean over 3 policy tokens


def test_step_rewards_from_a_rollouts_turn_records_hand_worked():
    # two episodes of one prompt: turns (1, 0) and (0 and no second turn); decision_stepwise credit 1, 0, 0
    turn_rewards = torch.tensor([[1.0, 0.0], [0.0, math.nan]])
    turn_index = torch.tensor([[0, -1, 1, -1], [0, 0, -1, -1]])  # tokens: turn 0, env, turn 1, padding
    adv = StepRewards(mode="decision_stepwise", beta=2.0)(turn_rewards, torch.tensor([7, 7]), turn_index)
    # group mean of taken turns: (1 + 0 + 0) / 3 = 1/3; beta 2: turn 0 of row 0 gets 2 x 2/3, the others -2/3
    expected = torch.tensor([[4 / 3, 0.0, -2 / 3, 0.0], [-2 / 3, -2 / 3, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected)


def test_bad_settings_name_the_choices():
    with pytest.raises(ValueError, match="decision_stepwise, env_sparse"):
        StepRewards(mode="dense")
    with pytest.raises(ValueError, match="beta=-1"):
        StepRewards(mode="env_sparse", beta=-1.0)


def test_turn_advantage_of_a_group_with_no_turn_taken_is_zero_not_nan():
    """turn_advantage: beta (c - mean_g c) on valid turns, 0 elsewhere; mean over 0 taken turns must not be 0/0."""
    credit = torch.tensor([[1.0, 3.0], [0.0, 0.0], [0.0, 0.0]])
    valid = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])  # group 1 (rows 1, 2): no episode took a turn
    adv = turn_advantage(credit, valid, torch.tensor([0, 1, 1]), beta=1.0)
    # group 0: mean (1 + 3) / 2 = 2 -> (-1, 1); group 1: nothing valid -> zeros
    assert adv.tolist() == [[-1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
