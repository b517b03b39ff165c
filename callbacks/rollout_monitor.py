"""RolloutMonitor: per-step entropy, length, n-gram diversity and reward-width statistics of the rollout, and a
warning when entropy, diversity and reward width collapse together."""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torchmetrics.aggregation import MaxMetric
from typing_extensions import override

from gpo.algo.masked import masked_mean
from gpo.callbacks.settings import check_count, check_number
from gpo.rollout.base import Rollout
from gpo.train.hooks import RolloutCallback, require_source
from gpo.train.metrics import logged_step, publish_values

COLLAPSE_SIGNALS = ("entropy", "ngram_unique", "reward_group_std")
UNIFORM_ATOL = 1e-6  # a group whose rewards span at most this has zero advantage (GroupNormAdvantage's eps)


class RolloutMonitor(RolloutCallback):
    """Logs the health of every step's rollout under ``monitor/...`` and warns when it looks like mode collapse.

    Per step (population statistics, ``std`` divides by n):

    - ``entropy``: mean token entropy over completion tokens (see below for where it comes from);
    - ``len_mean``, ``len_max``, ``truncated_frac``: completion lengths in tokens and the fraction that hit the
      length budget without EOS;
    - ``ngram_unique``: per group, distinct ``ngram``-grams of token ids / all ``ngram``-grams over the group's
      completions (n-grams lie inside one completion), averaged over groups that have any; 1.0 when no n-gram
      repeats, ``1 / group size`` when every completion of a group is the same (and repeats nothing inside);
    - ``reward_std``, ``reward_spread`` (max - min) of the rewards across the batch, ``reward_group_std``
      (within-group std, averaged over groups), ``zero_adv_frac`` (fraction of groups whose rewards span at most
      1e-6, which get zero group-relative advantage);
    - ``collapse_streak`` (consecutive collapsing steps) and ``collapse`` (1.0 while the warning condition holds).

    Collapse rule: each of entropy, ``ngram_unique`` and ``reward_group_std`` keeps its running peak (the maximum
    since the start of training, a torchmetrics ``MaxMetric``). After ``warmup`` monitored steps a step is
    collapsing when all three are below ``collapse_fraction`` x their peaks; when ``patience`` consecutive steps
    collapse, one warning names the step (as its metrics are logged) and the three values with their peaks. It
    fires again only after a step that does not collapse. One or two signals falling is normal (entropy falls as a
    policy learns); all three together mean the groups have become copies of one answer with one reward. Mastering
    the task also narrows all three: check ``reward/mean`` before acting. A signal that cannot be measured at a step
    (no entropy source, completions shorter than ``ngram``) is not logged and makes that step non-collapsing.

    Entropy: with ``compute_entropy=True``, one no-grad forward pass of the module's ``scorer`` over the rollout
    (costly: about a third of a training pass), averaged over the tokens that train (``loss_mask``: a multi-turn
    rollout's environment tokens are left out); otherwise the metric named ``entropy_metric`` the module logged
    during the step (GPOModule logs ``entropy``, the token entropy of its training pass: exact for one update per
    step, an average over the updates otherwise).

    Source: the collapse check of Haggai Roitman's textbook chapter on GRPO, which watches response entropy, the
    unique n-gram ratio and the spread of the rewards, and reads all three falling at once as a collapse. The
    thresholds are ours.

    What the LightningModule must provide (gpo's ``GPOModule`` does):

    - after scoring, in ``training_step``: ``rollout = gpo.train.hooks.run_rollout_hooks(trainer, module,
      rollout)``; the rollout needs ``completion_ids``/``completion_mask`` ``[B, T]`` (right-padded),
      ``truncated[B]``, ``group[B]`` and ``reward[B]``. Put this callback after callbacks that replace the
      rollout, so it sees what is trained on.
    - for ``compute_entropy``: ``scorer`` (``gpo.train.hooks.RolloutSource``: a ``TokenScorer`` of the policy at
      the sampling temperature) and the rollout's ``prompt_ids``/``prompt_mask`` (left-padded).

    The statistics (``monitor/*``) are published in ``on_train_batch_end``, after the step's updates: to
    ``trainer.callback_metrics`` every step and to the loggers every ``log_every_n_steps``
    (``gpo.train.metrics.publish_values``).

    Each process monitors its own rollout (no collective calls).

    Args:
        ngram: n of the n-grams in ``ngram_unique``.
        compute_entropy: run a no-grad forward pass per step for the entropy when the rollout carries none.
        entropy_metric: logged metric read as the entropy when the rollout carries none and ``compute_entropy`` is
            off; None: no entropy then.
        entropy_batch_size: rows per forward pass of ``compute_entropy`` (None: the whole rollout at once).
        collapse_fraction: a signal has fallen when it is below this fraction of its running peak, in (0, 1).
        warmup: monitored steps before the collapse check starts (the peaks form meanwhile).
        patience: consecutive collapsing steps before the warning.
    """

    def __init__(
        self,
        *,
        ngram: int = 3,
        compute_entropy: bool = False,
        entropy_metric: str | None = "entropy",
        entropy_batch_size: int | None = None,
        collapse_fraction: float = 0.5,
        warmup: int = 10,
        patience: int = 5,
    ) -> None:
        check_count("ngram", ngram, 1, "the n of the unique n-gram ratio")
        check_count("entropy_batch_size", entropy_batch_size, 1, "rows per entropy pass", none="for the whole rollout")
        check_number("collapse_fraction", collapse_fraction, "a fraction of the peak", above=0.0, below=1.0)
        check_count("warmup", warmup, 0, "monitored steps before the collapse check")
        check_count("patience", patience, 1, "consecutive collapsing steps before warning")
        self.ngram, self.compute_entropy, self.entropy_metric = ngram, compute_entropy, entropy_metric
        self.entropy_batch_size, self.collapse_fraction = entropy_batch_size, collapse_fraction
        self.warmup, self.patience = warmup, patience
        self.steps, self.streak, self.warned = 0, 0, False
        self.peaks = _peak_metrics()
        self._pending: dict[str, float] | None = None
        self._warned_no_entropy = False

    # ---- hooks ------------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.compute_entropy:
            purpose = " for compute_entropy (or read a logged entropy: entropy_metric)"
            require_source(self, pl_module, ("scorer",), purpose)

    @override
    def on_rollout_end(self, trainer: Trainer, module: LightningModule, rollout: Rollout) -> None:
        self._pending = None
        if len(rollout) == 0:  # nothing will be trained on this step
            return
        if rollout.reward is None:
            raise ValueError("RolloutMonitor needs a scored rollout (rollout.reward is None).")
        stats = {**length_stats(rollout), **reward_stats(rollout.reward, rollout.group)}
        stats["ngram_unique"] = unique_ngram_ratio(
            rollout.completion_ids, rollout.completion_mask, rollout.group, self.ngram
        )
        if self.compute_entropy:
            scores = module.scorer.rollout_scores(rollout, entropy=True, batch_size=self.entropy_batch_size)
            stats["entropy"] = float(masked_mean(scores.entropy, rollout.loss_mask))  # the policy's own tokens
        self._pending = stats

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats, self._pending = self._pending, None
        if stats is None:  # the step was skipped before scoring, or the module never called on_rollout_end
            return
        if "entropy" not in stats and self.entropy_metric is not None:
            logged = trainer.callback_metrics.get(self.entropy_metric)
            if logged is not None:
                stats["entropy"] = float(logged)
        if "entropy" not in stats and not self._warned_no_entropy:
            rank_zero_warn(
                "RolloutMonitor: no token entropy this step (compute_entropy off, entropy_metric="
                f"{self.entropy_metric!r} not logged); the collapse check needs it. Set compute_entropy=True, or "
                "entropy_metric to the name your module logs the token entropy under (warned once)."
            )
            self._warned_no_entropy = True
        stats.update(self._collapse_check(stats, logged_step(trainer)))
        measured = {f"monitor/{k}": v for k, v in stats.items() if math.isfinite(v)}  # nan: not measurable
        publish_values(trainer, measured)

    def _collapse_check(self, stats: dict[str, float], step: int) -> dict[str, float]:
        self.steps += 1
        fallen = []
        for name in COLLAPSE_SIGNALS:
            value = stats.get(name, math.nan)
            if math.isfinite(value):
                self.peaks[name].update(value)
            fallen.append(value < self.collapse_fraction * self.peak(name))  # False when either is nan
        collapsing = self.steps > self.warmup and all(fallen)
        self.streak = self.streak + 1 if collapsing else 0
        if not collapsing:
            self.warned = False
        elif self.streak >= self.patience and not self.warned:
            self.warned = True
            rank_zero_warn(self._collapse_message(stats, step))
        return {"collapse_streak": float(self.streak), "collapse": float(self.streak >= self.patience)}

    def peak(self, name: str) -> float:
        """The running peak of a collapse signal (nan before its first measurement)."""
        metric = self.peaks[name]
        return float(metric.compute()) if metric.update_count else math.nan

    def _collapse_message(self, stats: dict[str, float], step: int) -> str:
        parts = [f"{name} {stats[name]:.4g} (peak {self.peak(name):.4g})" for name in COLLAPSE_SIGNALS]
        return (
            f"RolloutMonitor: possible collapse at step {step}: {', '.join(parts)}; all three have been below "
            f"{self.collapse_fraction} x their peaks for {self.streak} consecutive steps. The groups are turning "
            "into copies of one answer: consider an entropy bonus, a stronger KL penalty, a higher temperature or "
            "a lower learning rate (unless reward/mean shows the task is simply mastered)."
        )

    # ---- checkpointing ----------------------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        peaks = {name: None if math.isnan(self.peak(name)) else self.peak(name) for name in COLLAPSE_SIGNALS}
        return {"steps": self.steps, "streak": self.streak, "warned": self.warned, "peaks": peaks}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps, self.streak = int(state_dict["steps"]), int(state_dict["streak"])
        self.warned = bool(state_dict["warned"])
        self.peaks = _peak_metrics()
        for name, peak in state_dict["peaks"].items():
            if peak is not None:
                self.peaks[name].update(peak)


