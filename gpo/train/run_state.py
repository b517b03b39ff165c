"""What a checkpoint holds of a run beyond weights, optimiser, scheduler and loop counters: every random generator,
the extra prompt batches drawn, the non-finite streak; per rank, as checkpoint-safe values."""

from __future__ import annotations

import dataclasses
import logging
import random
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn

import gpo.algo
from gpo.algo.state import PartState
from gpo.parallel import collectives

log = logging.getLogger(__name__)


def capture_random_state() -> dict[str, Any]:
    """The states of Python's, NumPy's and torch's global generators (CPU and every CUDA device), as tensors and
    plain values that ``torch.load(weights_only=True)`` accepts."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }  # fmt: skip
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_random_state(state: dict[str, Any]) -> None:
    """Put back what ``capture_random_state`` captured."""
    random.setstate(_as_tuples(state["python"]))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["kind"], keys, n["position"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuples(value: Any) -> Any:
    """Python's generator state is nested tuples; a checkpoint round trip may hand lists back."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, list | tuple) else value


def run_state(
    extra_batches_drawn: int, nonfinite_streak: int, parts: dict[str, Any], pipeline: dict[str, Any] | None = None
) -> dict[str, Any]:
    """This run's state for ``checkpoint["gpo"]``. Under DDP each rank has its own draws (extra prompt batches,
    generators), its algorithm parts' state (``part_states``: a gate or mask sees this rank's rows) and its own
    rollouts collected ahead (``pipeline``): every rank's are gathered (a collective: every rank calls it) and kept
    under ``ranks``."""
    own = {"random_state": capture_random_state(), "extra_batches_drawn": extra_batches_drawn, "parts": parts}
    ranks = collectives.gather_objects(own if pipeline is None else {**own, "pipeline": pipeline})
    state = {**ranks[0], "nonfinite_streak": nonfinite_streak}
    return {**state, "ranks": ranks} if len(ranks) > 1 else state


