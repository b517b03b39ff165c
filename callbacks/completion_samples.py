"""CompletionSamples: every few steps, a few prompts with completions and rewards, from high- and low-reward groups,
written as Markdown under the log dir and sent to loggers that show text (TensorBoard, W&B, MLflow, Comet)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from lightning import LightningModule, Trainer
from lightning.pytorch.loggers import CometLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from typing_extensions import override

from gpo.callbacks.settings import check_count
from gpo.rollout.base import Rollout
from gpo.train.hooks import RolloutCallback

COLUMNS = ["step", "kind", "group_mean", "reward", "prompt", "completion"]


class CompletionSamples(RolloutCallback):
    """Every ``every_n_steps`` steps, shows ``num_samples`` completions with their prompts and rewards.

    Groups are ranked by mean reward; the samples alternate between the best completion of the best group, the
    worst completion of the worst group, the best of the second best, the worst of the second worst, and so on
    (no completion twice; with few groups a group gives both its best and its worst), so one look shows both
    what the policy gets right and what it gets wrong. Ties go to the earlier group; within a group to the
    earliest best and the latest worst completion. A step here is one rollout (one call of ``on_rollout_end``);
    files are named after ``trainer.global_step``.

    Written to ``<trainer.log_dir>/samples/step_XXXXXX.md`` (readable Markdown, one section per sample; texts
    longer than ``max_chars`` are cut) and, where the logger shows text: ``WandbLogger.log_text`` (a table with
    columns ``step, kind, group_mean, reward, prompt, completion``), TensorBoard's ``add_text`` (the Markdown),
    MLflow's ``log_text`` (the Markdown as an artifact) and Comet's ``log_text``. Other loggers (``CSVLogger``)
    get the file only. Only the global-zero process writes, from its own rollout.

    Source: standard practice of reading samples during RL fine-tuning (reward curves hide reward hacking and
    degenerate outputs that one look at the completions reveals); nothing paper-specific.

    What the LightningModule must provide (gpo's ``GPOModule`` does): in ``training_step``, after scoring,
    ``rollout = gpo.train.hooks.run_rollout_hooks(trainer, module, rollout)``; the rollout needs
    ``prompts`` and ``completions`` (texts, one per row), ``reward[B]`` and ``group[B]``. The step counter is
    saved in checkpoints (``state_dict``).

    Args:
        every_n_steps: show samples on the first step and every this many steps after (a step whose rollout is
            empty, skipped, passes its turn to the next one).
        num_samples: completions shown each time (at most two per group: its best and its worst).
        max_chars: longest prompt or completion shown, in characters (None: no limit).
    """

    def __init__(self, *, every_n_steps: int = 100, num_samples: int = 4, max_chars: int | None = 2000) -> None:
        check_count("every_n_steps", every_n_steps, 1, "steps between samples")
        check_count("num_samples", num_samples, 1, "completions shown each time")
        check_count("max_chars", max_chars, 1, "the longest text shown", none="for no limit")
        self.every_n_steps, self.num_samples, self.max_chars = every_n_steps, num_samples, max_chars
        self.rollouts_seen, self.owed = 0, False

    @override
    def on_rollout_end(self, trainer: Trainer, module: LightningModule, rollout: Rollout) -> None:
        # a due sample whose rollout is empty (a skipped step) waits for the next rollout with rows
        self.owed = self.owed or self.rollouts_seen % self.every_n_steps == 0
        self.rollouts_seen += 1
        if not self.owed or len(rollout) == 0:
            return
        if rollout.reward is None or not len(rollout.prompts) == len(rollout.completions) == len(rollout):
            raise ValueError("CompletionSamples needs a scored rollout with texts (reward, prompts, completions).")
        self.owed = False
        folder = Path(trainer.log_dir or trainer.default_root_dir) / "samples"  # log_dir: call on every process
        if not trainer.is_global_zero:
            return
        step = trainer.global_step
        rows = [[step, *row] for row in self.pick(rollout)]
        text = to_markdown(step, rows)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"step_{step:06d}.md").write_text(text)
        for logger in trainer.loggers:
            send_to_logger(logger, rows, text, step)

    def pick(self, rollout: Rollout) -> list[list[Any]]:
        """Rows ``[kind, group_mean, reward, prompt, completion]``, alternating high and low groups."""
        reward = rollout.reward.double().cpu().tolist()
        _, index = torch.unique(rollout.group.cpu(), return_inverse=True)  # [B]: 0..G-1
        means = (torch.bincount(index, weights=torch.tensor(reward)) / torch.bincount(index)).tolist()  # [G]
        members = [(index == g).nonzero().flatten().tolist() for g in range(len(means))]
        # Ties: the earlier group; the best is the earliest and the worst the latest of equal rewards, so a uniform
        # group shows two different completions (sorted() is stable, max/min keep the first of equals).
        by_mean = sorted(range(len(means)), key=lambda g: -means[g])
        high = [("high", g, max(members[g], key=lambda i: (reward[i], -i))) for g in by_mean]
        low = [
            ("low", g, min(members[g], key=lambda i: (reward[i], -i))) for g in sorted(by_mean, key=means.__getitem__)
        ]
        rows, shown = [], set()
        for kind, g, row in (pick for pair in zip(high, low, strict=True) for pick in pair):
            if row not in shown and len(rows) < self.num_samples:
                shown.add(row)
                prompt, completion = self._cut(rollout.prompts[row]), self._cut(rollout.completions[row])
                rows.append([kind, round(means[g], 4), round(reward[row], 4), prompt, completion])
        return rows

    def _cut(self, text: str) -> str:
        if self.max_chars is None or len(text) <= self.max_chars:
            return text
        return f"{text[: self.max_chars]}... [{len(text) - self.max_chars} more characters]"

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"rollouts_seen": self.rollouts_seen, "owed": self.owed}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rollouts_seen, self.owed = int(state_dict["rollouts_seen"]), bool(state_dict.get("owed", False))


def to_markdown(step: int, rows: list[list[Any]]) -> str:
    """One section per sample: kind, rewards, then the prompt and the completion in fenced blocks."""
    lines = [f"# Samples at step {step}", ""]
    for number, (_, kind, group_mean, reward, prompt, completion) in enumerate(rows, 1):
        lines += [f"## {number}. {kind}-reward group (group mean {group_mean:.4g}, this completion {reward:.4g})", ""]
        for title, text in (("prompt", prompt), ("completion", completion)):
            fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", text)), default=0))
            lines += [f"**{title}**", "", f"{fence}text", text, fence, ""]
    return "\n".join(lines)


def send_to_logger(logger: Logger, rows: list[list[Any]], text: str, step: int) -> None:
    """Hand the samples to a logger that shows text; loggers without text support are left alone."""
    if isinstance(logger, WandbLogger):
        logger.log_text(key="samples", columns=COLUMNS, data=rows, step=step)
    elif isinstance(logger, TensorBoardLogger):
        logger.experiment.add_text("samples", text, global_step=step)
    elif isinstance(logger, MLFlowLogger):
        logger.experiment.log_text(logger.run_id, text, f"samples/step_{step:06d}.md")
    elif isinstance(logger, CometLogger):
        logger.experiment.log_text(text, step=step)
