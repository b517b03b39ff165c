"""Masked reductions and per-group statistics shared by the algorithm parts."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` where ``mask`` is set; entries outside the mask never reach the result (not even NaN)."""
    x = torch.where(mask.bool(), x, 0)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the masked entries; 0 where the mask is empty."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1)


def sequence_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence mean over masked tokens: ``[B, T] -> [B]`` (0 for a sequence with no tokens)."""
    return masked_mean(x, mask, dim=-1)


def masked_stats(x: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Detached min/mean/max of ``x`` over the masked entries (zeros when the mask is empty). No host sync and no
    boolean indexing: entries outside the mask are replaced by ``+inf``/``-inf`` for the extremes."""
    m, values = mask.bool(), x.detach()
    count = m.sum()
    some = count > 0
    low = torch.where(m, values, math.inf).amin()
    high = torch.where(m, values, -math.inf).amax()
    return {
        "min": torch.where(some, low, 0.0),
        "mean": masked_sum(values, m) / count.clamp_min(1),
        "max": torch.where(some, high, 0.0),
    }


def group_index(group: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary group ids ``[B]`` to contiguous indices ``[B]`` in ``0..n_groups-1``."""
    ids, index = torch.unique(group, return_inverse=True)
    return index, len(ids)


def group_sum(x: Tensor, index: Tensor, n_groups: int) -> Tensor:
    """Sum of ``x[B]`` within each group, gathered back to ``[B]``."""
    totals = x.new_zeros(n_groups).index_add(0, index, x)  # [n_groups]
    return totals[index]


def group_mean_std(x: Tensor, group: Tensor, unbiased: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Group mean, group standard deviation and group size of ``x[B]``, each gathered back to ``[B]``.

    ``unbiased=False`` is the population convention (divide by n), ``True`` the sample one (divide by n - 1);
    a group of one has standard deviation 0 under both.
    """
    index, n_groups = group_index(group)
    count = group_sum(torch.ones_like(x), index, n_groups)  # [B]
    mean = group_sum(x, index, n_groups) / count  # [B]
    sq_dev = group_sum((x - mean) ** 2, index, n_groups)  # [B]
    dof = (count - 1).clamp_min(1) if unbiased else count
    std = torch.where(count > 1, (sq_dev / dof).sqrt(), 0.0)
    return mean, std, count


def safe_divide(num: Tensor, den: Tensor, eps: float) -> Tensor:
    """``num / den`` where ``den > eps``, else 0: a spread at or below ``eps`` counts as no spread at all."""
    return torch.where(den > eps, num / den.clamp_min(eps), 0.0)
