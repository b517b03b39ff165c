"""What a training step logs, and how it reaches the loggers, the progress bar and the callbacks cheaply."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from lightning import Trainer
from torch import Tensor

from gpo.algo.mixers import weighted_sum
from gpo.algo.objective import combine_statistics
from gpo.parallel import collectives
from gpo.rewards.runner import RewardFn, reward_name
from gpo.rollout.base import Rollout

if TYPE_CHECKING:  # gpo.callbacks imports this file: the collector (and transformers) for annotations only
    from gpo.rollout.collector import Collector


def step_metrics(
    step: dict[str, Tensor], adv: Tensor, rewards: Sequence[RewardFn], weights: Sequence[float] | None
) -> dict[str, Tensor]:
    """Statistics of the step's rows over every rank (``step`` and ``adv`` as from ``collectives.gather_step``), as
    0-d tensors on the step's device.

    ``reward/mean`` and ``reward/std`` are those of the reward functions' weighted sum (``weights``: the mixer's,
    None: all 1), whatever the mixer: a mixer that normalises within groups (GDPO) averages 0 by construction.
    ``reward/mixed_mean`` is the mean of what the advantages were computed from (the mixer's output, plus a KL
    penalty placed in the reward, whose rows' summed KL estimates average ``kl/sequence_mean``)."""
    lengths, scores, mask = step["lengths"].float(), step["scores"], step["mask"]
    reward = weighted_sum(scores, weights)  # [B]
    rows = torch.stack([reward, step["reward"].float(), lengths, step["truncated"].float()])  # [4, B]
    means = rows.mean(1)  # [4]: one reduction for the four row means
    token_means = (torch.stack([adv, adv.abs()]) * mask).sum((1, 2)) / mask.sum().clamp_min(1)  # [2]
    metrics = {
        "reward/mean": means[0],
        "reward/std": reward.std() if len(reward) > 1 else reward.new_zeros(()),
        "reward/mixed_mean": means[1],
        "completion/len_mean": means[2],
        "completion/len_max": lengths.max(),
        "completion/truncated_frac": means[3],
        "adv/mean": token_means[0],
        "adv/abs_mean": token_means[1],
    }
    if "reward_kl" in step:
        metrics["kl/sequence_mean"] = step["reward_kl"].mean()
    column_means = scores.mean(0)  # [K]
    for k, fn in enumerate(rewards):
        metrics[f"reward/{reward_name(fn)}"] = column_means[k]
    return metrics


def count_metrics(reward_errors: Mapping[str, int], device: torch.device) -> dict[str, Tensor]:
    """This rank's samples scored as ``reward_errors.value``, per reward function (``reward_errors/<name>``)."""
    return {f"reward_errors/{name}": torch.tensor(float(n), device=device) for name, n in reward_errors.items()}


def throughput(
    rollout: Rollout, generated: Tensor, rollout_s: float, scoring_s: float, training_s: float
) -> dict[str, Tensor]:
    """Step time split and tokens/s: ``generated`` counts every sampled round, ``rollout`` is what trained."""
    processed = rollout.attention_mask.sum().float()
    seconds = torch.tensor([rollout_s, scoring_s, training_s], dtype=torch.float32, device=processed.device)  # [3]
    return {
        "time/rollout_s": seconds[0],
        "time/scoring_s": seconds[1],
        "time/training_s": seconds[2],
        "throughput/rollout_tokens_per_s": generated / seconds[0].clamp_min(1e-9),
        "throughput/training_tokens_per_s": processed / seconds[2].clamp_min(1e-9),
    }


def log_due(trainer: Trainer) -> bool:
    """Whether this training batch's metrics go to the loggers: every ``trainer.log_every_n_steps`` batches, as
    Lightning schedules its own logging (so gpo's rows and the callbacks' rows coincide), and at the last step."""
    every = trainer.log_every_n_steps
    batch = trainer.fit_loop.epoch_loop.total_batch_idx
    last = 0 < trainer.max_steps <= trainer.global_step
    return every > 0 and ((batch + 1) % every == 0 or last or trainer.should_stop)


def publish(trainer: Trainer, metrics: dict[str, Tensor], *, log: bool, progress: Sequence[str] = ("reward",)) -> None:
    """Hand a training step's metrics (0-d tensors) on without Lightning's per-key logging path.

    Every step: ``trainer.callback_metrics`` (what callbacks read) and the progress bar's ``progress`` keys are
    updated with the tensors themselves (no host sync). With ``log``: all values are copied to the host at once and
    handed to every logger at ``step`` = the training batch's index, the step Lightning gives the metrics callbacks
    log at the same batch. The loggers write them to disk when they save (gpo's: every few seconds, at each
    checkpoint and at the end; ``gpo.train.loggers``), not here."""
    trainer.callback_metrics.update(metrics)
    trainer.progress_bar_metrics.update({key: metrics[key] for key in progress if key in metrics})
    if log and trainer.loggers:
        keys = list(metrics)
        values = torch.stack([metrics[key] for key in keys]).tolist()  # one device-to-host copy (dtypes promoted)
        log_row(trainer, dict(zip(keys, values, strict=True)))


def logged_step(trainer: Trainer) -> int:
    """The step the current training batch's metrics are logged at: the batch's index (0 before the first batch).
    In ``on_train_batch_end`` it is one less than ``trainer.global_step``, which has counted the batch's update."""
    return max(trainer.fit_loop.epoch_loop.total_batch_idx, 0)  # -1 before the first batch (at train start)


def log_row(trainer: Trainer, row: dict[str, float]) -> None:
    """``row`` to every logger at ``logged_step``."""
    step = logged_step(trainer)
    for logger in trainer.loggers:
        logger.log_metrics(row, step=step)


def publish_values(trainer: Trainer, values: Mapping[str, float]) -> None:
    """A callback's step metrics, numbers it measured on the host, handed on as ``publish`` does: to
    ``trainer.callback_metrics`` every step and to the loggers when logging is due (``log_due``, the row of the
    module's metrics). ``LightningModule.log_dict`` costs about 0.25 ms a key every step on a CPU: 2 ms a step for
    a callback that logs 8 keys."""
    if not values:
        return
    stacked = torch.tensor(list(values.values()), dtype=torch.float32)  # [K]
    trainer.callback_metrics.update(zip(values, stacked.unbind(), strict=True))
    if log_due(trainer) and trainer.loggers:
        log_row(trainer, dict(zip(values, stacked.tolist(), strict=True)))  # no unbind-then-stack round trip


class BatchValues:
    """A callback's metrics of the current training batch, gathered in any of its hooks and published once, when the
    batch ends (``publish_values``): only then does ``log_due`` know whether the batch was the run's last."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def add(self, values: Mapping[str, float]) -> None:
        self.values.update(values)

    def publish(self, trainer: Trainer) -> None:
        """In the callback's ``on_train_batch_end``."""
        publish_values(trainer, self.values)
        self.values = {}


def publish_step(
    trainer: Trainer, collector: Collector, rollout: Rollout, step: dict[str, Tensor], step_adv: Tensor,
    metrics: dict[str, Tensor], *, scoring_s: float, training_s: float,
) -> None:  # fmt: skip
    """A trained step's metrics (the learner's ``metrics``, throughput, reward-error counts and ``step_metrics``) to
    the callbacks and progress bar, and to the loggers when logging is due: ranks are combined only then, the
    metrics as a step's micro-batches are (``combine_statistics``: extremes, means weighted by the tokens each is
    over; one all-gather) and the counts summed (one all-reduce)."""
    stats, log = collector.stats, log_due(trainer)
    metrics |= throughput(rollout, stats.generated_tokens, stats.rollout_s, scoring_s, training_s)
    counts = count_metrics(stats.reward_errors, rollout.reward.device)
    if log:
        metrics = combine_statistics(collectives.gather_metrics(metrics))  # as over micro-batches: ranks are parts
        counts = collectives.sum_metrics(counts)
    metrics |= counts | step_metrics(step, step_adv, collector.rewards, collector.mixer.weights)
    publish(trainer, {**metrics, "reward": metrics["reward/mean"]}, log=log)
