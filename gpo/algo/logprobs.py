"""Memory-lean log-probabilities and entropy of chosen tokens, chunk by chunk over rows.

The naive ``log_softmax(logits.float()).gather(...)`` keeps a full ``[N, V]`` float32 tensor alive for the
backward pass (about 5 GB for 8 x 1024 tokens of a 151,936-token vocabulary), besides the logits themselves.
Here each chunk of rows is upcast, reduced to its log-sum-exp and the gathered values, and dropped; the
backward pass recomputes the chunk's softmax. ``linear_token_logprobs`` goes one step further and never
materialises the logits at all: it takes the final hidden states and the output-embedding weight and
computes the logits one chunk at a time in both passes.

Gradients (with ``z`` the logits divided by the temperature, ``p = softmax(z)``, ``H = -sum p log p``):
``d log p_y / dz_v = 1[v = y] - p_v`` and ``dH / dz_v = -p_v (log p_v + H)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

_CHUNK_ELEMENTS = 2**25  # float32 elements per [rows, V] chunk buffer (128 MiB)


class TokenLogProbs(NamedTuple):
    """``logp`` has the shape of the token index; ``entropy`` the shape of the rows (None if not asked)."""

    logp: Tensor
    entropy: Tensor | None


def _rows_per_chunk(vocab: int, chunk_size: int | None) -> int:
    return chunk_size if chunk_size is not None else max(1, _CHUNK_ELEMENTS // vocab)


def _forward_chunk(z: Tensor, index: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """``z[C, V]`` float32 scaled logits, ``index[C, K]`` -> ``logp[C, K]``, ``lse[C]``, ``entropy[C]``."""
    lse = torch.logsumexp(z, dim=-1)  # [C]
    logp = z.gather(-1, index) - lse[:, None]  # [C, K]
    entropy = None
    if with_entropy:
        entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1)  # [C]: H = lse - sum_v p_v z_v
    return logp, lse, entropy


def _grad_chunk(
    z: Tensor, index: Tensor, lse: Tensor, entropy: Tensor | None, g_logp: Tensor, g_entropy: Tensor | None
) -> Tensor:
    """Gradient w.r.t. the scaled logits ``z[C, V]`` (float32); ``z`` is overwritten."""
    log_p = z.sub_(lse[:, None])  # [C, V], in place
    p = log_p.exp()  # [C, V]
    coef = -g_logp.sum(-1, keepdim=True)  # [C, 1]: the -p_v part of every gathered token's gradient
    if g_entropy is not None:
        coef = log_p.add_(entropy[:, None]).mul_(-g_entropy[:, None]).add_(coef)  # [C, V], reuses z
    grad = p.mul_(coef)
    return grad.scatter_add_(-1, index, g_logp)


def _grad_rows(z, rows, index, lse, entropy, g_logp, g_entropy) -> Tensor:
    """``_grad_chunk`` on the chunk ``rows`` of full-length saved tensors; no entropy term if ``g_entropy`` is None."""
    use_entropy = g_entropy is not None
    return _grad_chunk(
        z, index[rows], lse[rows], entropy[rows] if use_entropy else None, g_logp[rows],
        g_entropy[rows] if use_entropy else None,
    )  # fmt: skip


def _chunks(n: int, chunk: int) -> list[slice]:
    return [slice(start, start + chunk) for start in range(0, n, chunk)]


def _joined(parts: list[Tensor]) -> Tensor:
    """The chunks' results as one tensor along rows (the only chunk itself: no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _forward_rows(
    n: int, chunk: int, scaled_logits: Callable[[slice], Tensor], index: Tensor, with_entropy: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``_forward_chunk`` over the rows ``0..n`` a chunk at a time: ``logp``, ``lse`` and ``entropy`` (empty when not
    asked), each joined over the chunks."""
    parts = [_forward_chunk(scaled_logits(rows), index[rows], with_entropy) for rows in _chunks(n, chunk)]
    logp, lse = _joined([part[0] for part in parts]), _joined([part[1] for part in parts])
    entropy = _joined([part[2] for part in parts]) if with_entropy else lse.new_empty(0)
    return logp, lse, entropy


class _LogitsLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, index: Tensor, temperature: float, chunk: int, with_entropy: bool):
        scaled = lambda rows: logits[rows].float() / temperature  # noqa: E731
        logp, lse, entropy = _forward_rows(logits.shape[0], chunk, scaled, index, with_entropy)
        ctx.save_for_backward(logits, index, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        ctx.mark_non_differentiable(index)
        ctx.set_materialize_grads(False)  # an unused entropy gets no backward work
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp: Tensor | None, g_entropy: Tensor | None):
        logits, index, lse, entropy = ctx.saved_tensors
        g_logp = torch.zeros(index.shape, device=lse.device) if g_logp is None else g_logp
        g_entropy = g_entropy if ctx.with_entropy else None
        grads = []
        for rows in _chunks(logits.shape[0], ctx.chunk):
            z = logits[rows].float() / ctx.temperature
            g_z = _grad_rows(z, rows, index, lse, entropy, g_logp, g_entropy)
            grads.append(g_z.div_(ctx.temperature).to(logits.dtype))
        return _joined(grads), None, None, None, None


class _LinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, index, temperature: float, chunk: int, with_entropy: bool):
        scaled = lambda rows: _linear_chunk(hidden[rows], weight, bias, temperature)  # noqa: E731
        logp, lse, entropy = _forward_rows(hidden.shape[0], chunk, scaled, index, with_entropy)
        ctx.save_for_backward(hidden, weight, bias, index, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        ctx.mark_non_differentiable(index)
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp: Tensor | None, g_entropy: Tensor | None):
        hidden, weight, bias, index, lse, entropy = ctx.saved_tensors
        g_logp = torch.zeros(index.shape, device=lse.device) if g_logp is None else g_logp
        g_entropy = g_entropy if ctx.with_entropy else None
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = []
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_bias else None
        for rows in _chunks(hidden.shape[0], ctx.chunk):
            h = hidden[rows]
            z = _linear_chunk(h, weight, bias, ctx.temperature)
            g_z = _grad_rows(z, rows, index, lse, entropy, g_logp, g_entropy)
            g_z = g_z if ctx.temperature == 1.0 else g_z.div_(ctx.temperature)  # [C, V] float32
            if need_hidden:
                grad_hidden.append(g_z.to(weight.dtype) @ weight)
            if need_weight:
                grad_weight.addmm_(g_z.t(), h.float())  # accumulate in place: no weight-sized temporary
            if need_bias:
                grad_bias += g_z.sum(0)
        grad_weight = grad_weight.to(weight.dtype) if need_weight else None
        grad_bias = grad_bias.to(bias.dtype) if need_bias else None
        grad_hidden = _joined(grad_hidden).to(hidden.dtype) if need_hidden else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _linear_chunk(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """Scaled float32 logits of one chunk: ``(h W^T + b) / temperature``, ``[C, V]`` (no pass over them at
    temperature 1)."""
    z = torch.nn.functional.linear(h, weight, bias).float()
    return z if temperature == 1.0 else z.div_(temperature)


def _flatten(tokens: Tensor, lead_shape: torch.Size) -> tuple[Tensor, bool]:
    """Tokens ``[...]`` or ``[..., K]`` -> ``[N, K]`` and whether the K axis was added."""
    single = tokens.shape == lead_shape
    index = tokens.reshape(-1, 1) if single else tokens.reshape(-1, tokens.shape[-1])
    return index.long(), single


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0.")


def token_logprobs(
    logits: Tensor,
    tokens: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
) -> TokenLogProbs:
    """Log-probabilities of ``tokens`` under ``softmax(logits / temperature)``, and optionally the entropy.

    Args:
        logits: ``[..., V]``, any float dtype (computed in float32 one chunk of rows at a time).
        tokens: ``[...]`` (one token per row) or ``[..., K]`` (K tokens per row, e.g. a top-k set).
        temperature: the sampling temperature the tokens were drawn with.
        with_entropy: also return the entropy of each row's distribution, differentiable.
        chunk_size: rows per chunk; by default about 128 MiB of float32 per chunk buffer.
    """
    _check_temperature(temperature)
    lead = logits.shape[:-1]
    index, single = _flatten(tokens, lead)
    chunk = _rows_per_chunk(logits.shape[-1], chunk_size)
    logp, entropy = _LogitsLogProbs.apply(logits.reshape(-1, logits.shape[-1]), index, temperature, chunk, with_entropy)
    logp = logp.reshape(lead) if single else logp.reshape(tokens.shape)
    return TokenLogProbs(logp, entropy.reshape(lead) if with_entropy else None)


def linear_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
) -> TokenLogProbs:
    """Like ``token_logprobs(hidden @ weight.T + bias, tokens)`` without ever holding the ``[..., V]`` logits.

    Args:
        hidden: final hidden states ``[..., H]`` (the input of the model's output layer).
        weight: output-embedding weight ``[V, H]`` (``model.get_output_embeddings().weight``; tied weights work).
        tokens: ``[...]`` or ``[..., K]``.
        bias: optional ``[V]`` output bias.
        temperature, with_entropy, chunk_size: as in ``token_logprobs``.
    """
    _check_temperature(temperature)
    lead = hidden.shape[:-1]
    index, single = _flatten(tokens, lead)
    chunk = _rows_per_chunk(weight.shape[0], chunk_size)
    logp, entropy = _LinearLogProbs.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, index, temperature, chunk, with_entropy
    )
    logp = logp.reshape(lead) if single else logp.reshape(tokens.shape)
    return TokenLogProbs(logp, entropy.reshape(lead) if with_entropy else None)


@torch.no_grad()
def linear_topk_logprobs(
    hidden: Tensor,
    weight: Tensor,
    k: int,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The ``k`` most likely tokens of each row of ``softmax((hidden @ weight.T + bias) / temperature)`` and their
    log-probabilities, ``(logp[..., k], ids[..., k])`` in descending order, without the ``[..., V]`` logits (no
    gradient: DPPO's top-k divergence reads the old policy's top-k set).

    Args:
        hidden: final hidden states ``[..., H]``.
        weight: output-embedding weight ``[V, H]``.
        k: tokens per row (at most ``V``).
        bias, temperature, chunk_size: as in ``linear_token_logprobs``.
    """
    _check_temperature(temperature)
    if not 1 <= k <= weight.shape[0]:
        raise ValueError(f"k={k} must be in [1, {weight.shape[0]}] (the vocabulary size).")
    lead, flat = hidden.shape[:-1], hidden.reshape(-1, hidden.shape[-1])
    chunk = _rows_per_chunk(weight.shape[0], chunk_size)
    logp = flat.new_empty((flat.shape[0], k), dtype=torch.float32)
    ids = torch.empty((flat.shape[0], k), dtype=torch.long, device=flat.device)
    for rows in _chunks(flat.shape[0], chunk):
        z = _linear_chunk(flat[rows], weight, bias, temperature)  # [C, V]
        top = z.topk(k, dim=-1)
        logp[rows], ids[rows] = top.values - torch.logsumexp(z, dim=-1, keepdim=True), top.indices
    return logp.reshape(*lead, k), ids.reshape(*lead, k)


@torch.no_grad()
def topk_logprobs(logits: Tensor, k: int, *, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """``linear_topk_logprobs`` for given logits ``[..., V]`` (models whose logits are not a plain linear map)."""
    _check_temperature(temperature)
    z = logits.float() / temperature
    top = z.topk(k, dim=-1)
    return top.values - torch.logsumexp(z, dim=-1, keepdim=True), top.indices
