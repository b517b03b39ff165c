"""Loss aggregators: how per-token losses become the scalar that is differentiated.

Each aggregator splits into a *numerator* computed on whatever slice of the batch is at hand and a
*normaliser* computed once over the whole optimiser-step batch (all micro-batches, all ranks):

    loss(micro-batch) = numerator(micro-batch) / normaliser(whole step)

Every normaliser is a sum (of tokens, of sequences, ...), so it adds up across micro-batches and ranks,
and the micro-batch losses add up to the loss of the unsplit batch: accumulating their gradients gives
exactly the gradient of the whole batch. Called without a normaliser, an aggregator uses the mask given.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from gpo.algo.masked import masked_sum
from gpo.algo.state import PartState


def _non_empty(mask: Tensor) -> Tensor:
    """``[B]`` bool: sequences with at least one token in the loss."""
    return mask.bool().any(-1)


class LossAggregator(PartState, ABC):
    """``(per_token_loss[B, T], mask[B, T], normaliser) -> scalar``."""

    @abstractmethod
    def numerator(self, per_token_loss: Tensor, mask: Tensor) -> Tensor:
        """The part of the loss that is local to the rows given (a scalar)."""

    @abstractmethod
    def normaliser(self, mask: Tensor) -> Tensor:
        """The divisor contributed by these rows; sum it over every micro-batch and rank of the step."""

    def __call__(self, per_token_loss: Tensor, mask: Tensor, normaliser: Tensor | float | None = None) -> Tensor:
        if normaliser is None:
            normaliser = self.normaliser(mask)
        denominator = torch.as_tensor(normaliser, dtype=torch.float32, device=per_token_loss.device)
        return self.numerator(per_token_loss, mask) / denominator.clamp_min(1e-12)


class TokenMean(LossAggregator):
    """Mean over every token of the step: ``sum_{i,t} l_{i,t} / sum_i |o_i|`` (DAPO's token-level loss).

    Long completions weigh in proportion to their length, so long bad outputs are penalised in full.
    """

    def numerator(self, per_token_loss: Tensor, mask: Tensor) -> Tensor:
        return masked_sum(per_token_loss, mask)

    def normaliser(self, mask: Tensor) -> Tensor:
        return mask.sum().to(torch.float32)


class SequenceMean(LossAggregator):
    """Mean over sequences of each sequence's token mean: ``(1/G) sum_i (1/|o_i|) sum_t l_{i,t}`` (GRPO).

    Each completion has equal weight whatever its length. ``G`` counts sequences with at least one token
    in the loss (a sequence removed by overlong filtering does not dilute the rest).
    """

    def numerator(self, per_token_loss: Tensor, mask: Tensor) -> Tensor:
        lengths = mask.sum(-1).clamp_min(1)  # [B]
        return (masked_sum(per_token_loss, mask, dim=-1) / lengths).sum()

    def normaliser(self, mask: Tensor) -> Tensor:
        return _non_empty(mask).sum().to(torch.float32)


class SequenceSum(LossAggregator):
    """Mean over sequences of each sequence's token *sum*: ``(1/G) sum_i sum_t l_{i,t}``.

    The sequence-level REINFORCE estimate: each token counts fully and a completion's weight grows with its
    length. ``G`` counts sequences with at least one token.
    """

    def numerator(self, per_token_loss: Tensor, mask: Tensor) -> Tensor:
        return masked_sum(per_token_loss, mask)

    def normaliser(self, mask: Tensor) -> Tensor:
        return _non_empty(mask).sum().to(torch.float32)


class ConstantNorm(LossAggregator):
    """Dr. GRPO's aggregation: the token sum over a constant, not over the token count.

    The loss is ``sum_{i,t} l_{i,t} / (num_samples * max_length)`` (Dr. GRPO's
    ``token_sum_norm``).

    The divisor depends on neither the lengths nor the mask, which removes the length bias of a per-sequence
    or per-token mean. ``num_samples`` counts every row of the step, filtered or not.

    Args:
        max_length: the generation budget (max new tokens), the constant per sample.
    """

    def __init__(self, *, max_length: int) -> None:
        if max_length < 1:
            raise ValueError(f"max_length={max_length} must be >= 1 (the max completion length).")
        self.max_length = max_length

    def numerator(self, per_token_loss: Tensor, mask: Tensor) -> Tensor:
        return masked_sum(per_token_loss, mask)

    def normaliser(self, mask: Tensor) -> Tensor:
        return torch.tensor(float(mask.shape[0] * self.max_length), device=mask.device)