# ---- the statistics, as plain functions of tensors ---------------------------------------------------------------


def _peak_metrics() -> dict[str, MaxMetric]:
    # Each process keeps its own peaks: no collective call hides in compute() or in a checkpoint's state_dict.
    return {name: MaxMetric(sync_on_compute=False) for name in COLLAPSE_SIGNALS}


def length_stats(rollout: Rollout) -> dict[str, float]:
    lengths = rollout.completion_mask.sum(-1).float()  # [B]
    return {
        "len_mean": float(lengths.mean()),
        "len_max": float(lengths.max()),
        "truncated_frac": float(rollout.truncated.float().mean()),
    }


def reward_stats(reward: Tensor, group: Tensor) -> dict[str, float]:
    """Batch std and spread of ``reward[B]``, mean within-group std and the fraction of uniform groups."""
    reward = reward.double()
    _, index = torch.unique(group, return_inverse=True)  # [B]: 0..G-1
    count = torch.bincount(index).double()  # [G]
    mean = torch.bincount(index, weights=reward) / count  # [G]
    var = torch.bincount(index, weights=(reward - mean[index]) ** 2) / count  # [G]
    high = torch.full_like(mean, -torch.inf).scatter_reduce(0, index, reward, "amax")  # [G]
    low = torch.full_like(mean, torch.inf).scatter_reduce(0, index, reward, "amin")  # [G]
    return {
        "reward_std": float(reward.std(unbiased=False)),
        "reward_spread": float(reward.max() - reward.min()),
        "reward_group_std": float(var.sqrt().mean()),
        "zero_adv_frac": float((high - low <= UNIFORM_ATOL).double().mean()),
    }


