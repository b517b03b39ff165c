import math

import pytest
import torch

from gpo.algo import RolloutCorrection, mismatch_metrics

TRAIN = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 9.0]])
ROLLOUT = torch.tensor([[-1.2, -1.0, -0.5], [-1.5, -1.4, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_tis_token_truncates_each_ratio():
    # w = exp(train - rollout): e^0.2 = 1.2214, e^-1 = 0.3679, 1 | e^0.5 = 1.6487, e^0.4 = 1.4918; cap 1.5
    weight, metrics = RolloutCorrection(mode="tis", level="token", cap=1.5)(TRAIN, ROLLOUT, MASK)
    expected = torch.tensor([[math.exp(0.2), math.exp(-1.0), 1.0], [1.5, math.exp(0.4), 0.0]])
    torch.testing.assert_close(weight, expected)
    assert metrics["correction/capped_frac"].item() == pytest.approx(1 / 5)


def test_mis_sequence_masks_whole_sequences_and_weighs_the_kept_ones():
    # sequence log-ratios: 0.2 - 1 + 0 = -0.8 -> w = 0.449 (kept, weighted by w, as TRL's sequence_mask);
    # 0.5 + 0.4 = 0.9 -> w = 2.46 (> 2: dropped)
    weight, _ = RolloutCorrection(mode="mis", level="sequence", cap=2.0)(TRAIN, ROLLOUT, MASK)
    torch.testing.assert_close(weight, torch.tensor([[math.exp(-0.8)] * 3, [0.0, 0.0, 0.0]]))


def test_tis_sequence_uses_the_product_of_ratios():
    weight, _ = RolloutCorrection(mode="tis", level="sequence", cap=2.0)(TRAIN, ROLLOUT, MASK)
    torch.testing.assert_close(weight, torch.tensor([[math.exp(-0.8)] * 3, [2.0, 2.0, 0.0]]))


def test_weights_carry_no_gradient():
    train = TRAIN.clone().requires_grad_(True)
    weight, _ = RolloutCorrection()(train, ROLLOUT, MASK)
    assert not weight.requires_grad


def test_mismatch_metrics_hand_worked():
    # |rollout - train| over real tokens: 0.2, 1.0, 0.0, 0.5, 0.4
    metrics = mismatch_metrics(TRAIN, ROLLOUT, MASK)
    assert metrics["mismatch/abs_diff_max"].item() == pytest.approx(1.0)
    assert metrics["mismatch/abs_diff_mean"].item() == pytest.approx(2.1 / 5)
    assert metrics["mismatch/kl"].item() >= 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"mode": "clip"}, "'tis' or 'mis'"), ({"level": "turn"}, "'token' or 'sequence'"), ({"cap": 0}, "cap=0")],
)
def test_invalid_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutCorrection(**kwargs)


def test_mis_keeps_a_ratio_exactly_at_the_cap():
    """MIS weight w 1[w <= C] (inclusive): with C = 1, on-policy tokens (w = e^0 = 1 exactly) keep weight 1."""
    train = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    rollout = torch.tensor([[-1.0, -2.5, -0.25]], dtype=torch.float64)  # w = 1 (at the cap), e^0.5 (out), e^-0.25
    weight, _ = RolloutCorrection(mode="mis", level="token", cap=1.0)(train, rollout, torch.ones(1, 3))
    expected = torch.tensor([[1.0, 0.0, math.exp(-0.25)]], dtype=torch.float64)
    torch.testing.assert_close(weight, expected)
    # sequence level: log-ratios sum to 0 -> w = 1 = C: the whole sequence kept with weight 1
    train_seq = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    rollout_seq = torch.tensor([[-1.5, -1.5]], dtype=torch.float64)  # +0.5 - 0.5 = 0 exactly
    weight, _ = RolloutCorrection(mode="mis", level="sequence", cap=1.0)(train_seq, rollout_seq, torch.ones(1, 2))
    torch.testing.assert_close(weight, torch.ones(1, 2, dtype=torch.float64))
