"""DynamicSampling: DAPO's dynamic sampling as a Lightning callback. Drops groups whose rewards are all equal and
draws more prompts until the step holds the requested number of informative groups."""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from lightning import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from gpo.callbacks.settings import check_count, check_number
from gpo.parallel import collectives
from gpo.rollout.base import Rollout, concat_rollouts
from gpo.train.hooks import RolloutCallback, require_source
from gpo.train.metrics import BatchValues

OnExhausted = Literal["train", "skip"]
TOTALS = ("steps", "groups_drawn", "groups_kept", "rounds", "exhausted_steps", "tokens_drawn")


class DynamicSampling(RolloutCallback):
    """Train every step on ``num_groups`` informative groups: groups whose rewards are not all equal.

    Rule: after scoring, a group whose rewards span at most ``atol`` (``max - min <= atol``) is dropped: its
    group-relative advantages are all zero, so it adds no gradient and only dilutes the step. While fewer than
    ``num_groups`` informative groups are held, another batch of prompts is drawn, sampled and scored, for at
    most ``max_rounds`` extra rounds. Informative groups beyond ``num_groups`` are dropped (the earliest drawn
    are kept), so the returned rollout has exactly ``num_groups`` groups. This is the dynamic sampling of DAPO
    (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", section 3.2), which
    keeps drawing until the batch is full of groups with accuracy strictly between 0 and 1.

    When ``max_rounds`` runs out short of ``num_groups``: ``on_exhausted="train"`` trains on the informative
    groups it has and warns with the step and the counts; ``"skip"`` returns an empty rollout, so the step is
    skipped. With no informative group at all the step is skipped under either setting: there is nothing to
    learn from, and training on all-zero advantages would only spend an optimiser step (and move Adam's
    moments) on the regularisers.

    Uniformity is judged on ``rollout.reward``, the reward the advantages are computed from. A KL penalty placed
    in the reward makes every group non-uniform; filter on a reward without it if that matters.

    Metrics of every step (``gpo.train.metrics.publish_values`` when the batch ends: ``trainer.callback_metrics``
    every step, the loggers every ``log_every_n_steps``): ``dynamic_sampling/groups_drawn`` (all groups sampled
    this step), ``groups_kept`` (trained on), ``groups_dropped`` (uniform), ``groups_surplus`` (informative but beyond
    ``num_groups``), ``rounds`` (extra rounds drawn), ``exhausted`` (1.0 if ``max_rounds`` ran out),
    ``tokens_drawn`` (completion tokens generated, dropped groups included), ``informative_frac`` (informative
    groups / groups drawn) and running ``total_*`` counts (saved in checkpoints via ``state_dict``).

    What the LightningModule must provide (gpo's ``GPOModule`` does; any LightningModule can):

    - ``gpo.train.hooks.RolloutSource.draw_rollout() -> Rollout``: sample and score another batch of training
      prompts, a ``gpo.rollout.base.Rollout`` with ``reward[B]`` and ``group[B]`` set (rows of a group need not be
      adjacent; the token tensors are what ``Rollout.select`` and ``concat_rollouts`` carry along). With
      ``max_rounds=0`` it is never called.
    - in ``training_step``, after scoring: ``rollout = gpo.train.hooks.run_rollout_hooks(trainer, module,
      rollout)``; skip the step if the result has no rows, otherwise train on it.

    Under DDP with ``W`` processes, ``num_groups`` is global: each process fills its own share of
    ``num_groups / W`` groups from its own prompts (drawing its own extra rounds, with no collective in between) and
    the logged counts and totals are over all processes (sums; ``rounds`` and ``exhausted`` are the maxima). A
    process left with no group, or an ``on_exhausted="skip"`` on any process, skips the step on every process.
    Under a strategy whose generation is collective (FSDP) processes could draw different numbers of rounds, which
    this callback does not synchronise.

    Args:
        num_groups: informative groups to train on per step over all processes; None: as many as the step's
            rollout arrived with (the prompts of the batch), so the step size stays constant.
        max_rounds: extra batches of prompts drawn per step at most (0: only filter, never draw more).
        atol: rewards of a group count as all equal when ``max - min <= atol``. The default 1e-6 is the ``eps`` of
            gpo's ``GroupNormAdvantage`` (a group std at or below it gets zero advantage): rewards that differ only
            by float rounding count as equal. 0 demands exactly equal rewards.
        on_exhausted: ``train`` on the informative groups held or ``skip`` the step when ``max_rounds`` runs out
            before ``num_groups`` are found (the first such step is warned about; all are counted in ``exhausted``).
    """

    def __init__(
        self,
        *,
        num_groups: int | None = None,
        max_rounds: int = 8,
        atol: float = 1e-6,
        on_exhausted: OnExhausted = "train",
    ) -> None:
        check_count("num_groups", num_groups, 1, "informative groups per step", none="for the batch's prompt count")
        check_count("max_rounds", max_rounds, 0, "extra batches drawn at most; 0 only filters")
        check_number("atol", atol, "0 demands exactly equal rewards", at_least=0.0)
        if on_exhausted not in ("train", "skip"):
            raise ValueError(f"on_exhausted={on_exhausted!r} is not valid; choose 'train' or 'skip'.")
        self.num_groups, self.max_rounds, self.atol, self.on_exhausted = num_groups, max_rounds, atol, on_exhausted
        self.totals = dict.fromkeys(TOTALS, 0)
        self.batch_values = BatchValues()
        self.warned = False

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.max_rounds:
            require_source(self, pl_module, ("draw_rollout",), " to draw more groups (max_rounds=0 only filters)")
        if self.num_groups is not None and self.num_groups % trainer.world_size:
            raise ValueError(
                f"DynamicSampling num_groups={self.num_groups} is global: it must split evenly over the "
                f"{trainer.world_size} processes (trainer.devices x trainer.num_nodes); make it a multiple of "
                f"{trainer.world_size}."
            )

    @override
    def on_rollout_end(self, trainer: Trainer, pl_module: LightningModule, rollout: Rollout) -> Rollout | None:
        """A rollout of exactly ``num_groups`` informative groups, fewer (ran out, ``train``) or none (an empty
        rollout: skip the step); None when ``rollout`` is already exactly that."""
        target = self.num_groups // collectives.world_size() if self.num_groups else rollout.num_groups
        parts, count = [], dict.fromkeys(("groups_drawn", "groups_dropped", "groups_surplus", "tokens_drawn"), 0)
        held, rounds, current = 0, 0, rollout
        while True:
            informative, n_groups = self.informative_groups(current)
            chosen = informative[: target - held]
            parts.append(current.select(torch.isin(current.group, chosen).nonzero().flatten()))
            held += len(chosen)
            count["groups_drawn"] += n_groups
            count["groups_dropped"] += n_groups - len(informative)
            count["groups_surplus"] += len(informative) - len(chosen)
            count["tokens_drawn"] += int(current.completion_mask.sum())
            if held == target or rounds == self.max_rounds:
                break
            rounds += 1
            current = pl_module.draw_rollout()
        exhausted = held < target
        skip = exhausted and (self.on_exhausted == "skip" or held == 0)
        maxima = {"rounds": rounds, "exhausted": exhausted, "skip": skip}  # one process skipping skips all
        step = _over_ranks({**count, "held": held, "target": target}, maxima, pl_module)
        if step["exhausted"] and not self.warned:  # once: a filter that runs out often would warn every step
            self.warned = True
            action = "skipping the step" if step["skip"] else f"training on {step['held']}"
            advice = (
                "Raise max_rounds or the batch size to fill the step."
                if step["held"]
                else "Not one group had rewards that differ: more rounds will not help if the reward is the same for "
                "every completion (check the reward functions' reward/* metrics) or every prompt is far too hard "
                "or too easy for the model."
            )
            rank_zero_warn(
                f"DynamicSampling: step {trainer.global_step}: {step['held']} of {step['target']} informative groups "
                f"after {step['rounds']} extra rounds ({step['groups_drawn']} groups drawn, {step['groups_dropped']} "
                f"with all rewards equal); {action}. {advice} Later steps that run out are not warned about: "
                "dynamic_sampling/exhausted counts them."
            )
        logged = {key: step[key] for key in (*count, "rounds", "exhausted")}
        self._log({**logged, "groups_kept": 0 if step["skip"] else step["held"]})
        if skip:
            return rollout.select([])
        if len(parts) == 1 and len(parts[0]) == len(rollout):
            return None  # every group informative and none surplus: the rollout stands as it is
        return concat_rollouts([part for part in parts if len(part)])

    def informative_groups(self, rollout: Rollout) -> tuple[Tensor, int]:
        """Ids of ``rollout``'s groups whose rewards span more than ``atol``, in order of their first row, and the
        number of groups. A group of one row is uniform."""
        if rollout.reward is None:
            raise ValueError(
                "DynamicSampling needs a scored rollout (rollout.reward set): call on_rollout_end after scoring."
            )
        ids, index = torch.unique(rollout.group, return_inverse=True)
        reward = rollout.reward.detach().to(torch.float64)
        high = reward.new_full(ids.shape, -math.inf).scatter_reduce(0, index, reward, "amax")
        low = reward.new_full(ids.shape, math.inf).scatter_reduce(0, index, reward, "amin")
        rows = torch.arange(len(index), device=index.device)
        order = rows.new_full(ids.shape, len(index)).scatter_reduce(0, index, rows, "amin").argsort()  # by first row
        return ids[order][(high - low)[order] > self.atol], len(ids)

    def _log(self, step: dict[str, int | bool]) -> None:
        drawn = step["groups_drawn"]
        informative = drawn - step["groups_dropped"]
        self.totals["steps"] += 1
        self.totals["exhausted_steps"] += int(step["exhausted"])
        for key in ("groups_drawn", "groups_kept", "rounds", "tokens_drawn"):
            self.totals[key] += int(step[key])
        metrics = {**step, "informative_frac": informative / drawn if drawn else 0.0}
        metrics.update({f"total_{key}": value for key, value in self.totals.items()})
        self.batch_values.add({f"dynamic_sampling/{k}": float(v) for k, v in metrics.items()})

    @override
    def on_train_batch_end(self, trainer: Trainer, *_: Any) -> None:
        self.batch_values.publish(trainer)

    @override
    def state_dict(self) -> dict[str, Any]:
        return dict(self.totals)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.totals.update({key: int(state_dict[key]) for key in TOTALS if key in state_dict})


def _over_ranks(sums: dict[str, int], maxima: dict[str, int | bool], pl_module: LightningModule) -> dict[str, int]:
    """``sums`` summed and ``maxima`` maximised over the processes of a distributed run (as given otherwise)."""
    if collectives.world_size() == 1:
        return {**sums, **{key: int(value) for key, value in maxima.items()}}
    device = pl_module.device
    total = collectives.reduce_over_ranks(torch.tensor(list(sums.values()), device=device), "sum").tolist()
    high = collectives.reduce_over_ranks(torch.tensor([int(v) for v in maxima.values()], device=device), "max").tolist()
    return {**dict(zip(sums, total, strict=True)), **dict(zip(maxima, high, strict=True))}
