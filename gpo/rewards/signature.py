"""Reward functions checked against how they are called, ``fn(prompts, completions, **columns)``, and against the
dataset columns they need, before any sampling; each error names the ``model.rewards`` entry and the fix."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpo.rewards.runner import reward_name

#: Columns the trainer adds to every reward call (``gpo.rewards.runner.score``), whatever the dataset holds.
TRAINER_COLUMNS = frozenset({"completion_ids"})
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def check_reward_signature(fn: Any, index: int) -> None:
    """Refuse a reward that cannot be called as ``fn(prompts, completions, **columns)``."""
    name = f"model.rewards[{index}]"
    if not callable(fn):
        raise TypeError(
            f"{name}={fn!r} is not callable; give a function (prompts, completions, **columns) -> list[float] "
            "(an import path such as gpo.rewards.exact_match is read in YAML; in Python, import the function)."
        )
    if isinstance(fn, type):  # called, it would build an instance, not score
        raise TypeError(f"{name} is the class {fn.__name__}; give an instance, {fn.__name__}(...), whose __call__ "
                        "scores (prompts, completions, **columns).")  # fmt: skip
    parameters = _parameters(fn)
    if parameters is None or any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return
    positional = [p.name for p in parameters if p.kind in _POSITIONAL]
    if len(positional) < 2:
        raise TypeError(
            f"{name} ({reward_name(fn)}) takes positional parameters {positional}, but a reward is called as "
            "fn(prompts, completions, **columns); give it (prompts, completions, **kwargs) first."
        )


def required_columns(fn: Callable[..., Any]) -> list[str]:
    """Dataset columns ``fn`` cannot run without: those it declares in ``required_columns`` (built-ins that read
    ``**columns``) and its named parameters without a default after ``(prompts, completions)``."""
    declared = list(getattr(fn, "required_columns", ()))
    named = [p.name for p in _column_parameters(fn) or () if p.default is inspect.Parameter.empty]
    return declared + [name for name in named if name not in declared]


def check_reward_columns(rewards: Sequence[Any], columns: Mapping[str, Sequence[str]], prompt_column: str) -> None:
    """Every reward gets the columns it needs, and no column it cannot take, from every dataset it scores.

    ``columns`` maps a dataset's config field (``data.path=...``) to its column names; rewards see all of them
    but ``prompt_column`` (passed as ``prompts``), plus ``completion_ids``.
    """
    for source, names in columns.items():
        given = (set(names) - {prompt_column}) | TRAINER_COLUMNS
        for fn in rewards:
            missing = [column for column in required_columns(fn) if column not in given]
            if missing:
                raise ValueError(
                    f"the reward {reward_name(fn)} needs column(s) {missing}; {source} has {list(names)} "
                    f"({prompt_column!r} is data.prompt_column). Add the column to the dataset, or use a reward "
                    f"that does not need it."
                )
            parameters = _column_parameters(fn)
            if parameters is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in _parameters(fn)):
                continue
            unknown = sorted(given - {p.name for p in parameters})
            if unknown:
                raise ValueError(
                    f"the reward {reward_name(fn)} is called with column(s) {unknown} from {source}, which it does not "
                    f"take; add **kwargs to its parameters so it ignores the columns it does not use."
                )


def _parameters(fn: Callable[..., Any]) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return None


def _column_parameters(fn: Callable[..., Any]) -> list[inspect.Parameter] | None:
    """The named parameters after ``(prompts, completions)``: the columns ``fn`` takes by name."""
    parameters = _parameters(fn)
    if parameters is None:
        return None
    first_two = [p for p in parameters if p.kind in _POSITIONAL][:2]
    return [p for p in parameters if p.kind in _NAMED and p not in first_two]


def check_reward_names(rewards: Sequence[Any]) -> None:
    """Each reward's mean is logged as ``reward/<name>``: two with one name would share the key, one of them lost."""
    names = [reward_name(fn) for fn in rewards]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        where = ", ".join(f"model.rewards[{i}]" for i, name in enumerate(names) if name in twice)
        raise ValueError(
            f"{where} are all named {twice[0]!r}: their means would be logged under one key (reward/{twice[0]}). "
            "Give each its own name: a def of its own, a `name` attribute, or fn.__name__ = '...' for a lambda."
        )
