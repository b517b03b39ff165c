"""Updates with a NaN/inf loss or gradient are skipped, not applied; too many in a row stop the run."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import torch
from torch import Tensor

from gpo.algo.objective import PolicyObjective

log = logging.getLogger(__name__)


class NonfiniteGuard:
    """Decides whether an optimiser update may be applied, and counts the ones that may not.

    Args:
        max_in_a_row: this many non-finite updates in a row raise ``FloatingPointError``
            (``optim.max_consecutive_nonfinite``).
    """

    def __init__(self, max_in_a_row: int) -> None:
        self.max_in_a_row, self.streak = max_in_a_row, 0

    def finite(
        self, loss: float, grad_norm: float, model: torch.nn.Module, step: int, inputs: Mapping[str, Tensor],
        objective: PolicyObjective | None = None,
    ) -> bool:  # fmt: skip
        """True when ``loss`` and ``grad_norm`` are finite (the streak restarts). Otherwise log a warning with the
        optimiser ``step``, the quantity, the ``inputs`` of the loss that are not finite themselves (the step's
        advantages, the log-probs it reads: checked only then, so a finite update pays nothing), or, when all are
        finite, the parts of ``objective`` that computed the loss from them (its gate, aggregator, ...), and the
        parameters whose gradients are not finite (call it before the gradients are zeroed), and return False; raise
        once the streak reaches ``max_in_a_row``."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.streak = 0
            return True
        self.streak += 1
        bad = [name for name, p in model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()]
        what = f"loss={loss}" if not math.isfinite(loss) else f"gradient norm={grad_norm}"
        causes = [name for name, value in inputs.items() if value.is_floating_point() and not value.isfinite().all()]
        if causes:
            where = f" (non-finite inputs: {', '.join(causes)})"
        else:
            parts = ", ".join(objective.part_names) if objective is not None else ""
            where = f" (its inputs are finite: made by {parts} or the policy's pass)" if parts else ""
        where += f" (non-finite gradients in {', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})" if bad else ""
        log.warning("optimiser step %d: %s%s; update skipped, weights unchanged (%d in a row)", step, what, where,
                    self.streak)  # fmt: skip
        if self.streak >= self.max_in_a_row:
            raise FloatingPointError(
                f"{self.streak} updates in a row had a non-finite loss or gradient (last at optimiser step {step}: "
                f"{what}{where}). Stopping. Lower optim.lr, check the rewards, the advantage estimator (when the "
                "advantages are not finite), the objective's parts of one's own (when its inputs are finite) and the "
                "policy's dtype, or raise optim.max_consecutive_nonfinite to tolerate more."
            )
        return False
