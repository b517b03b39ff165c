"""A ``Rollout`` from per-sample token lists, for engines that hand back plain token ids (vLLM, in-process or HTTP)."""

from __future__ import annotations

import torch

from gpo.rollout.base import Rollout
from gpo.rollout.hf import grouped_prompts


def prompt_seeds(seed: int | None, count: int) -> list[int | None]:
    """One sampling seed per prompt, drawn from ``seed``: a single seed shared by all prompts would give every
    prompt's ``i``-th sample the same random stream. None: unseeded."""
    if seed is None:
        return [None] * count
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**62, (count,), generator=generator).tolist()


def rollout_from_token_lists(
    prompt_ids: list[list[int]],
    n: int,
    completions: list[list[int]],
    logps: list[list[float]] | None,
    *,
    eos_id: int,
    pad_id: int,
) -> Rollout:
    """``completions[i * n + j]`` (sample ``j`` of prompt ``i``, generation stopped at EOS, EOS kept) and its
    per-token ``logps`` -> a Rollout: prompts left-padded, completions right-padded with ``pad_id`` under a zero
    mask, ``logp`` 0 on padding, ``truncated`` where a completion does not end with EOS."""
    if len(completions) != len(prompt_ids) * n:
        raise ValueError(f"{len(completions)} completions for {len(prompt_ids)} prompts x n={n}.")
    ids, mask, group = grouped_prompts(prompt_ids, n, pad_id)  # [B, P], [B, P], [B]
    width = max(1, max(len(c) for c in completions))
    completion_ids = torch.full((len(completions), width), pad_id, dtype=torch.long)  # [B, T]
    completion_mask = torch.zeros((len(completions), width), dtype=torch.long)  # [B, T]
    logp = torch.zeros((len(completions), width), dtype=torch.float32) if logps is not None else None  # [B, T]
    for row, tokens in enumerate(completions):
        completion_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        completion_mask[row, : len(tokens)] = 1
        if logp is not None:
            logp[row, : len(tokens)] = torch.tensor(logps[row], dtype=torch.float32)
    truncated = torch.tensor([not tokens or tokens[-1] != eos_id for tokens in completions])  # [B]
    return Rollout(ids, mask, completion_ids, completion_mask, truncated, group, logp=logp)
