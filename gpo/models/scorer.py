"""TokenScorer: the one place that scores completion tokens with a model (policy, reference, router, entropy)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor
from transformers import PreTrainedModel

from gpo.algo.gates import router_logprobs
from gpo.algo.logprobs import linear_token_logprobs, linear_topk_logprobs, token_logprobs, topk_logprobs
from gpo.models.loading import adapter_disabled, training_mode, unwrap
from gpo.parallel.fsdp import reshard

if TYPE_CHECKING:  # gpo.rollout's engines import this file
    from gpo.rollout.base import Rollout

# Config attributes of models whose logits are not a plain linear map of the last hidden state.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


class TokenScores(NamedTuple):
    """What one pass over ``B`` sequences gives for their last ``T`` tokens."""

    logp: Tensor  # [B, T] float32: log-probs of the tokens at the scoring temperature
    entropy: Tensor | None  # [B, T] float32: entropy of each position's next-token distribution, if asked
    router_logp: Tensor | None  # [L, B, T, E]: routing log-probs of a mixture-of-experts model, if asked
    topk_logp: Tensor | None = None  # [B, T, k]: log-probs of the top-k tokens (or of the given ``at_ids``)
    topk_ids: Tensor | None = None  # [B, T, k]: which tokens those are


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as ``generate`` assigns them: ``[B, S]``."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def has_plain_output_layer(model: PreTrainedModel) -> bool:
    """True when ``logits = lm_head(hidden)`` exactly, so the fused chunked path applies."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return all(getattr(config, name, None) in (None, 1.0) for name in _LOGIT_TRANSFORMS)


def score_tokens(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    width: int,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    router: bool = False,
    topk: int = 0,
    at_ids: Tensor | None = None,
) -> TokenScores:
    """Scores of the last ``width`` tokens of ``input_ids`` ``[B, S]`` under ``model`` (gradients as the caller's
    mode allows).

    The hidden state at position ``s`` predicts token ``s + 1``, so completion token ``j`` (position
    ``S - T + j``) is scored from position ``S - T + j - 1``. Logits are computed chunk by chunk from the final
    hidden states (``gpo.algo.linear_token_logprobs``), never as a whole ``[B, T, V]`` tensor; models with a logit
    transform (soft-capping, scaling) fall back to their own logits, still reduced chunk by chunk. ``topk`` > 0 also
    gives each position's ``topk`` most likely tokens and their log-probs (no gradient); ``at_ids[B, T, k]`` gives
    the log-probs of those tokens instead (with gradient), e.g. the current policy at the old policy's top-k.
    """
    start = input_ids.shape[1] - width
    targets = input_ids[:, start:]  # [B, T]
    if at_ids is not None:
        targets = torch.cat([targets[..., None], at_ids], dim=-1)  # [B, T, 1 + k]
    # use_cache=False: a scoring pass needs no KV cache, which the model would otherwise build layer by layer
    kwargs = {"attention_mask": attention_mask, "position_ids": position_ids(attention_mask), "use_cache": False}
    if router:
        kwargs["output_router_logits"] = True
    # FSDP2 gathers the root unit (embeddings, output layer) only in the model's own forward: no decoder-only call
    if has_plain_output_layer(model) and not getattr(model, "_is_fsdp_managed_module", False):
        out = model.base_model(input_ids=input_ids, **kwargs)
        hidden = out.last_hidden_state[:, start - 1 : -1]  # [B, T, H]
        head = model.get_output_embeddings()
        scores = linear_token_logprobs(
            hidden, head.weight, targets, bias=head.bias, temperature=temperature, with_entropy=entropy
        )
        top = linear_topk_logprobs(hidden, head.weight, topk, bias=head.bias, temperature=temperature) if topk else None
    else:
        out = model(input_ids=input_ids, **kwargs)
        logits = out.logits[:, start - 1 : -1]  # [B, T, V]
        scores = token_logprobs(logits, targets, temperature=temperature, with_entropy=entropy)
        top = topk_logprobs(logits, topk, temperature=temperature) if topk else None
    routed = None
    if router:
        if getattr(out, "router_logits", None) is None:
            raise ValueError(
                f"router log-probs were asked of {type(model).__name__}, which is not a mixture-of-experts model "
                "(RSPO's RouterShiftGate needs one: e.g. gpo tiny --arch qwen2_moe)."
            )
        routed = router_logprobs(out.router_logits, input_ids.shape[0])[:, :, -width - 1 : -1]  # [L, B, T, E]
    if at_ids is not None:
        return TokenScores(scores.logp[..., 0], scores.entropy, routed, scores.logp[..., 1:], at_ids)
    return TokenScores(scores.logp, scores.entropy, routed, *(top if top is not None else (None, None)))


