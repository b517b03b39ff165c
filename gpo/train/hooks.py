"""The two rollout hooks gpo adds to Lightning's, declared on a Callback base class, and the calls that run them.

Any LightningModule can run them from its own ``training_step`` with one line each::

    batch = run_prompt_hooks(self.trainer, self, batch)        # before sampling
    rollout = run_rollout_hooks(self.trainer, self, rollout)   # after scoring, before the loss

and provide what the callbacks it uses read by subclassing ``RolloutSource`` (each callback's docstring says which
members it reads).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from gpo.rollout.base import Rollout, RolloutEngine
from gpo.suggest import did_you_mean

if TYPE_CHECKING:  # gpo.callbacks imports this file and stays free of transformers
    import torch
    from transformers import PreTrainedTokenizerBase

    from gpo.models.scorer import TokenScorer


class RolloutCallback(Callback):
    """A Lightning ``Callback`` with gpo's two extra hooks, as no-ops to override (mark them ``@override``).

    A subclass method named ``on_...`` that is none of Lightning's hooks nor these two is refused when the class is
    defined: a misspelt hook would otherwise never run. A module that never runs a hook the subclass overrides (its
    ``training_step`` lacks the ``run_*_hooks`` call) is warned about once, ``HOOK_CHECK_STEPS`` optimiser steps into
    the fit; a subclass that overrides ``on_train_batch_start`` calls ``super().on_train_batch_start(...)`` to keep
    that check.
    """

    # class defaults: a subclass need not call __init__; run_prompt_hooks and run_rollout_hooks record the hooks run
    _hooks_ran: frozenset[str] = frozenset()
    _first_step: int | None = None
    _hooks_checked = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        hooks = [name for name in dir(RolloutCallback) if name.startswith("on_")]
        for name, value in vars(cls).items():
            if name.startswith("on_") and callable(value) and name not in hooks:
                guess = did_you_mean(name, hooks)
                hint = f"; {guess}" if guess else f"; the rollout hooks are {ROLLOUT_HOOKS}."
                raise TypeError(f"{cls.__name__}.{name} is not a hook of Lightning's Callback or RolloutCallback{hint}")

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Once, ``HOOK_CHECK_STEPS`` optimiser steps into this process's run, warn about each overridden rollout hook
        that has not run: the module's ``training_step`` lacks its call. Steps, not batches: a pipelined GPOModule's
        first batches only fill its queue, and a skipped step takes none."""
        if self._hooks_checked:
            return
        if self._first_step is None:
            self._first_step = trainer.global_step
        if trainer.global_step - self._first_step < HOOK_CHECK_STEPS:
            return
        self._hooks_checked = True
        for name, call in HOOK_CALLS.items():
            overridden = getattr(type(self), name) is not getattr(RolloutCallback, name)
            if overridden and name not in self._hooks_ran:
                rank_zero_warn(
                    f"{type(self).__name__}.{name} has not run in {HOOK_CHECK_STEPS} optimiser steps, so it does "
                    f"nothing: {type(pl_module).__name__}.training_step must call {call} (GPOModule does)."
                )

    def on_prompts(self, trainer: Trainer, pl_module: LightningModule, batch: dict[str, Any]) -> dict[str, Any] | None:
        """Before sampling: return a filtered batch of prompts (same keys), or None to keep ``batch``."""

    def on_rollout_end(self, trainer: Trainer, pl_module: LightningModule, rollout: Rollout) -> Rollout | None:
        """After scoring, before advantages and training: return a replacement rollout (more or fewer groups; an
        empty one skips the step), or None to keep ``rollout``."""


#: The call in a module's ``training_step`` that runs each hook.
HOOK_CALLS = {
    "on_prompts": "gpo.train.hooks.run_prompt_hooks(trainer, module, batch) before sampling",
    "on_rollout_end": "gpo.train.hooks.run_rollout_hooks(trainer, module, rollout) after scoring",
}
ROLLOUT_HOOKS = tuple(HOOK_CALLS)

#: Optimiser steps after which a rollout hook that never ran is warned about.
HOOK_CHECK_STEPS = 10


def warn_unreached_hooks(callbacks: Sequence[Callback]) -> None:
    """Warn about each callback that defines a rollout hook without being a ``RolloutCallback``: only those are run."""
    for callback in callbacks:
        defined = [name for name in ROLLOUT_HOOKS if callable(getattr(callback, name, None))]
        if defined and not isinstance(callback, RolloutCallback):
            rank_zero_warn(
                f"{type(callback).__name__} defines {' and '.join(defined)} but is a plain Callback, so it is never "
                "called: subclass gpo.train.hooks.RolloutCallback instead."
            )


def run_prompt_hooks(trainer: Trainer, pl_module: LightningModule, batch: dict[str, Any]) -> dict[str, Any]:
    """``on_prompts`` of every ``RolloutCallback`` of the trainer, in order; each sees the previous one's batch. A
    filtered batch that is not a dict with the keys of the one given, or whose columns disagree on the number of
    prompts, is refused naming the callback (``check_prompts``)."""
    for callback in trainer.callbacks:
        if isinstance(callback, RolloutCallback):
            callback._hooks_ran |= {"on_prompts"}
            filtered = callback.on_prompts(trainer, pl_module, batch)
            if filtered is not None:
                check_prompts(filtered, batch, f"{type(callback).__name__}.on_prompts")
                batch = filtered
    return batch


