"""Log-probs of completion tokens under a transformers causal LM, without materialising its logits."""

from __future__ import annotations

from torch import Tensor
from transformers import PreTrainedModel

from gpo.algo.gates import router_logprobs
from gpo.algo.logprobs import TokenLogProbs, linear_token_logprobs, token_logprobs

# Config attributes of models whose logits are not a plain linear map of the last hidden state.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as ``generate`` assigns them: ``[B, S]``."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def has_plain_output_layer(model: PreTrainedModel) -> bool:
    """True when ``logits = lm_head(hidden)`` exactly, so the fused chunked path applies."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return all(getattr(config, name, None) in (None, 1.0) for name in _LOGIT_TRANSFORMS)


def completion_logprobs(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_length: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    output_router_logits: bool = False,
) -> tuple[TokenLogProbs, tuple[Tensor, ...] | None]:
    """Log-probs ``[B, T]`` of the last ``completion_length`` tokens of ``input_ids`` ``[B, S]``.

    The hidden state at position ``s`` predicts token ``s + 1``, so completion token ``j`` (position
    ``S - T + j``) is scored from position ``S - T + j - 1``. Logits are computed chunk by chunk from the
    final hidden states (``gpo.algo.linear_token_logprobs``); models with a logit transform (soft-capping,
    scaling) fall back to their own logits, still reduced chunk by chunk. Returns the log-probs and, when
    asked, the model's per-layer router logits (mixture-of-experts models).
    """
    start = input_ids.shape[1] - completion_length
    targets = input_ids[:, start:]  # [B, T]
    kwargs = {"attention_mask": attention_mask, "position_ids": position_ids(attention_mask)}
    if output_router_logits:
        kwargs["output_router_logits"] = True
    # FSDP2 gathers the root unit (embeddings, output layer) only in the model's own forward: no decoder-only call
    if has_plain_output_layer(model) and not getattr(model, "_is_fsdp_managed_module", False):
        out = model.base_model(input_ids=input_ids, **kwargs)
        hidden = out.last_hidden_state[:, start - 1 : -1]  # [B, T, H]
        head = model.get_output_embeddings()
        logprobs = linear_token_logprobs(
            hidden, head.weight, targets, bias=head.bias, temperature=temperature, with_entropy=with_entropy
        )
    else:
        out = model(input_ids=input_ids, **kwargs)
        logits = out.logits[:, start - 1 : -1]  # [B, T, V]
        logprobs = token_logprobs(logits, targets, temperature=temperature, with_entropy=with_entropy)
    router = getattr(out, "router_logits", None) if output_router_logits else None
    return logprobs, router


def completion_router_logp(router_logits: tuple[Tensor, ...], batch_size: int, width: int) -> Tensor:
    """Router log-probs ``[L, B, T, E]`` aligned with the last ``width`` tokens (shifted like the logits)."""
    return router_logprobs(router_logits, batch_size)[:, :, -width - 1 : -1]