class TokenScorer:
    """Scores the completion tokens of rollouts with the policy or its reference, at the sampling temperature.

    Passes over a whole rollout (``policy_logp``, ``reference_logp``, ``rollout_scores``) run without gradient and
    in eval mode (no dropout): the old-policy, reference and router inputs of a step, an engine's sampler log-probs,
    the monitors' entropy. ``train_scores`` is the gradient pass, in train mode. The reference is a frozen copy when
    one is given, else the policy with its LoRA adapter switched off (a LoRA run needs no copy).

    Args:
        policy: the model being trained (a transformers causal LM, or a peft model wrapping one).
        temperature: the sampling temperature: scores are ``log softmax(z / temperature)``.
        reference: a frozen copy of the initial policy, or None (LoRA: the adapter switched off).
    """

    def __init__(
        self, policy: torch.nn.Module, *, temperature: float = 1.0, reference: PreTrainedModel | None = None
    ) -> None:
        self.policy, self.temperature, self.reference = policy, temperature, reference

    @property
    def model(self) -> PreTrainedModel:
        """The transformers model that is scored (LoRA layers active in LoRA modes)."""
        return unwrap(self.policy)

    @torch.no_grad()
    def rollout_scores(
        self,
        rollout: Rollout,
        *,
        entropy: bool = False,
        router: bool = False,
        topk: int = 0,
        temperature: float | None = None,
        batch_size: int | None = None,
    ) -> TokenScores:
        """The policy's scores of ``rollout``'s completion tokens, ``batch_size`` rows per forward pass (None: all);
        ``topk`` > 0 adds each position's most likely tokens and their log-probs."""
        width, ids, attn = rollout.completion_ids.shape[1], rollout.input_ids, rollout.attention_mask
        t = self.temperature if temperature is None else temperature
        parts = []
        with training_mode(self.model, False):
            for rows in torch.arange(len(rollout), device=ids.device).split(batch_size or max(len(rollout), 1)):
                parts.append(score_tokens(self.model, ids[rows], attn[rows], width, temperature=t, entropy=entropy,
                                          router=router, topk=topk))  # fmt: skip
        if len(parts) == 1:
            return parts[0]
        return TokenScores(
            torch.cat([p.logp for p in parts]),
            torch.cat([p.entropy for p in parts]) if entropy else None,
            torch.cat([p.router_logp for p in parts], dim=1) if router else None,  # [L, B, T, E]: rows on dim 1
            torch.cat([p.topk_logp for p in parts]) if topk else None,
            torch.cat([p.topk_ids for p in parts]) if topk else None,
        )

    def policy_logp(self, rollout: Rollout) -> Tensor:
        """The policy's log-probs ``[B, T]`` of the rollout's completion tokens."""
        return self.rollout_scores(rollout).logp

    @torch.no_grad()
    def reference_logp(self, rollout: Rollout) -> Tensor:
        """The reference policy's log-probs ``[B, T]`` of the rollout's completion tokens."""
        width, ids, attn = rollout.completion_ids.shape[1], rollout.input_ids, rollout.attention_mask
        if self.reference is not None:
            logp = score_tokens(self.reference, ids, attn, width, temperature=self.temperature).logp
            reshard(self.reference)  # FSDP2: the reference's root unit is not kept gathered
            return logp
        with adapter_disabled(self.policy) as reference, training_mode(reference, False):
            return score_tokens(reference, ids, attn, width, temperature=self.temperature).logp

    def train_scores(
        self, input_ids: Tensor, attention_mask: Tensor, width: int, *, router: bool, at_ids: Tensor | None = None
    ) -> TokenScores:
        """The gradient pass: the policy's log-probs and entropy (and router log-probs, and log-probs at ``at_ids``)
        in train mode (dropout, if any, acts here only)."""
        with training_mode(self.model, True):
            return score_tokens(self.model, input_ids, attention_mask, width, temperature=self.temperature,
                                entropy=True, router=router, at_ids=at_ids)  # fmt: skip
