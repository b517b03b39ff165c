"""DifficultyFilter: skip prompts whose recent pass rate is outside a band ("Goldilocks" prompt filtering), and
re-test each skipped prompt once its verdict is ``retest_every`` steps old."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Any

import torch
from lightning import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from gpo.callbacks.settings import check_count, check_number
from gpo.rollout.base import Rollout
from gpo.train.hooks import RolloutCallback
from gpo.train.metrics import BatchValues, log_due


class DifficultyFilter(RolloutCallback):
    """Train on prompts the policy solves sometimes but not always: pass rate in ``[low, high]``.

    A completion passes when its reward is at least ``pass_threshold``. For each prompt (keyed by its text, or by
    the dataset column ``key_column``) the filter keeps the pass counts of its last ``window`` groups; the prompt's
    pass rate is passes / completions over those groups (pooled, so groups of any size weigh by their
    completions). Only groups sampled less than ``retest_every`` steps ago count: older ones are stale, because
    the policy has moved since.

    Before sampling (``on_prompts``) a prompt is skipped when it has a fresh pass rate below ``low`` or above
    ``high``. A prompt with no fresh groups (never seen, or last sampled ``retest_every`` or more steps ago) is
    admitted and so re-tested: its new group alone then decides whether it is skipped again, so a prompt that
    became easier or harder is reconsidered. A step here is one call of ``on_prompts`` (one batch of prompts;
    the optimiser step count when each batch takes one optimiser step). Since a prompt is only judged when the
    data loader serves it, filtering bites once prompts come around more often than every ``retest_every``
    steps (an epoch shorter than ``retest_every`` steps).

    If every prompt of a batch would be skipped, the batch is kept whole (logged as ``difficulty/fallback``, with
    a warning the first time): a step that trains on nothing would not advance a manually optimised trainer's
    step count, and the groups refresh every prompt's verdict. Skipping shrinks the step; to refill it, list
    ``DynamicSampling(num_groups=...)`` after this filter. The filter then records every group of the filtered
    batch (the uniform ones DynamicSampling drops included) but not the extra batches DynamicSampling draws:
    those never pass through ``on_prompts`` and are sampled after this filter's ``on_rollout_end`` has run.

    Source: the "Goldilocks rule" of Haggai Roitman's textbook chapter on GRPO: keep prompts with a 20-80% pass
    rate for the current model and re-filter periodically (every 500 steps there) as the model improves.

    Logged: per step ``difficulty/seen`` and ``difficulty/skipped`` (prompts of the incoming batch),
    ``difficulty/fallback`` (1.0 if the whole batch would have been skipped); on the steps the loggers write (every
    ``log_every_n_steps``: counting scans every tracked prompt), the tracked prompts with a fresh pass rate
    ``difficulty/inside``, ``difficulty/below`` and ``difficulty/above`` the band. The
    pass-rate history and the step count are saved in checkpoints (``state_dict``).

    What the LightningModule must provide (gpo's ``GPOModule`` does):

    - in ``training_step``, before sampling: ``batch = gpo.train.hooks.run_prompt_hooks(trainer, module, batch)``.
      A batch is a dict with ``prompt`` (texts),
      ``prompt_ids`` (one entry per prompt) and ``fields`` (dataset columns, one list of values per column, one
      value per prompt); the filtered batch keeps the same keys, other keys are passed through unchanged.
    - after scoring: ``rollout = gpo.train.hooks.run_rollout_hooks(trainer, module, rollout)``; the rollout needs
      ``group[B]`` (rows of a group answer one prompt), ``reward[B]`` (or ``scores[B, K]`` with ``score_index``),
      and ``prompts`` (or ``fields[key_column]``), one entry per row.

    Its metrics (``difficulty/*``) go to ``trainer.callback_metrics`` when each batch ends and to the loggers every
    ``log_every_n_steps`` (``gpo.train.metrics.publish_values``).

    Args:
        low: lowest pass rate kept (inclusive), in [0, 1].
        high: highest pass rate kept (inclusive), in [low, 1].
        pass_threshold: a completion passes when its reward is at least this (1.0: fully solved under 0/1 or
            partial-credit rewards).
        window: groups per prompt the pass rate is computed over (its most recent ones).
        retest_every: steps a pass rate stays valid; a skipped prompt is admitted again (re-tested) once its
            newest group is this many steps old.
        key_column: dataset column identifying a prompt (e.g. ``id``); None: the prompt text. With many long
            prompts an id keeps the checkpointed history small.
        score_index: judge passing on ``rollout.scores[:, score_index]`` (one reward function) instead of the
            mixed ``rollout.reward``; use it when the reward carries a KL penalty or shaping terms.
    """

    def __init__(
        self,
        *,
        low: float = 0.2,
        high: float = 0.8,
        pass_threshold: float = 1.0,
        window: int = 4,
        retest_every: int = 500,
        key_column: str | None = None,
        score_index: int | None = None,
    ) -> None:
        check_number("low", low, "the lowest pass rate kept", at_least=0.0, at_most=1.0)
        check_number("high", high, "the highest pass rate kept", at_least=low, at_most=1.0)
        check_number("pass_threshold", pass_threshold, "the reward at which a completion passes")
        check_count("window", window, 1, "groups per prompt in the pass rate")
        check_count("retest_every", retest_every, 1, "steps a pass rate stays valid")
        check_count("score_index", score_index, 0, "a column of rollout.scores", none="for the mixed reward")
        self.low, self.high, self.pass_threshold = low, high, pass_threshold
        self.window, self.retest_every = window, retest_every
        self.key_column, self.score_index = key_column, score_index
        self.step = 0
        self.history: dict[Hashable, deque[tuple[int, int, int]]] = {}  # key -> (step, passes, completions)
        self._warned_fallback = False
        self.batch_values = BatchValues()

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Refuse a ``DynamicSampling`` listed before this filter: the rollout would reach it without the uniform
        groups, whose prompts are the ones the filter is there to skip."""
        from gpo.callbacks.dynamic_sampling import DynamicSampling  # a sibling callback, for its order only

        if any(
            isinstance(callback, DynamicSampling) for callback in trainer.callbacks[: trainer.callbacks.index(self)]
        ):
            raise ValueError(
                "trainer.callbacks lists DynamicSampling before DifficultyFilter; list DifficultyFilter first: it "
                "records each prompt's pass rate from the rollout it is handed, and DynamicSampling drops the groups "
                "whose rewards are all equal, the prompts the filter should learn to skip."
            )

    # ---- the two extra hooks ----------------------------------------------------------------------------------

    @override
    def on_prompts(self, trainer: Trainer, module: LightningModule, batch: dict[str, Any]) -> dict[str, Any] | None:
        self.step += 1
        keys = self._keys(batch["prompt"], batch.get("fields", {}), "batch fields")
        keep = [i for i, key in enumerate(keys) if self.admits(key)]
        fallback = not keep and bool(keys)
        if fallback:
            keep = list(range(len(keys)))
            if not self._warned_fallback:
                rank_zero_warn(
                    f"DifficultyFilter: at step {self.step} every prompt of the batch is outside the pass-rate band "
                    f"[{self.low}, {self.high}]; training on the whole batch. Widen the band, lower retest_every or "
                    "use a larger dataset (warned once; difficulty/fallback counts the steps)."
                )
                self._warned_fallback = True
        seen = {"seen": len(keys), "skipped": len(keys) - len(keep), "fallback": fallback}
        self.batch_values.add({f"difficulty/{key}": float(value) for key, value in seen.items()})
        return batch if len(keep) == len(keys) else select_prompts(batch, keep)

    @override
    def on_rollout_end(self, trainer: Trainer, module: LightningModule, rollout: Rollout) -> None:
        passed = self._rewards(rollout) >= self.pass_threshold  # [B]
        keys = self._keys(rollout.prompts, rollout.fields, "rollout.fields")
        if len(keys) != len(rollout):
            raise ValueError(
                f"DifficultyFilter needs one prompt key per rollout row ({len(keys)} for {len(rollout)} rows): fill "
                "rollout.prompts (or rollout.fields[key_column]) with each row's prompt."
            )
        _, group = torch.unique(rollout.group, return_inverse=True)  # [B]: 0..G-1
        passes = torch.bincount(group, weights=passed.double()).long().tolist()  # [G]
        sizes = torch.bincount(group).tolist()  # [G]
        first_row = {}
        for row, g in enumerate(group.tolist()):
            first_row.setdefault(g, row)
        for g, row in first_row.items():
            entries = self.history.pop(keys[row], None) or deque(maxlen=self.window)
            entries.append((self.step, passes[g], sizes[g]))
            self.history[keys[row]] = entries  # last: the history stays ordered by last update
        self._forget_stale()

    @override
    def on_train_batch_end(self, trainer: Trainer, *_: Any) -> None:
        if log_due(trainer):  # counting scans every tracked prompt: only for the rows the loggers write
            self.batch_values.add({f"difficulty/{k}": float(v) for k, v in self.population().items()})
        self.batch_values.publish(trainer)

    # ---- pass rates -------------------------------------------------------------------------------------------

    def pass_rate(self, key: Hashable) -> float | None:
        """The prompt's pass rate over its fresh groups, or None if it has none (never seen, or stale)."""
        fresh = [(p, n) for step, p, n in self.history.get(key, ()) if self.step - step < self.retest_every]
        total = sum(n for _, n in fresh)
        return sum(p for p, _ in fresh) / total if total else None

    def admits(self, key: Hashable) -> bool:
        """Whether the prompt is sampled this step: inside the band, or due for a (re-)test."""
        rate = self.pass_rate(key)
        return rate is None or self.low <= rate <= self.high

    def population(self) -> dict[str, int]:
        """How many tracked prompts have a fresh pass rate inside, below and above the band."""
        counts = {"inside": 0, "below": 0, "above": 0}
        for key in self.history:
            rate = self.pass_rate(key)
            if rate is not None:
                counts["below" if rate < self.low else "above" if rate > self.high else "inside"] += 1
        return counts

    def _forget_stale(self) -> None:
        """Drop the prompts whose newest group is stale: the first ones of the history, which is ordered by last
        update (so a step costs what it forgets, not what it tracks)."""
        while self.history:
            oldest = next(iter(self.history))
            if self.step - self.history[oldest][-1][0] < self.retest_every:
                return
            del self.history[oldest]

    def _rewards(self, rollout: Rollout) -> torch.Tensor:
        if self.score_index is None:
            if rollout.reward is None:
                raise ValueError("DifficultyFilter needs a scored rollout (rollout.reward is None).")
            return rollout.reward
        if rollout.scores is None or rollout.scores.shape[1] <= self.score_index:
            have = "none" if rollout.scores is None else rollout.scores.shape[1]
            raise ValueError(
                f"score_index={self.score_index} but the rollout has {have} score columns; set score_index to a "
                "reward function's position in the module's rewards, or None for the mixed reward."
            )
        return rollout.scores[:, self.score_index]

    def _keys(self, prompts: list[str], fields: dict[str, list], where: str) -> list[Hashable]:
        if self.key_column is None:
            return list(prompts)
        if self.key_column not in fields:
            raise ValueError(
                f"key_column={self.key_column!r} is not among the {where} ({', '.join(fields) or 'none'}); set "
                "key_column to a dataset column that identifies a prompt, or None to key on the prompt text."
            )
        return [value if isinstance(value, Hashable) else repr(value) for value in fields[self.key_column]]

    # ---- checkpointing ----------------------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        # Plain lists and numbers only, so checkpoints load with torch.load(weights_only=True).
        keys = list(self.history)
        return {
            "step": self.step,
            "keys": keys,
            "entries": [[list(entry) for entry in self.history[key]] for key in keys],
            "warned_fallback": self._warned_fallback,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.history = {
            key: deque((tuple(entry) for entry in entries), maxlen=self.window)
            for key, entries in zip(state_dict["keys"], state_dict["entries"], strict=True)
        }
        self._warned_fallback = bool(state_dict.get("warned_fallback", False))


def select_prompts(batch: dict[str, Any], keep: list[int]) -> dict[str, Any]:
    """The batch restricted to the prompts at positions ``keep`` (``prompt``, ``prompt_ids`` and every field)."""
    out = dict(batch)
    for name in ("prompt", "prompt_ids"):
        if name in batch:
            out[name] = [batch[name][i] for i in keep]
    if "fields" in batch:
        out["fields"] = {key: [values[i] for i in keep] for key, values in batch["fields"].items()}
    return out
