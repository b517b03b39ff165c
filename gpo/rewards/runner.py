"""Running reward functions on a rollout: one column of scores per function, with a policy for functions that fail."""

from __future__ import annotations

import itertools
import logging
import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from gpo.rollout.base import Rollout

RewardFn = Callable[..., Sequence[float]]
MAX_SINGLE_ROW_RETRIES = 64
FIX_HINT = "to score failed samples as model.reward_errors.value (now {value}), set model.reward_errors.policy: score"

log = logging.getLogger(__name__)


class ServedReward(ABC):
    """A reward function that asks a service (a judge), checked to answer when the run is set up.

    The collector waits for it to be ready before the first rollout, so a service that is down fails the run at once,
    not after a whole rollout was sampled."""

    @abstractmethod
    def wait_ready(self) -> None:
        """Return once the service answers; raise ``gpo.envs.http.ServiceError`` naming it when it does not."""


class RewardError(ValueError):
    """A reward function raised, hung, or returned the wrong number of values or a value that is not a number."""


@dataclass(frozen=True)
class RewardErrors:
    """What happens when a reward function fails: it raises, returns the wrong number of values, returns a value
    that is not a finite number (None, NaN, inf, a string), or takes longer than ``timeout_s``.

    Args:
        policy: ``fail`` stops the run with a ``RewardError`` naming the function and the prompt; ``score`` gives
            the failed samples ``value``, logs a warning and counts them (``reward_errors/<name>``). A failed call
            fails all its samples; a bad value only its own.
        value: the score a failed sample gets under policy ``score``.
        timeout_s: seconds one call of a reward function may take (None: no limit). The call then runs in a
            daemon thread; a thread cannot be killed, so one that overruns is abandoned: it runs on unobserved
            (still using CPU if it computes) until it returns or the process ends. With no limit the call runs in
            the calling thread, as does a reward declared ``gpo.rewards.bounded_time`` whatever the limit.
        warn_after_s: a call still running after this many seconds is reported (function and prompt named) while
            the run waits for it.
    """

    policy: Literal["fail", "score"] = "fail"
    value: float = 0.0
    timeout_s: float | None = 600.0
    warn_after_s: float = 60.0

    def __post_init__(self) -> None:
        if self.policy not in ("fail", "score"):
            raise ValueError(f"model.reward_errors.policy={self.policy!r} is not valid; choose 'fail' or 'score'.")
        if not math.isfinite(self.value):
            raise ValueError(
                f"model.reward_errors.value={self.value} must be a finite number (a failed sample's score)."
            )
        if self.timeout_s is not None and not 0 < self.timeout_s < math.inf:
            raise ValueError(
                f"model.reward_errors.timeout_s={self.timeout_s} must be a number of seconds > 0, or null for no limit."
            )
        if not 0 < self.warn_after_s < math.inf:
            raise ValueError(f"model.reward_errors.warn_after_s={self.warn_after_s} must be a number of seconds > 0.")


@dataclass(frozen=True)
class Scores:
    """The scores of a rollout and how many samples each reward function had replaced by ``RewardErrors.value``."""

    values: Tensor  # [B, K] float32: column k from reward function k
    replaced: dict[str, int]  # per function name, under policy "score" (empty under "fail")


@dataclass(frozen=True)
class _Failure:
    """What went wrong in one reward function's call."""

    message: str
    samples: int  # how many samples it fails
    cause: BaseException | None = None


class _Timeout(Exception):
    pass


def reward_name(fn: RewardFn) -> str:
    """The name a reward function's mean is logged under (``reward/<name>``)."""
    return getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__


def score(rewards: Sequence[RewardFn], rollout: Rollout, errors: RewardErrors = RewardErrors()) -> Scores:
    """``scores[B, K]``: reward function ``k`` applied to every completion of the rollout.

    Each function gets ``(prompts, completions, **fields, completion_ids=...)`` and returns one finite number
    per completion. In a multi-turn episode the completion is the whole transcript after the prompt, the
    environment's observations included (``completion_mask``, not ``loss_mask``). A function that fails is
    reported with its name and the prompt concerned, then handled as ``errors.policy`` says.
    """
    kept = zip(rollout.completion_ids.tolist(), rollout.completion_mask.bool().tolist(), strict=True)
    completion_ids = [list(itertools.compress(ids, mask)) for ids, mask in kept]  # one host copy, not one per row
    batch = {**rollout.fields, "prompts": rollout.prompts, "completions": rollout.completions}
    batch["completion_ids"] = completion_ids
    out = torch.empty(len(rollout), len(rewards), dtype=torch.float32)  # [B, K]
    replaced: dict[str, int] = {}
    for k, fn in enumerate(rewards):
        values, failure = _run(fn, batch, len(rollout), errors)
        if failure is not None and errors.policy == "fail":
            raise RewardError(f"{failure.message}; {FIX_HINT.format(value=errors.value)}.") from failure.cause
        if errors.policy == "score":
            name = reward_name(fn)
            replaced[name] = replaced.get(name, 0) + (failure.samples if failure else 0)
        if failure is not None:
            log.warning("%s; scored %d sample(s) as %s.", failure.message, failure.samples, errors.value)
        out[:, k] = torch.tensor(values, dtype=torch.float32)
    return Scores(out, replaced)