def unique_ngram_ratio(ids: Tensor, mask: Tensor, group: Tensor, n: int) -> float:
    """Mean over groups of distinct / total ``n``-grams of token ids ``ids[B, T]`` where ``mask`` is 1; nan if no
    group has an ``n``-gram (every completion shorter than ``n``).

    Each n-gram gets an exact integer key of ``(group, id_1, ..., id_n)``, one token at a time: ``key * V + id_j``
    (``V`` = the largest id + 1), ranked back into ``0..N-1`` after each token so that it cannot overflow. Equal keys
    are equal n-grams of one group. ``torch.unique`` over 1-D keys, ``n + 1`` times, is several times faster than
    over the rows of an ``[N, 1 + n]`` table (256 completions of 200 tokens: 3 ms instead of 26 ms)."""
    if ids.shape[1] < n:
        return float("nan")
    _, index = torch.unique(group, return_inverse=True)  # [B]: 0..G-1
    valid = mask.bool().unfold(1, n, 1).all(-1)  # [B, W], W = T - n + 1: the whole n-gram is completion tokens
    grams = ids.unfold(1, n, 1)[valid]  # [N, n]
    if grams.numel() == 0:
        return float("nan")
    owner = index[:, None].expand_as(valid)[valid]  # [N]: each n-gram's group
    key, base = owner, int(ids.max()) + 1
    for j in range(n):
        distinct, key = torch.unique(key * base + grams[:, j], return_inverse=True)  # key in 0..D-1
    distinct_owner = owner.new_empty(len(distinct)).scatter_(0, key, owner)  # [D]: every key's group
    groups = int(index.max()) + 1
    total = torch.bincount(owner, minlength=groups).double()  # [G]
    ratio = torch.bincount(distinct_owner, minlength=groups).double() / total  # [G], nan where a group has none
    return float(ratio[total > 0].mean())
