import pytest
import torch

from gpo.algo import SequenceClipGate
from gpo.envs.step_rewards import check_step_rewards, spread_over_tokens, turn_advantage, turn_credit


def test_turn_credit_modes_hand_worked():
    rewards = torch.tensor([[0.0, 0.5, 1.0], [0.25, 0.0, 0.0]])
    valid = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # decision_stepwise: each turn its own reward (the invalid third turn of row 1 is 0)
    assert turn_credit(rewards, valid, "decision_stepwise").tolist() == [[0.0, 0.5, 1.0], [0.25, 0.0, 0.0]]
    # env_sparse: reward-to-go, row 0: 0 + .5 + 1 = 1.5, .5 + 1 = 1.5, 1; row 1: .25, 0, (invalid) 0
    assert turn_credit(rewards, valid, "env_sparse").tolist() == [[1.5, 1.5, 1.0], [0.25, 0.0, 0.0]]
    with pytest.raises(ValueError, match="decision_stepwise"):
        turn_credit(rewards, valid, "off")


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


def test_bad_settings_name_the_choices():
    with pytest.raises(ValueError, match="off, decision_stepwise, env_sparse"):
        check_step_rewards("dense", 1.0)
    with pytest.raises(ValueError, match="step_rewards_beta=-1"):
        check_step_rewards("env_sparse", -1.0)