def check_prompts(filtered: object, given: Mapping[str, Any], where: str) -> None:
    """Refuse a batch of prompts returned by ``where`` that is not a dict with the keys of the batch it was ``given``,
    or whose ``prompt``, ``prompt_ids`` and ``fields`` columns hold different numbers of prompts."""
    if not isinstance(filtered, Mapping):
        raise TypeError(f"{where} returned {type(filtered).__name__}; return the batch it was given with its rows "
                        "filtered (a dict with the same keys), or None to keep it.")  # fmt: skip
    lost = sorted(given.keys() - filtered.keys())
    if lost:
        raise ValueError(f"{where} returned a batch without {lost}; keep every key of the batch it was given.")
    columns = {name: filtered[name] for name in ("prompt", "prompt_ids") if name in filtered}
    columns |= {f"fields[{key!r}]": values for key, values in filtered.get("fields", {}).items()}
    counts = {name: len(values) for name, values in columns.items()}
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"{name} {count}" for name, count in counts.items())
        raise ValueError(f"{where} returned a batch whose columns hold different numbers of prompts ({shown}); filter "
                         "every column alike.")  # fmt: skip


def run_rollout_hooks(trainer: Trainer, pl_module: LightningModule, rollout: Rollout) -> Rollout:
    """``on_rollout_end`` of every ``RolloutCallback`` of the trainer, in order; each sees the previous one's
    rollout. The result may be empty (test ``len(rollout) == 0``): then skip the step. A rollout whose fields
    disagree on its row count is refused before any callback reads it, and after each callback naming it
    (``Rollout.check_rows``), as is a callback's return that is neither a ``Rollout`` nor None."""
    rollout.check_rows()
    for callback in trainer.callbacks:
        if isinstance(callback, RolloutCallback):
            callback._hooks_ran |= {"on_rollout_end"}
            replaced = callback.on_rollout_end(trainer, pl_module, rollout)
            where = f"{type(callback).__name__}.on_rollout_end"
            if replaced is not None and not isinstance(replaced, Rollout):
                raise TypeError(f"{where} returned {type(replaced).__name__}; return a Rollout (an empty one skips "
                                "the step) or None to keep the rollout it was given.")  # fmt: skip
            rollout = rollout if replaced is None else replaced
            try:
                rollout.check_rows()
            except ValueError as err:
                raise ValueError(f"after {where}: {err}") from None
    return rollout


class WeightSync(Callback):
    """A callback that pushes the trained policy's weights into an engine holding its own copy of them (a vLLM
    engine) before it samples, gpo's being ``gpo.callbacks.VLLMWeightSync``. Without one among the trainer's
    callbacks, fitting with such an engine warns and evaluating a checkpoint with it is refused."""


class RolloutSource:
    """What gpo's callbacks may read from the LightningModule they run with; mix it into yours and set what the
    callbacks you use read (``GPOModule`` has all of it):

    - ``draw_rollout()``: ``DynamicSampling`` draws more groups with it.
    - ``engine``: ``VLLMWeightSync`` pushes the policy's weights into it (``update_weights``) and samples its probe.
    - ``policy``: the trained model whose weights ``VLLMWeightSync`` pushes (a transformers causal LM, or a peft
      model wrapping one).
    - ``scorer``: a ``gpo.models.scorer.TokenScorer`` of ``policy``; ``VLLMWeightSync`` verifies with it,
      ``RolloutMonitor`` computes the entropy with it (``compute_entropy``).
    - ``tokenizer``: the policy's tokenizer; ``VLLMWeightSync`` tokenises its probe prompts with it, ``ExportPolicy``
      saves it beside the weights.
    """

    engine: RolloutEngine
    policy: torch.nn.Module
    scorer: TokenScorer
    tokenizer: PreTrainedTokenizerBase

    def draw_rollout(self) -> Rollout:
        """Sample and score another batch of training prompts: a ``Rollout`` with ``reward`` and ``group`` set."""
        raise NotImplementedError(
            f"{type(self).__name__} does not implement RolloutSource.draw_rollout, which DynamicSampling calls to "
            "draw more groups; implement it, or use DynamicSampling(max_rounds=0) to only filter."
        )


def require_source(callback: Callback, pl_module: LightningModule, reads: tuple[str, ...], purpose: str = "") -> None:
    """Refuse, when a callback is set up, a module that does not declare ``RolloutSource`` or has not set the members
    the callback ``reads`` of it (``purpose``: what for, in the message)."""
    declared = isinstance(pl_module, RolloutSource)
    missing = [name for name in reads if not _provides(pl_module, name)] if declared else list(reads)
    if missing:
        module, fix = type(pl_module).__name__, "set them" if declared else "mix gpo.train.hooks.RolloutSource into it"
        state = f"has not set {', '.join(missing)}" if declared else "does not declare them"
        raise TypeError(
            f"{type(callback).__name__} reads the module's {', '.join(reads)}{purpose}, and {module} {state}: {fix}."
        )


def _provides(module: RolloutSource, name: str) -> bool:
    """Whether ``module`` has set ``name``, or implemented it when ``RolloutSource`` declares it as a method."""
    declared = vars(RolloutSource).get(name)
    return getattr(type(module), name, None) is not declared if callable(declared) else hasattr(module, name)
