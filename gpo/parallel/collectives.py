"""Collectives over the ranks of a distributed run (DDP), each one a no-op returning its input when torch.distributed
is not initialised, so the single-process path computes exactly what it computed before."""

from __future__ import annotations

import itertools
import zlib
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from gpo.rollout.base import Rollout


def is_distributed() -> bool:
    """More than one process in the default group (an in-process vLLM engine starts a group of one)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def reduce_over_ranks(x: Tensor, op: Literal["sum", "min", "max"]) -> Tensor:
    """``op`` of ``x`` over the ranks, on every rank (``x`` itself when not distributed)."""
    if not is_distributed():
        return x
    reduced = x.detach().clone()
    dist.all_reduce(reduced, op=getattr(dist.ReduceOp, op.upper()))
    return reduced


def mean_over_ranks(x: Tensor) -> Tensor:
    """The mean of ``x`` over the ranks, on every rank (one all-reduce; ``x`` itself when not distributed)."""
    if not is_distributed():
        return x
    return reduce_over_ranks(x, "sum") / world_size()


def every_rank_holds(count: int, needed: int, device: torch.device | str = "cpu") -> bool:
    """Whether every rank holds at least ``needed`` items (rows, prompts); a single process: at least one.

    Under DDP all ranks must train a step or all skip it, or the others would wait in a collective for ever; and
    a rank needs a row for each of its minibatches, as it splits its own rows (``minibatch_bounds``)."""
    if not is_distributed():
        return count >= 1
    return int(reduce_over_ranks(torch.tensor(count, device=device), "min")) >= needed


def minibatch_bounds(rows: int, parts: int) -> list[tuple[int, int]]:
    """Where a step's ``rows`` rows split into ``parts`` minibatches, as ``(start, stop)`` positions: sizes differing
    by at most one, as ``tensor_split``: ``parts`` optimiser steps, or one per row when there are fewer rows than
    ``parts`` (a single process trains such a step; under DDP it is skipped). Under DDP each rank splits its own
    rows this way (it holds at least ``parts``: ``every_rank_holds``), and the ranks' minibatch ``k`` form the
    global minibatch ``k``."""
    size, extra = divmod(rows, parts)
    stops = list(itertools.accumulate(size + (k < extra) for k in range(min(parts, rows))))
    return list(zip([0, *stops], stops, strict=False))  # each minibatch starts where the one before stops


def ddp_normaliser(local: Tensor) -> Tensor:
    """What each rank divides its loss numerator by so that DDP's *averaged* gradient is the gradient of the loss
    over the global batch: ``N / W`` with ``N = sum_r N_r`` the global normaliser and ``W`` the world size.

    With ``L_r = num_r / (N / W)``, DDP applies ``(1/W) sum_r grad L_r = grad(sum_r num_r) / N``, the single-process
    gradient of ``sum_r num_r / N``; and the global loss ``sum_r num_r / N`` is the mean of the ranks' ``L_r``.
    Every aggregator's normaliser is a sum over rows (tokens, sequences, rows x budget), so ``N`` is exact.
    """
    if not is_distributed():
        return local
    return mean_over_ranks(local)


def gather_rows(x: Tensor) -> tuple[Tensor, slice]:
    """Every rank's ``x`` stacked along dim 0 in rank order, and the slice of it that holds this rank's rows.

    Ranks may hold different numbers of rows and different sizes along the other dims (e.g. completion widths):
    those are zero-padded at the end to the largest. Not distributed: ``(x, slice(0, len(x)))``.
    """
    if not is_distributed():
        return x, slice(0, x.shape[0])
    shape = torch.tensor(x.shape, dtype=torch.long, device=x.device)  # [D]
    shapes = [torch.empty_like(shape) for _ in range(world_size())]
    dist.all_gather(shapes, shape)
    largest = torch.stack(shapes).amax(0).tolist()  # [D]
    padded = x.detach().new_zeros(largest)
    padded[tuple(slice(0, n) for n in x.shape)] = x.detach()
    parts = [torch.empty_like(padded) for _ in range(world_size())]
    dist.all_gather(parts, padded)
    rows = [int(s[0]) for s in shapes]
    start = sum(rows[: rank()])
    return torch.cat([part[:n] for part, n in zip(parts, rows, strict=True)]), slice(start, start + rows[rank()])


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (``[obj]`` when not distributed)."""
    if not is_distributed():
        return [obj]
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def sum_metrics(metrics: dict[str, Tensor]) -> dict[str, Tensor]:
    """Each 0-d tensor of ``metrics`` summed over the ranks by one all-reduce of them stacked (``metrics`` itself when
    not distributed). Every rank must hold the same keys in the same order; a rank that does not is an error."""
    if not is_distributed() or not metrics:
        return metrics
    keys, stacked = _stacked(metrics)
    values = reduce_over_ranks(stacked, "sum")  # [K]
    return {key: value.to(metrics[key].dtype) for key, value in zip(keys, values, strict=True)}


def gather_metrics(metrics: dict[str, Tensor]) -> list[dict[str, Tensor]]:
    """Every rank's 0-d ``metrics``, in rank order, by one all-gather of them stacked (``[metrics]`` when not
    distributed). Every rank must hold the same keys in the same order; a rank that does not is an error."""
    if not is_distributed() or not metrics:
        return [metrics]
    keys, stacked = _stacked(metrics)
    parts = [torch.empty_like(stacked) for _ in range(world_size())]
    dist.all_gather(parts, stacked)
    return [{key: value.to(metrics[key].dtype) for key, value in zip(keys, part, strict=True)} for part in parts]


def _stacked(metrics: dict[str, Tensor]) -> tuple[list[str], Tensor]:
    """The keys of ``metrics`` and their values stacked ``[K]`` in float64, after checking that every rank holds the
    same keys in the same order."""
    keys = list(metrics)
    stacked = torch.stack([metrics[k].detach().to(torch.float64) for k in keys])  # [K]
    tag = torch.tensor(zlib.crc32("\n".join(keys).encode()), dtype=torch.float64, device=stacked.device)  # []
    if reduce_over_ranks(tag, "max") != reduce_over_ranks(tag, "min"):
        raise RuntimeError(f"the ranks logged different metrics ({len(keys)} here): every rank must log the same keys.")
    return keys, stacked


def gather_step(rollout: Rollout, mask: Tensor) -> tuple[dict[str, Tensor], slice]:
    """A step's per-row values over every rank's rows (in rank order, widths zero-padded to the widest) and the slice
    of them that is this rank's. Group ids become ``group * W + rank``: distinct across ranks, and unchanged in a
    single process. Batch statistics (advantage whitening, logged reward and length) are taken over these rows."""
    local = {
        "reward": rollout.reward,  # [B]
        "group": rollout.group * world_size() + rank(),  # [B]
        "mask": mask,  # [B, T]
        "lengths": rollout.lengths,  # [B]
        "truncated": rollout.truncated.float(),  # [B]
        "scores": rollout.scores,  # [B, K]
        **({"reward_kl": rollout.reward_kl} if rollout.reward_kl is not None else {}),  # [B]
    }
    gathered, rows = {}, slice(0, len(rollout))
    for key, value in local.items():
        gathered[key], rows = gather_rows(value)
    return gathered, rows
