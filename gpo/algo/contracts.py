"""What a part of one's own must be for the trainer to use it: an instance of its kind, whose ``__call__`` takes what
the trainer gives it and returns what the trainer reads; each breach refused naming the part and the fix."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from gpo.algo.gates.base import Metrics, RatioGate
from gpo.algo.masks import TokenMask
from gpo.algo.mixers import RewardMixer
from gpo.algo.weighting import TokenWeight

#: The list arguments of token parts: the kind of part each takes.
TOKEN_PARTS: dict[str, type] = {"masks": TokenMask, "token_weights": TokenWeight}
#: Where a part of each kind goes, for a token part given in the wrong place.
TOKEN_PART_PLACES: dict[type, str] = {
    **{kind: f"did you mean {field}=?" for field, kind in TOKEN_PARTS.items()},
    RatioGate: "a gate goes in the algorithm, Custom(gate=...).",
}
#: What a weight that drops tokens (``drops_tokens``) can read: the rollout's flags, before any model pass.
DROPPING_INPUTS = frozenset({"truncated"})
#: What a weight that scales advantages cannot read: it is fixed for the step, before any gradient pass.
PASS_ONLY_INPUTS = frozenset({"logp", "old_logp", "adv", "entropy"})


def check_instance(label: str, part: object, kind: type, elsewhere: Mapping[type, str]) -> None:
    """Refuse ``part``, given as ``label`` (``"Custom(gate={})"``: ``{}`` stands for the part), unless it is an
    instance of ``kind``: a class where an instance belongs, or a value of another kind, with where a part of that
    kind goes (``elsewhere``: advice by kind) when it is one."""
    name = part.__name__ if isinstance(part, type) else type(part).__name__
    if isinstance(part, type):
        raise TypeError(f"{label.format(name)}: give an instance, {name}(...), not the class.")
    if not isinstance(part, kind):
        shown = repr(part) if isinstance(part, str | int | float) else f"{name}(...)"
        other = next((other for other in elsewhere if isinstance(part, other)), None)
        hint = f"; {name} is a gpo.algo.{other.__name__}: {elsewhere[other]}" if other else "."
        raise TypeError(f"{label.format(shown)} takes a gpo.algo.{kind.__name__}{hint}")


def check_call(label: str, part: object, arguments: Sequence[str], named: Iterable[str]) -> None:
    """Refuse a part whose ``__call__`` cannot take ``arguments`` by position and ``named`` (what its ``requires``
    names) by keyword, as the trainer calls it; a ``__call__`` without a signature to read is let through."""
    named = sorted(named)
    try:
        signature = inspect.signature(part)
    except (TypeError, ValueError):  # builtins and some C callables have none
        return
    try:
        signature.bind(*arguments, **dict.fromkeys(named))
    except TypeError as err:
        name, given = type(part).__name__, ", ".join([*arguments, *(f"{key}=" for key in named)])
        keywords = "; the keyword arguments are what its requires names" if hasattr(part, "requires") else ""
        raise TypeError(
            f"{label.format(name + '(...)')}: {name}.__call__ must take ({given}): {err}{keywords}."
        ) from None


def check_token_parts(masks: Sequence[TokenMask], token_weights: Sequence[TokenWeight]) -> None:
    """Refuse ``masks`` and ``token_weights`` that are not lists of parts of their kind, whose ``__call__`` take
    ``(mask, **inputs)`` with the inputs their ``requires`` names (a weight that drops tokens: ``DROPPING_INPUTS``
    alone): otherwise found only at the first step, as an AttributeError or a torch error."""
    for field, parts in (("masks", masks), ("token_weights", token_weights)):
        if isinstance(parts, TokenMask | TokenWeight):
            name = type(parts).__name__
            raise TypeError(f"{field}={name}(...) is one part; give a list of parts: {field}=[{name}(...)].")
        if isinstance(parts, str) or not isinstance(parts, Sequence):
            raise TypeError(f"{field} is a {type(parts).__name__}; give a list of parts.")
        for index, part in enumerate(parts):
            check_instance(f"{field}[{index}]={{}}", part, TOKEN_PARTS[field], TOKEN_PART_PLACES)
            check_requires(part)
            if isinstance(part, TokenWeight) and part.drops_tokens and not part.requires <= DROPPING_INPUTS:
                raise TypeError(f"{field}[{index}]={type(part).__name__}(...) drops tokens (drops_tokens = True) and "
                                f"requires {sorted(part.requires)}, but a dropping weight reads only "
                                f"{sorted(DROPPING_INPUTS)}, before any model pass.")  # fmt: skip
            if isinstance(part, TokenWeight) and not part.drops_tokens and part.requires & PASS_ONLY_INPUTS:
                raise TypeError(f"{field}[{index}]={type(part).__name__}(...) requires "
                                f"{sorted(part.requires & PASS_ONLY_INPUTS)}, but a token weight is fixed for the step "
                                "before any gradient pass: it reads step inputs only (ref_logp, rollout_logp, "
                                "train_logp, teacher_logp); a TokenMask reads the others.")  # fmt: skip
            check_call(f"{field}[{index}]={{}}", part, ("mask",), part.requires)


def check_requires(part: RatioGate | TokenMask | TokenWeight) -> None:
    """Refuse a ``requires`` that is not a set of input names (a string would be read as its characters)."""
    if not isinstance(part.requires, frozenset | set):
        raise TypeError(f"{type(part).__name__}.requires={part.requires!r} must be a frozenset of input names, e.g. "
                        "frozenset({'ref_logp'}) (docs/algorithms.md lists them).")  # fmt: skip


def checked_gate_output(out: object, gate: RatioGate, mask: Tensor, logp: Tensor) -> tuple[Tensor, Metrics]:
    """``gate``'s output ``out`` if it keeps ``RatioGate.__call__``'s contract: ``(per_token_loss[B, T], metrics)``
    with a loss that carries ``logp``'s gradient and 0-d tensors as metrics; else a ValueError naming the gate."""
    name = f"the ratio gate {type(gate).__name__}"
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], Tensor) and isinstance(out[1], dict)):
        raise ValueError(f"{name} returned {type(out).__name__}; RatioGate.__call__ returns (per_token_loss[B, T], "
                         "metrics), metrics a dict of detached 0-d tensors.")  # fmt: skip
    loss, metrics = out
    if loss.shape != mask.shape:
        raise ValueError(f"{name} returned per_token_loss of shape {list(loss.shape)}; RatioGate.__call__ returns "
                         f"one loss per token, [B, T] = {list(mask.shape)}.")  # fmt: skip
    if torch.is_grad_enabled() and logp.requires_grad and not loss.requires_grad:
        raise ValueError(f"{name} returned a per_token_loss without gradient (detached from logp): the policy would "
                         "not learn from it.")  # fmt: skip
    check_metrics(name, metrics)
    return loss, metrics


