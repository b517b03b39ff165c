"""Per-token weights of the objective, fixed for a step: overlong filtering and reference-probability weighting."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import Tensor

from gpo.algo.state import PartState


class TokenWeight(PartState, ABC):
    """A factor on each token's advantage, computed once per step.

    A factor ``w[B, T]`` on each token's advantage, computed once per step from what the step knows (no
    gradient): ``A'_t = w_t A_t``.

    A weight that only keeps or drops tokens (``drops_tokens``: ``w`` is 0 or 1) acts on the loss mask instead, so
    the dropped tokens also leave the loss normaliser (the token or sequence count). ``requires`` names the step
    inputs it reads, among ``truncated`` (``[B]`` bool, no EOS within the budget) and ``ref_logp`` (``[B, T]``
    reference log-probs; the trainer then scores the reference model).
    """

    requires: ClassVar[frozenset[str]] = frozenset()
    drops_tokens: ClassVar[bool] = False

    @abstractmethod
    def __call__(self, mask: Tensor, **inputs: Tensor) -> Tensor:
        """``mask[B, T]`` and the inputs in ``requires`` -> ``w[B, T]``, zero where ``mask`` is 0."""


class OverlongFilter(TokenWeight):
    """DAPO's overlong filtering: completions cut at the length limit are left out of the loss.

    DAPO is Yu et al. 2025. Completions that hit the length limit without EOS leave the
    loss, so a policy is not punished for an answer it was not allowed to finish.

    ``w_i = 0`` for a truncated completion, 1 otherwise; a dropping weight, so truncated completions also leave the
    normaliser.
    """

    requires = frozenset({"truncated"})
    drops_tokens = True

    def __call__(self, mask: Tensor, *, truncated: Tensor) -> Tensor:
        return mask * (~truncated.bool())[:, None].to(mask.dtype)


class ReferenceProbWeight(TokenWeight):
    """Each token's advantage scaled by ``1 - pi_ref(o_t)``.

    Scale each token's advantage by ``1 - pi_ref(o_t)``: tokens the reference model already predicts
    confidently carry little of the update, uncertain ones carry most of it.

    ``A'_t = A_t (1 - pi_ref(o_t))``. This is the token weighting some texts (Haggai Roitman's textbook chapter
    on GRPO) attribute to Dr. GRPO; the Dr. GRPO paper itself (Liu et al. 2025, "Understanding R1-Zero-Like
    Training: A Critical Perspective") removes the length and std normalisations instead (see the
    ``DrGRPO`` preset), so here it is a separate, optional part. The trainer scores the reference model for it.
    """

    requires = frozenset({"ref_logp"})

    def __call__(self, mask: Tensor, *, ref_logp: Tensor) -> Tensor:
        weight = -torch.expm1(ref_logp.detach())  # 1 - pi_ref, accurate near pi_ref = 1
        return torch.where(mask.bool(), weight, 0.0)
