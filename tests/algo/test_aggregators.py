import math

import pytest
import torch

from gpo.algo import ClipGate, ConstantNorm, GeometricMeanGate, SequenceClipGate, SequenceMean, SequenceSum, TokenMean
from gpo.algo.masked import masked_stats

LOSS = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0], [2.0, 2.0, 5.0, 7.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])


def test_token_mean_hand_worked():
    # real tokens: 1+2+3 + 4 + 2+2+5+7 = 26 over 8 tokens
    assert TokenMean()(LOSS, MASK).item() == pytest.approx(26 / 8)


def test_sequence_mean_hand_worked():
    # per-sequence means 6/3 = 2, 4/1 = 4, 16/4 = 4 over the 3 non-empty sequences
    assert SequenceMean()(LOSS, MASK).item() == pytest.approx((2 + 4 + 4) / 3)


def test_sequence_sum_hand_worked():
    # per-sequence sums 6, 4, 16 over 3 non-empty sequences
    assert SequenceSum()(LOSS, MASK).item() == pytest.approx(26 / 3)


def test_constant_norm_hand_worked():
    # Dr. GRPO token_sum_norm: 26 / (4 samples x max_length 10), every row counted
    assert ConstantNorm(max_length=10)(LOSS, MASK).item() == pytest.approx(26 / 40)


def test_values_outside_the_mask_are_ignored_even_if_nan():
    loss = LOSS.clone()
    loss[MASK == 0] = float("nan")
    for agg in (TokenMean(), SequenceMean(), SequenceSum(), ConstantNorm(max_length=4)):
        assert torch.isfinite(agg(loss, MASK))


def test_empty_batch_gives_zero_not_nan():
    mask = torch.zeros(2, 3)
    for agg in (TokenMean(), SequenceMean(), SequenceSum()):
        assert agg(torch.ones(2, 3), mask).item() == 0


def test_constant_norm_refuses_bad_length():
    with pytest.raises(ValueError, match="max_length=0"):
        ConstantNorm(max_length=0)


AGGREGATORS = [TokenMean(), SequenceMean(), SequenceSum(), ConstantNorm(max_length=6)]
GATES = [ClipGate(clip_low=0.2, clip_high=0.28), SequenceClipGate(clip_low=0.1, clip_high=0.1), GeometricMeanGate()]


@pytest.mark.parametrize("aggregator", AGGREGATORS, ids=lambda a: type(a).__name__)
@pytest.mark.parametrize("gate", GATES, ids=lambda g: type(g).__name__)
@pytest.mark.parametrize("splits", [[2, 3], [1, 1, 1, 1, 1], [4, 1]])
def test_micro_batching_leaves_the_gradient_unchanged(batch, aggregator, gate, splits):
    # whole minibatch in one pass
    loss, _ = gate(batch.logp, batch.old_logp, batch.adv, batch.mask)
    (full,) = torch.autograd.grad(aggregator(loss, batch.mask), batch.logp)
    # the same minibatch in micro-batches, normaliser from the whole step, gradients accumulated
    normaliser = aggregator.normaliser(batch.mask)
    accumulated = torch.zeros_like(batch.logp)
    for rows in torch.arange(5).split(splits):
        loss, _ = gate(batch.logp[rows], batch.old_logp[rows], batch.adv[rows], batch.mask[rows])
        (grad,) = torch.autograd.grad(aggregator(loss, batch.mask[rows], normaliser), batch.logp)
        accumulated += grad
    torch.testing.assert_close(accumulated, full)


def test_normaliser_is_additive_over_micro_batches(batch):
    for aggregator in AGGREGATORS:
        parts = sum(aggregator.normaliser(batch.mask[rows]) for rows in torch.arange(5).split([2, 3]))
        torch.testing.assert_close(parts, aggregator.normaliser(batch.mask))


def test_per_micro_batch_normalisation_would_differ(batch):
    # the control: normalising each micro-batch by its own token count changes the gradient
    gate, aggregator = ClipGate(), TokenMean()
    loss, _ = gate(batch.logp, batch.old_logp, batch.adv, batch.mask)
    (full,) = torch.autograd.grad(aggregator(loss, batch.mask), batch.logp)
    naive = torch.zeros_like(batch.logp)
    for rows in torch.arange(5).split([2, 3]):
        loss, _ = gate(batch.logp[rows], batch.old_logp[rows], batch.adv[rows], batch.mask[rows])
        (grad,) = torch.autograd.grad(aggregator(loss, batch.mask[rows]) / 2, batch.logp)
        naive += grad
    assert not torch.allclose(naive, full)


def test_masked_stats_hand_worked_and_blind_to_values_outside_the_mask():
    x = torch.tensor([[0.5, 2.0, math.nan], [-1.0, math.inf, 3.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    stats = masked_stats(x, mask)
    assert [stats[k].item() for k in ("min", "mean", "max")] == [-1.0, pytest.approx(1.5 / 3), 2.0]
    empty = masked_stats(x, torch.zeros_like(mask))
    assert [empty[k].item() for k in ("min", "mean", "max")] == [0.0, 0.0, 0.0]