def checked_mask_output(out: object, token_mask: TokenMask, mask: Tensor) -> tuple[Tensor, Metrics]:
    """``token_mask``'s output ``out`` if it keeps ``TokenMask.__call__``'s contract: ``(keep[B, T] bool, metrics)``
    with 0-d tensors as metrics; else a ValueError naming the mask."""
    name = f"the token mask {type(token_mask).__name__}"
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], Tensor) and isinstance(out[1], dict)):
        raise ValueError(f"{name} returned {type(out).__name__}; TokenMask.__call__ returns (keep[B, T] bool, "
                         "metrics), metrics a dict of detached 0-d tensors.")  # fmt: skip
    keep, metrics = out
    if keep.dtype != torch.bool or keep.shape != mask.shape:
        raise ValueError(
            f"{name} returned keep of dtype {keep.dtype} and shape {list(keep.shape)}; TokenMask.__call__ returns "
            f"one bool per token, [B, T] = {list(mask.shape)} (e.g. (mask > 0) & condition)."
        )
    check_metrics(name, metrics)
    return keep, metrics


def checked_weight_output(w: object, weight: TokenWeight, mask: Tensor) -> Tensor:
    """``weight``'s output ``w`` if it is one factor per token, ``[B, T]``; else a ValueError naming the weight (a
    ``[B]`` or ``[T]`` tensor would broadcast, or fail, far from it)."""
    if not isinstance(w, Tensor) or w.shape != mask.shape:
        shape = list(w.shape) if isinstance(w, Tensor) else type(w).__name__
        raise ValueError(f"the token weight {type(weight).__name__} returned {shape}; TokenWeight.__call__ returns "
                         f"one weight per token, [B, T] = {list(mask.shape)}.")  # fmt: skip
    return w


def checked_mixer_output(reward: object, mixer: RewardMixer, scores: Tensor) -> Tensor:
    """``mixer``'s output ``reward`` if it is one finite reward per completion, ``[B]`` for ``scores[B, K]``; else a
    ValueError naming the mixer (the scores are finite: the reward runner refuses or replaces others). A NaN reward
    would otherwise vanish into a zero advantage (a group's NaN standard deviation divides nothing)."""
    name, rows = f"the reward mixer {type(mixer).__name__}", scores.shape[0]
    if not isinstance(reward, Tensor) or reward.shape != (rows,):
        shape = list(reward.shape) if isinstance(reward, Tensor) else type(reward).__name__
        raise ValueError(f"{name} returned {shape}; RewardMixer.__call__ returns one reward per completion, [B] = "
                         f"[{rows}].")  # fmt: skip
    not_finite = int((~torch.isfinite(reward)).sum())
    if not_finite:
        raise ValueError(f"{name} returned a reward that is not finite (nan or inf) for {not_finite} of {rows} "
                         "completions, whose reward functions' scores are finite.")  # fmt: skip
    return reward


def check_metrics(name: str, metrics: Metrics) -> None:
    """Refuse a part's metrics that are not detached 0-d tensors (a tensor with a gradient would hold the step's
    graph)."""
    strays = sorted(key for key, value in metrics.items() if not isinstance(value, Tensor) or value.ndim != 0)
    if strays:
        raise ValueError(f"{name} returned metrics {strays} that are not 0-d tensors; give one detached value each.")
    attached = sorted(key for key, value in metrics.items() if value.requires_grad)
    if attached:
        raise ValueError(f"{name} returned metrics {attached} that carry a gradient; give value.detach().")
