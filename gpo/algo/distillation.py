"""On-policy distillation: a teacher's per-token log-probs as (part of) the advantage."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from gpo.algo.gates.base import Metrics
from gpo.algo.masked import masked_mean


class TeacherKL:
    """On-policy distillation: the per-token reverse KL to a teacher, added to the advantage.

    The KL, ``KL(pi || pi_teacher)`` per token, acts as a penalty on the
    advantage, or as the whole advantage.

    ``k_t = sg(log pi(o_t) - log pi_teacher(o_t))`` is the sampled-token estimate of the reverse KL at position
    ``t``. The gate then sees ``A'_t = A_t - coef * k_t`` (RL with a distillation term), or, with ``replace``,
    ``A'_t = coef * sg(log pi_teacher(o_t) - log pi(o_t))`` (pure on-policy distillation: the teacher's per-token
    signal is the advantage and the rewards' advantage is ignored). ``-k_t`` is a reward per token, so any gate,
    mask and aggregator composes with it; a sequence-level gate averages it over the completion (use GSPO-token
    for per-token credit).

    It lives in the objective, not with the advantage estimators: those see rewards before any token is scored,
    and ``k_t`` needs the student's log-probs. They are the current policy's, detached, in each gradient pass (as
    prime-rl's distillation loss does): the policy gradient of ``KL(pi || pi_teacher)`` weights ``grad log pi`` by
    ``log pi - log pi_teacher`` of the policy being updated, and the ratio gate corrects for the tokens having been
    sampled by ``pi_old``. On the first update of a rollout it equals the sampling policy's signal.

    Input beyond log-probs: ``teacher_logp[B, T]``, the teacher's log-probs of the sampled tokens, computed once per
    step.

    Args:
        coef: weight of the distillation signal (``lambda``).
        replace: use the teacher signal as the advantage instead of adding it to the rewards' advantage.
    """

    requires: ClassVar[frozenset[str]] = frozenset({"teacher_logp"})

    def __init__(self, *, coef: float = 1.0, replace: bool = False) -> None:
        if not coef > 0:
            raise ValueError(f"coef={coef} must be > 0.")
        self.coef, self.replace = coef, replace

    def __call__(self, adv: Tensor, logp: Tensor, mask: Tensor, *, teacher_logp: Tensor) -> tuple[Tensor, Metrics]:
        """``adv``, ``logp``, ``mask``, ``teacher_logp`` ``[B, T]`` -> ``(A'[B, T], metrics)``, ``A'`` 0 on padding."""
        on = mask.bool()
        kl = torch.where(on, logp.detach() - teacher_logp.detach(), 0.0)  # [B, T]
        base = 0.0 if self.replace else torch.where(on, adv, 0.0)  # [B, T]
        return base - self.coef * kl, {"distill/reverse_kl": masked_mean(kl, mask)}