def _run(fn: RewardFn, batch: dict[str, list], size: int, errors: RewardErrors) -> tuple[list, _Failure | None]:
    """One function's values on the batch (``errors.value`` where unknown) and what went wrong, if anything."""
    name, first = reward_name(fn), _first_row(batch, size)
    bounded = _bounded(fn)  # called directly: no time limit, no slow-call report
    timeout_s = None if bounded else errors.timeout_s
    watch = None if bounded else (errors.warn_after_s, f"reward function {name!r} {first}")
    try:
        values = _call(fn, batch, timeout_s, watch)
    except _Timeout:
        message = f"reward function {name!r} did not return within timeout_s={errors.timeout_s} {first}"
        return [errors.value] * size, _Failure(f"{message}; its thread is abandoned", size)
    except Exception as exc:
        from gpo.envs.http import ServiceError  # (aiohttp) only once a reward has raised

        # rows scored alone find the one a function fails on; a service (a judge) that failed fails on any
        search = errors.policy == "fail" and not isinstance(exc, ServiceError)
        culprit = _first_raising_row(fn, batch, size, timeout_s) if search else None
        message = f"reward function {name!r} raised {_describe(exc)} {culprit or first}"
        return [errors.value] * size, _Failure(message, size, exc)
    if not isinstance(values, list) or len(values) != size:
        got = f"{len(values)} values" if isinstance(values, list) else f"{values!r:.80}, not a list,"
        message = f"reward function {name!r} returned {got} for {size} completions {first}"
        return [errors.value] * size, _Failure(message, size)
    numbers = [_as_float(value) for value in values]
    bad = [row for row, number in enumerate(numbers) if number is None]
    if not bad:
        return numbers, None
    more = f" (and {len(bad) - 1} more of {size})" if len(bad) > 1 else ""
    message = (
        f"reward function {name!r} returned {values[bad[0]]!r:.80} for prompt {_short(batch['prompts'][bad[0]])} "
        f"and completion {_short(batch['completions'][bad[0]])}{more}; rewards must be finite numbers"
    )
    return [errors.value if number is None else number for number in numbers], _Failure(message, len(bad))


def _call(fn: RewardFn, batch: dict[str, list], timeout_s: float | None, watch: tuple[float, str] | None = None) -> Any:
    """``fn(prompts, completions, **columns)`` as a list (if it is a sequence), in a daemon thread given up on
    after ``timeout_s`` (if set; else in this thread). Iterating a generator is part of the call: it may raise or
    hang too. ``watch`` = (seconds, what): a call still running after that long is reported while it runs on."""
    columns = {key: value for key, value in batch.items() if key not in ("prompts", "completions")}

    def collected() -> Any:
        returned = fn(batch["prompts"], batch["completions"], **columns)
        scalar = isinstance(returned, (str, bytes)) or getattr(returned, "ndim", None) == 0
        return list(returned) if isinstance(returned, Iterable) and not scalar else returned

    warn_after, what = watch or (math.inf, "")

    def report() -> None:
        limit = f"; it is stopped after timeout_s={timeout_s}" if timeout_s is not None else " (no timeout_s set)"
        log.warning("%s is still running after %.0f s%s; the run waits for it.", what, warn_after, limit)

    if timeout_s is None:
        watchdog = threading.Timer(warn_after, report) if math.isfinite(warn_after) else None
        if watchdog is not None:
            watchdog.daemon = True
            watchdog.start()
        try:
            return collected()
        finally:
            if watchdog is not None:
                watchdog.cancel()
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = collected()
        except BaseException as exc:  # handed to the calling thread, which decides
            outcome["error"] = exc

    worker = threading.Thread(target=target, name=f"reward {reward_name(fn)}", daemon=True)
    worker.start()
    worker.join(min(warn_after, timeout_s))
    if worker.is_alive() and warn_after < timeout_s:
        report()
        worker.join(timeout_s - warn_after)
    if worker.is_alive():
        raise _Timeout
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _bounded(fn: RewardFn) -> bool:
    """Whether ``fn`` declares that it returns promptly (``gpo.rewards.bounded_time``): called directly, untimed."""
    return getattr(fn, "bounded_time", False)


def _first_raising_row(fn: RewardFn, batch: dict[str, list], size: int, timeout_s: float | None) -> str | None:
    """For the message: the first completion among the first ``MAX_SINGLE_ROW_RETRIES`` that raises when scored
    on its own (None when none does, or a retry hangs)."""
    for row in range(min(size, MAX_SINGLE_ROW_RETRIES)):
        try:
            _call(fn, {key: values[row : row + 1] for key, values in batch.items()}, timeout_s)
        except _Timeout:
            return None
        except Exception as exc:
            prompt, completion = _short(batch["prompts"][row]), _short(batch["completions"][row])
            return (
                f"on a batch of {size} completions; scored alone, prompt {prompt} with completion {completion} "
                f"(row {row}) raises {_describe(exc)}"
            )
    return None


def _first_row(batch: dict[str, list], size: int) -> str:
    if size == 0:
        return "on an empty batch"
    prompt, completion = _short(batch["prompts"][0]), _short(batch["completions"][0])
    return f"on a batch of {size} completions (the first: prompt {prompt}, completion {completion})"


def _as_float(value: Any) -> float | None:
    """``value`` as a finite float, or None when it is not a finite number (None, NaN, inf, a string, ...)."""
    if value is None or isinstance(value, (str, bytes)):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, RuntimeError):  # ValueError: a tensor of several elements; RuntimeError: a meta one
        return None
    return number if math.isfinite(number) else None


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _short(text: str, limit: int = 200) -> str:
    """``repr(text)``, with the middle cut out when it is longer than ``limit`` characters."""
    if len(text) <= limit:
        return repr(text)
    half = limit // 2
    return f"{text[:half]!r} ... [{len(text) - limit} characters cut] ... {text[-half:]!r}"