def restored_run_state(state: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """This rank's part of a saved ``run_state`` (rank 0's, with a warning, when the number of processes changed)
    and the non-finite streak."""
    ranks, size = state.get("ranks", [state]), collectives.world_size()
    if len(ranks) != size:
        log.warning("checkpoint of %d processes resumed by %d: all resume rank 0's draws", len(ranks), size)
    return (ranks[collectives.rank()] if len(ranks) == size else ranks[0]), state.get("nonfinite_streak", 0)


PLAIN = (str, int, float, bool, type(None))


def describe(part: object) -> str:
    """``Name(setting=value, ...)`` of an algorithm part, for run descriptions: its public attributes that are plain
    values or lists of them, except what it declares as its state (``PartState.state_dict``: what it learns as it
    runs is not a setting); a part held inside it, such as an adaptive controller, is left out."""
    state = part.state_dict() if isinstance(part, PartState) else {}
    settings = {k: v for k, v in sorted(vars(part).items()) if not k.startswith("_") and k not in state and is_plain(v)}
    return f"{type(part).__name__}({', '.join(f'{k}={v!r}' for k, v in settings.items())})"


def is_plain(value: object) -> bool:
    return isinstance(value, PLAIN) or (isinstance(value, list | tuple) and all(isinstance(v, PLAIN) for v in value))


def changed_keys(saved: dict[str, str], current: dict[str, str]) -> list[str]:
    """The keys of ``saved`` that ``current`` holds with another value (a key one of them lacks is not compared)."""
    return [key for key in saved if key in current and saved[key] != current[key]]


def described_differences(saved: dict[str, str], current: dict[str, str], keys: list[str]) -> list[str]:
    """``key: SAVED in the checkpoint, CURRENT now`` for each of ``keys``."""
    return [f"{key}: {saved[key]} in the checkpoint, {current[key]} now" for key in keys]


#: The keys of ``describe_run`` that describe an algorithm part (``describe``).
PART_KEYS = ("advantage", "gate", "aggregator")


def check_same_run(saved: dict[str, str], current: dict[str, str], checkpoint: str) -> None:
    """Refuse to resume a checkpoint written under another model or algorithm, naming each difference."""
    changed = changed_keys(saved, current)
    differences = described_differences(saved, current, changed)
    if differences:
        own = _own_part_described_otherwise(saved, current, changed)
        learnt = (
            f" If {own} changes a public attribute as it runs, that attribute is its state, not a setting: return it "
            "from state_dict() and take it back in load_state_dict() (gpo.algo.state.PartState), or name it with a "
            "leading underscore."
            if own is not None
            else ""
        )
        raise ValueError(
            f"{checkpoint} was written by another run ({'; '.join(differences)}): resuming would continue its weights "
            "under this configuration. Resume with the configuration that wrote it (saved as config.yaml in the run's "
            "lightning_logs/version_N folder), or start this run in another folder (--trainer.default_root_dir DIR)."
            + learnt
        )


def _own_part_described_otherwise(saved: dict[str, str], current: dict[str, str], changed: list[str]) -> str | None:
    """The class of a part of one's own (not one of gpo.algo's) that ``saved`` and ``current`` describe otherwise
    under the same class name, or None."""
    for key in changed:
        name = saved[key].partition("(")[0]
        if key in PART_KEYS and name == current[key].partition("(")[0] and not hasattr(gpo.algo, name):
            return name
    return None


#: What in ``describe_run`` decides the weights' names and shapes.
WEIGHTS_KEYS = ("model", "trainer_mode")


def check_same_weights(saved: dict[str, str], current: dict[str, str]) -> None:
    """Refuse to load a checkpoint's weights into a policy of another shape (a LoRA run's into a full one, another
    model), naming each difference, before Lightning lists every missing and unexpected parameter."""
    differences = described_differences(saved, current, [k for k in changed_keys(saved, current) if k in WEIGHTS_KEYS])
    if differences:
        raise ValueError(
            f"the checkpoint's weights belong to another policy ({'; '.join(differences)}): give GPOModule the "
            "policy, trainer_mode and lora settings of the run that wrote it."
        )


#: Settings whose value a resume takes from the checkpoint's optimiser state, whatever the configuration says now.
RESTORED_FROM_CHECKPOINT = ("model.optim.lr", "model.optim.weight_decay")
#: Optimisation settings that change neither the updates nor what is sampled (memory; when to give up).
REPLAY_NEUTRAL = frozenset({"micro_batch_size", "max_consecutive_nonfinite"})


def describe_settings(module) -> dict[str, str]:
    """The settings of a ``GPOModule``'s run a resume may change without becoming another run (``describe_run``),
    by their configuration keys where they have one: optimisation, the engine's sampling (a multi-turn engine's per
    episode: turns x each turn's), the reward mixer, the KL, entropy and distillation terms, token weights and
    masks, step rewards, the rollout correction, where old log-probs come from, the pipeline's lag, the rollout
    seed."""
    learner, objective = module.learner, module.learner.objective
    optim = {k: v for k, v in dataclasses.asdict(learner.optim).items() if k not in REPLAY_NEUTRAL}
    return {
        **{f"model.optim.{k}": repr(v) for k, v in optim.items()},
        "the engine's sampling": repr(module.collector.engine.sampling),
        "model.mixer": describe(module.collector.mixer),
        "model.kl": describe_optional(objective.kl if objective.kl is not None else learner.reward_kl),
        "model.entropy": describe_optional(objective.entropy),
        "model.distill": describe_optional(objective.distill),
        "model.token_weights": describe_all(objective.token_weights),
        "model.masks": describe_all(objective.masks),
        "model.step_rewards": describe_optional(module.credit.step_rewards),
        "model.correction": describe_optional(learner.correction),
        "model.old_logprobs": learner.old_logprobs,
        "model.max_off_policy_steps": str(module.feed.lag),
        "the rollout seed (model.seed, else seed_everything)": repr(module.collector.seed),
    }


def describe_optional(part: object | None) -> str:
    return "None" if part is None else describe(part)


def describe_all(parts: list[object]) -> str:
    return "[" + ", ".join(map(describe, parts)) + "]"


def warn_changed_settings(saved: dict[str, str], current: dict[str, str]) -> None:
    """Warn once, naming each setting changed since the checkpoint: the resumed run goes on with the new values
    (except those ``RESTORED_FROM_CHECKPOINT``, which the restored optimiser keeps), so it does not replay the run
    that wrote the checkpoint."""
    changed = changed_keys(saved, current)
    if not changed:
        return
    parts = [_change(key, saved[key], current[key]) for key in changed]
    kept = any(key in RESTORED_FROM_CHECKPOINT for key in changed)
    rank_zero_warn(
        f"resumed with settings changed since the checkpoint: {'; '.join(parts)}. The run goes on with them, so it "
        "does not replay the one that wrote the checkpoint"
        + ("; to change the learning rate, start a new run from the exported policy." if kept else ".")
    )


def _change(key: str, before: str, after: str) -> str:
    kept = f" (not applied: the optimiser state restored from the checkpoint keeps {before})"
    return f"{key} {before} -> {after}{kept if key in RESTORED_FROM_CHECKPOINT else ''}"


def describe_run(module) -> dict[str, str]:
    """What makes a ``GPOModule``'s run that run: model, trainer mode, algorithm parts (``describe``), rewards, group
    size."""
    from gpo.models.loading import is_peft
    from gpo.rewards.runner import reward_name

    objective, model = module.learner.objective, module.model
    return {
        "model": f"{model.config.model_type}, {sum(p.numel() for p in model.parameters())} parameters",
        "trainer_mode": "lora" if is_peft(module.policy) else "full",
        "advantage": describe(module.credit.advantage),
        "gate": describe(objective.gate),
        "aggregator": describe(objective.aggregator),
        "rewards": ", ".join(map(reward_name, module.collector.rewards)),
        "group_size": str(module.collector.group_size),
    }


def stateful_parts(module) -> dict[str, PartState]:
    """A ``GPOModule``'s algorithm parts, by name, whose state a checkpoint keeps (``gpo.algo.state``)."""
    objective = module.learner.objective
    return {"advantage": module.credit.advantage, "gate": objective.gate, "aggregator": objective.aggregator,
            "mixer": module.collector.mixer, **{f"masks/{i}": mask for i, mask in enumerate(objective.masks)},
            **{f"token_weights/{i}": weight for i, weight in enumerate(objective.token_weights)}}  # fmt: skip


def part_states(module) -> dict[str, dict[str, Any]]:
    """The state of each part of ``module`` that keeps one."""
    states = {name: part.state_dict() for name, part in stateful_parts(module).items()}
    return {name: state for name, state in states.items() if state}


def load_part_states(module, states: dict[str, dict[str, Any]]) -> None:
    """Give each part of ``module`` its state from ``part_states`` (a part the configuration no longer has, which
    the resume has warned about, is skipped)."""
    parts = stateful_parts(module)
    for name, state in states.items():
        if name in parts:
            parts[name].load_state_dict(state)
