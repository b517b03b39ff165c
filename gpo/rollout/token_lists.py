"""A ``Rollout`` from per-sample token lists, for engines that hand back plain token ids (vLLM, in-process or HTTP)."""

from __future__ import annotations

import torch

from gpo.rollout.base import Rollout, Sampling
from gpo.rollout.hf import grouped_prompts


def prompt_seeds(seed: int | None, count: int) -> list[int | None]:
    """One sampling seed per prompt, drawn from ``seed``: a single seed shared by all prompts would give every
    prompt's ``i``-th sample the same random stream. None: unseeded."""
    if seed is None:
        return [None] * count
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**62, (count,), generator=generator).tolist()


def vllm_request(
    sampling: Sampling, n: int, *, greedy: bool, seed: int | None, logprobs: bool, eos_id: int
) -> dict[str, object]:
    """The sampling settings of one vLLM request for ``n`` samples of a prompt, under the names both vLLM's
    ``SamplingParams`` and its server's ``/v1/completions`` take. Greedy asks for one sample (vLLM refuses ``n > 1``
    with greedy decoding): ``greedy_copies`` says how many times the caller repeats it.

    ``ignore_eos``: vLLM would stop at every EOS id of the checkpoint's ``generation_config.json`` (Qwen2.5's instruct
    models list ``<|endoftext|>`` beside ``<|im_end|>``); HFEngine and the trainer's masks end a completion at the
    tokenizer's EOS alone, the one stop token."""
    return {
        "n": 1 if greedy else n,
        "temperature": 0.0 if greedy else sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "max_tokens": sampling.max_new_tokens,
        "ignore_eos": True,
        "stop_token_ids": [eos_id],
        "logprobs": 0 if logprobs else None,
        "seed": seed,
    }


def greedy_copies(n: int, greedy: bool) -> int:
    """How many times each sample vLLM returned stands in the rollout (``vllm_request``)."""
    return n if greedy else 1


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
