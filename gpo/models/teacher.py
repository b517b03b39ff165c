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
from gpo.rollout.vllm_client import VLLMServers


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
        return torch.where(rollout.completion_mask.bool(), logp.float(), 0.0)


class ServerTeacher(Teacher):
    """A teacher behind running vLLM OpenAI-compatible servers, for teachers too large for the training process.

    Each row's prompt and completion tokens are sent as the prompt of ``POST /v1/completions`` with
    ``prompt_logprobs: 0`` and ``max_tokens: 1``; vLLM answers the log-prob of every prompt token given those before
    it, from which the completion positions are taken (temperature 1: the teacher's own distribution). Rows are
    spread over the servers and sent concurrently. Start a server on the teacher's folder, e.g.::

        vllm serve TEACHER_FOLDER --host 127.0.0.1 --port 8001

    The teacher must share the policy's tokenizer (it is sent the policy's token ids). Retries, timeouts and the API
    key work as in ``gpo.rollout.vllm_client.VLLMServers``.

    Args:
        base_url: the teacher server's address, or a list of addresses.
        api_key: the servers' ``--api-key``; None: the environment variable ``VLLM_API_KEY`` if set, else none.
        health_max_wait_s: longest wait for every server's ``/health`` when training starts.
        request_timeout_s: longest wait for one HTTP answer.
        retry_max_s: longest time a failing request is retried, from its first failure (0: no retry).
        max_concurrent_requests: requests in flight at once, per server.
    """

    def __init__(
        self,
        *,
        base_url: str | list[str] = "http://127.0.0.1:8001",
        api_key: str | None = None,
        health_max_wait_s: float = 30.0,
        request_timeout_s: float = 600.0,
        retry_max_s: float = 60.0,
        max_concurrent_requests: int = 64,
    ) -> None:
        self.servers = VLLMServers(
            base_url, where="model.teacher.init_args", api_key=api_key, health_max_wait_s=health_max_wait_s,
            health_interval_ms=500, request_timeout_s=request_timeout_s, retry_max_s=retry_max_s,
            retry_backoff_s=1.0, max_concurrent_requests=max_concurrent_requests,
        )  # fmt: skip

    def setup(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.servers.wait_until_healthy()

    def logp(self, rollout: Rollout) -> Tensor:
        # [B, P + T] prompt and completion tokens, copied to the host once (not a copy per row)
        ids, kept = rollout.input_ids.cpu(), rollout.attention_mask.bool().cpu()
        scored = self.servers.prompt_logprobs([row[keep].tolist() for row, keep in zip(ids, kept, strict=True)])
        logp = torch.zeros(ids.shape, dtype=torch.float32)  # [B, P + T]
        for row, values in enumerate(scored):
            logp[row, kept[row]] = torch.tensor([0.0, *values])  # the first token has no log-prob
        logp = logp[:, -rollout.completion_ids.shape[1] :].to(rollout.completion_ids.device)  # [B, T]
        return torch.where(rollout.completion_mask.bool(), logp, 0.0)
