"""A training step's advantages, computed over every rank's rows: the estimator's, plus per-turn credit."""

from __future__ import annotations

from torch import Tensor

from gpo.algo.advantages import AdvantageEstimator
from gpo.algo.turns import StepRewards
from gpo.parallel import collectives
from gpo.rollout.base import Rollout


class StepCredit:
    """The advantage estimator over the step's rows gathered from every rank (group statistics and whitening see
    the whole step), then this rank's rows; plus ``step_rewards``' per-turn advantages for multi-turn episodes.

    Args:
        advantage: the preset's advantage estimator.
        step_rewards: per-turn advantages from the step rewards of multi-turn episodes, or None.
    """

    def __init__(self, advantage: AdvantageEstimator, step_rewards: StepRewards | None) -> None:
        self.advantage, self.step_rewards = advantage, step_rewards

    def __call__(self, rollout: Rollout, mask: Tensor) -> tuple[dict[str, Tensor], Tensor, Tensor]:
        """The step's rows over every rank (``collectives.gather_step``), their advantages ``[B_all, T_all]`` and
        this rank's ``adv[B, T]``."""
        step, rows = collectives.gather_step(rollout, mask)
        step_adv = self.advantage(step["reward"], step["group"], step["mask"])  # [B_all, T_all]
        if not isinstance(step_adv, Tensor) or step_adv.shape != step["mask"].shape:
            shape = list(step_adv.shape) if isinstance(step_adv, Tensor) else type(step_adv).__name__
            raise ValueError(
                f"the advantage estimator {type(self.advantage).__name__} returned {shape}; "
                f"AdvantageEstimator.__call__ returns adv[B, T] = {list(step['mask'].shape)}, one per token."
            )
        adv = step_adv[rows, : mask.shape[1]]  # [B, T]
        if self.step_rewards is not None:
            if rollout.turn_rewards is None:
                raise ValueError("model.step_rewards needs multi-turn rollouts: set model.engine to a MultiTurnEngine.")
            adv = adv + self.step_rewards(rollout.turn_rewards, rollout.group, rollout.turn_index) * mask
        return step, step_adv, adv
