"""The policy-gradient family: a group baseline, the plain policy gradient, and PPO clipping on request."""

from __future__ import annotations

from typing import Literal

from gpo.algo.advantages import BatchWhitenedAdvantage, GroupNormAdvantage, LeaveOneOutAdvantage, MeanScaledAdvantage
from gpo.algo.aggregators import ConstantNorm, LossAggregator, SequenceMean, TokenMean
from gpo.algo.presets.base import AdvantageNorm, Algorithm, Parts, PPOClip, check_norm, gate_for

LossAggMode = Literal["token_mean", "token_sum_norm"]


class GRPO(Algorithm):
    """GRPO (DeepSeekMath, Shao et al. 2024): group mean / std advantages and the plain policy gradient.

    The loss is the mean over sequences of their token means. The default algorithm, as in flat GRPO configs.

    Args:
        advantage_norm: divide the centred reward by the ``group``'s std or the whole ``batch``'s.
        ppo_clip: layer PPO ratio clipping on the gradient (``ppo_clip: {}`` for clip distances 0.4 / 0.5).
    """

    def __init__(self, *, advantage_norm: AdvantageNorm = "group", ppo_clip: PPOClip | None = None) -> None:
        self.advantage, self.gate = GroupNormAdvantage(scale=check_norm(advantage_norm)), gate_for(ppo_clip)

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        return Parts(self.advantage, self.gate, SequenceMean())


class RLOO(Algorithm):
    """RLOO (Ahmadian et al. 2024): a leave-one-out baseline, ``n / (n - 1)`` x the mean-centred reward.

    Its baseline is a group statistic, so there is no batch normalisation (refused: use ``ReinforcePP`` for that).

    Args:
        ppo_clip: layer PPO ratio clipping on the gradient.
    """

    def __init__(self, *, ppo_clip: PPOClip | None = None) -> None:
        self.gate = gate_for(ppo_clip)

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        return Parts(LeaveOneOutAdvantage(), self.gate, SequenceMean())


class ReinforcePP(Algorithm):
    """REINFORCE++ (Hu et al. 2025): the group mean subtracted, then whitened over the whole batch.

    Batch normalisation is part of the method, so there is no setting for it.

    Args:
        ppo_clip: layer PPO ratio clipping on the gradient.
    """

    def __init__(self, *, ppo_clip: PPOClip | None = None) -> None:
        self.gate = gate_for(ppo_clip)

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        return Parts(BatchWhitenedAdvantage(), self.gate, SequenceMean())


class DrGRPO(Algorithm):
    """Dr. GRPO (Liu et al. 2025): mean-centred advantages (no std), and no length normalisation.

    With ``token_sum_norm`` the loss is the token sum divided by ``samples x max_completion_length``.

    Args:
        loss_agg_mode: ``token_mean`` (mean over the step's tokens) or ``token_sum_norm``.
        max_completion_length: the constant of ``token_sum_norm``; None: the engine's ``max_new_tokens``.
        ppo_clip: layer PPO ratio clipping on the gradient.
    """

    def __init__(
        self,
        *,
        loss_agg_mode: LossAggMode = "token_mean",
        max_completion_length: int | None = None,
        ppo_clip: PPOClip | None = None,
    ) -> None:
        if loss_agg_mode not in ("token_mean", "token_sum_norm"):
            raise ValueError(
                f"DrGRPO: loss_agg_mode={loss_agg_mode!r} is not valid; choose 'token_mean' or 'token_sum_norm'."
            )
        if max_completion_length is not None and loss_agg_mode != "token_sum_norm":
            raise ValueError(
                f"DrGRPO: max_completion_length={max_completion_length} is read only with loss_agg_mode: "
                "token_sum_norm; set that, or remove max_completion_length."
            )
        self.loss_agg_mode, self.max_completion_length, self.gate = (
            loss_agg_mode,
            max_completion_length,
            gate_for(ppo_clip),
        )

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        aggregator: LossAggregator = TokenMean()
        if self.loss_agg_mode == "token_sum_norm":
            length = self.max_completion_length or max_new_tokens
            if length is None:
                raise ValueError(
                    "DrGRPO: loss_agg_mode 'token_sum_norm' divides by num_samples x max_completion_length; set "
                    "max_completion_length (the generation budget in tokens)."
                )
            aggregator = ConstantNorm(max_length=length)
        return Parts(GroupNormAdvantage(scale="none"), self.gate, aggregator)


class MaxRL(Algorithm):
    """MaxRL (maximum-likelihood RL, arXiv 2602.02710): GRPO with the centred reward divided by the group mean.

    It is prime-rl's ``max_rl``. Dividing by the mean instead of the std weighs a rare success like ``1 / pass rate``.

    Args:
        eps: a group mean reward at or below ``eps`` gives zero advantage.
        ppo_clip: layer PPO ratio clipping on the gradient.
    """

    def __init__(self, *, eps: float = 1e-6, ppo_clip: PPOClip | None = None) -> None:
        self.advantage, self.gate = MeanScaledAdvantage(eps=eps), gate_for(ppo_clip)

    def parts(self, max_new_tokens: int | None = None) -> Parts:
        return Parts(self.advantage, self.gate, SequenceMean())
