"""Teachers for on-policy distillation: frozen models that score the tokens the student sampled."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gpo.models.loading import DType, load_policy
from gpo.models.scorer import score_tokens
from gpo.parallel.fsdp import reshard
from gpo.rollout.base import Rollout


class Teacher(ABC):
    """Scores a rollout's completion tokens with a frozen teacher: ``log p_teacher(y_t | prompt, y_<t)`` at
    temperature 1 (the teacher's own distribution), once per training step (``TeacherKL`` reads them).

    The teacher must share the policy's tokenizer: it is given the student's token ids.

    Attributes:
        model: the teacher's weights when they live in this process (moved to the training device, sharded like the
            policy under FSDP2); None when another process holds them (a server).
    """

    model: PreTrainedModel | None = None

    def setup(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Refuse a teacher whose vocabulary cannot hold the policy's token ids; wait for a remote one."""
        if self.model is not None and len(tokenizer) > self.model.get_input_embeddings().num_embeddings:
            raise ValueError(
                f"model.teacher's input embedding has {self.model.get_input_embeddings().num_embeddings} rows but "
                f"the policy's tokenizer has {len(tokenizer)} tokens: distillation scores the policy's tokens with "
                "the teacher, so it must share the policy's tokenizer; pick a teacher of the same family."
            )

    @abstractmethod
    def logp(self, rollout: Rollout) -> Tensor:
        """The teacher's log-probs ``[B, T]`` (float32, on the rollout's device) of ``rollout``'s completion
        tokens; 0 on padding."""


class LocalTeacher(Teacher):
    """A transformers causal LM loaded in this process, frozen and in eval mode.

    Args:
        model: folder of the teacher (``from_pretrained``; a GGUF model too, see ``gpo.models.loading``), or a
            loaded model.
        dtype: dtype the teacher is loaded in.
    """

    def __init__(self, model: str | PreTrainedModel, *, dtype: DType = "float32") -> None:
        if isinstance(model, str):
            model = load_policy(model, dtype=dtype, mode="full", lora=None, field="model.teacher")
        self.model = model.requires_grad_(False).eval()

    @torch.no_grad()
    def logp(self, rollout: Rollout) -> Tensor:
        width, ids, attn = rollout.completion_ids.shape[1], rollout.input_ids, rollout.attention_mask
        logp = score_tokens(self.model, ids, attn, width, temperature=1.0).logp
        reshard(self.model)  # FSDP2: a frozen model's root unit is not kept gathered
        return torch.where(rollout.completion_mask.bool(), logp.float(), torch.zeros_like(logp, dtype=torch.float32))
