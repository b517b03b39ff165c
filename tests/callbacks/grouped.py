"""A scored rollout built by hand, one group per prompt, for callback tests."""

import torch

from gpo.rollout.base import Rollout


def grouped_rollout(prompts, rewards, *, completions=None, fields=None) -> Rollout:
    """``rewards[g]`` (and ``completions[g]``, ``fields[k][g]``) give group g's rows; two-token placeholder ids."""
    group = torch.tensor([g for g, row in enumerate(rewards) for _ in row])
    size = len(group)

    def per_row(values):
        return [v for v, row in zip(values, rewards, strict=True) for _ in row]

    return Rollout(
        prompt_ids=torch.ones(size, 1, dtype=torch.long),
        prompt_mask=torch.ones(size, 1, dtype=torch.long),
        completion_ids=torch.ones(size, 2, dtype=torch.long),
        completion_mask=torch.ones(size, 2, dtype=torch.long),
        truncated=torch.zeros(size, dtype=torch.bool),
        group=group,
        prompts=per_row(prompts),
        completions=[c for row in completions for c in row] if completions is not None else [],
        fields={key: per_row(values) for key, values in (fields or {}).items()},
        reward=torch.tensor([r for row in rewards for r in row]),
    )
