"""What a rollout is, and the interface every rollout engine implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class Sampling:
    """How completions are sampled.

    Args:
        temperature: softmax temperature (> 0); the trainer scores tokens at the same temperature.
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        max_new_tokens: completion length budget; a completion that reaches it without EOS is truncated.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (use greedy decoding for evaluation).")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1].")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables it).")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1.")


@dataclass
class Rollout:
    """``B`` completions (``n`` per prompt, rows of a group adjacent) and everything known about them.

    Token tensors put the prompt left-padded to ``P`` and the completion right-padded to ``T``, so
    ``torch.cat([prompt_ids, completion_ids], 1)`` is the model input of every row.
    """

    prompt_ids: Tensor  # [B, P] long, left-padded
    prompt_mask: Tensor  # [B, P] 1 on prompt tokens
    completion_ids: Tensor  # [B, T] long, right-padded
    completion_mask: Tensor  # [B, T] 1 on generated tokens, EOS included
    truncated: Tensor  # [B] bool: reached max_new_tokens without EOS
    group: Tensor  # [B] long: which prompt of the batch
    logp: Tensor | None = None  # [B, T] float32: the sampler's log-probs of the completion tokens
    prompts: list[str] = field(default_factory=list)  # [B]
    completions: list[str] = field(default_factory=list)  # [B]
    fields: dict[str, list] = field(default_factory=dict)  # extra dataset columns, one value per row

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def input_ids(self) -> Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)  # [B, P + T]

    @property
    def attention_mask(self) -> Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)  # [B, P + T]

    @property
    def lengths(self) -> Tensor:
        return self.completion_mask.sum(-1)  # [B]

    def select(self, rows: Tensor | list[int]) -> Rollout:
        """The rollout restricted to ``rows`` (in that order)."""
        index = torch.as_tensor(rows, dtype=torch.long, device=self.completion_ids.device)
        picked = index.tolist()
        return replace(
            self,
            prompt_ids=self.prompt_ids[index],
            prompt_mask=self.prompt_mask[index],
            completion_ids=self.completion_ids[index],
            completion_mask=self.completion_mask[index],
            truncated=self.truncated[index],
            group=self.group[index],
            logp=None if self.logp is None else self.logp[index],
            prompts=[self.prompts[i] for i in picked] if self.prompts else [],
            completions=[self.completions[i] for i in picked] if self.completions else [],
            fields={key: [values[i] for i in picked] for key, values in self.fields.items()},
        )

    def to(self, device: torch.device | str) -> Rollout:
        move = {
            name: getattr(self, name).to(device)
            for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated", "group")
        }
        return replace(self, **move, logp=None if self.logp is None else self.logp.to(device))


class RolloutEngine(ABC):
    """Samples ``n`` completions for each prompt. The module never imports a concrete engine."""

    def setup(self, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:  # noqa: B027
        """Called once by the trainer with the policy it trains; engines with their own weights may ignore it."""

    @abstractmethod
    def generate(
        self, prompt_ids: list[list[int]], n: int, *, greedy: bool = False, seed: int | None = None
    ) -> Rollout:
        """Sample ``n`` completions of each prompt (token ids, no padding); rows of prompt ``i`` get group ``i``.

        Returns a ``Rollout`` with token tensors, ``truncated``, ``group`` and, where the engine has them, the
        sampled tokens' ``logp`` at the sampling temperature. Texts and dataset fields are the caller's to add.
        """
