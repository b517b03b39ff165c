"""Per-token weights applied before the gate: overlong filtering and reference-probability weighting."""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_filter(mask: Tensor, truncated: Tensor) -> Tensor:
    """DAPO's overlong filtering: completions that hit the length limit without EOS leave the loss.

    ``mask[B, T]``, ``truncated[B]`` (True where no EOS was generated) -> the mask with those rows zeroed.
    """
    return mask * (~truncated.bool())[:, None].to(mask.dtype)


class ReferenceProbWeight:
    """Scale each token's advantage by ``1 - pi_ref(o_t)``: tokens the reference model already predicts
    confidently carry little of the update, uncertain ones carry most of it.

    ``A'_t = A_t (1 - pi_ref(o_t))``. This is the token weighting some texts (seed 002) attribute to
    Dr. GRPO; the Dr. GRPO paper itself removes the length and std normalisations instead (see the
    ``dr_grpo`` preset), so here it is a separate, optional part. Needs reference log-probs.
    """

    def __call__(self, adv: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
        weight = -torch.expm1(ref_logp.detach())  # 1 - pi_ref, accurate near pi_ref = 1
        return torch.where(mask.bool(), adv * weight, torch.zeros_like(adv))
