"""Shared checks of the Hypothesis fuzz tests of gpo.algo (test_fuzz_*.py): random shapes, groups, masks, rewards
and ratios.

Each test checks what the part documents: finite outputs even where padding holds NaN or inf, the documented
shape, gradients w.r.t. ``logp`` that are finite and zero on padding, and the part's own invariants. Float32
results are compared with float64 references built from the same float32 inputs; where float32 cannot
resolve a spread (all-equal groups, spreads near the rounding of the values) only finiteness is checked here
and exact behaviour in dedicated tests.
"""

import torch
from torch import Tensor

from gpo.algo import (
    SequenceMean,
    SequenceSum,
    TokenMean,
)

EPS = 1e-6  # the estimators' default eps
TINY = 1e-30  # absolute slack for products that underflow float32


def grad(value: Tensor, x: Tensor) -> Tensor:
    (g,) = torch.autograd.grad(value, x, retain_graph=True)
    return g


def groups(labels: list[int]) -> list[Tensor]:
    """Row indices of each group."""
    return [torch.tensor([i for i, g in enumerate(labels) if g == label]) for label in sorted(set(labels))]


def group_size(labels: list[int]) -> Tensor:
    """``[B]`` size of each row's group."""
    return torch.tensor([labels.count(g) for g in labels], dtype=torch.float64)


def resolvable(spread: Tensor | float, values: Tensor) -> bool:
    """float32 resolves ``spread``: it is far above the rounding error of the largest of ``values``."""
    return float(spread) > 1e-3 * float(values.abs().max())


def sequence_values(estimator, reward: Tensor, group: Tensor) -> Tensor:
    """``[B]`` per-completion advantage (the estimator's output under an all-ones mask)."""
    return estimator(reward, group, torch.ones(len(reward), 1))[:, 0]


def token_weight(aggregator, mask: Tensor) -> Tensor:
    """``d loss / d per_token_loss[B, T]`` as each aggregator's docstring defines the loss (float64)."""
    mask = mask.double()
    lengths = mask.sum(-1, keepdim=True)
    sequences = (lengths > 0).sum().clamp_min(1)
    if isinstance(aggregator, TokenMean):
        return mask / mask.sum().clamp_min(1)
    if isinstance(aggregator, SequenceMean):
        return mask / lengths.clamp_min(1) / sequences
    if isinstance(aggregator, SequenceSum):
        return mask / sequences
    return mask / (mask.shape[0] * aggregator.max_length)


def real_log_ratio(case) -> Tensor:
    """``log pi - log pi_old`` in float32 as every gate sees it, 0 on padding."""
    return torch.where(case.mask.bool(), case.logp.detach() - case.old_logp, torch.zeros_like(case.old_logp))


def check_metrics(metrics: dict[str, Tensor], gate=None) -> None:
    for key, value in metrics.items():
        assert value.shape == () and not value.requires_grad, key
        if key == "dppo/divergence_mean" and gate.kind == "kl":
            assert value >= -1e-6, key  # may be +inf: see test_divergence_kl_metric_is_finite
        else:
            assert torch.isfinite(value), f"{key} = {value}"


def check_padding_never_leaks(value: Tensor, case) -> None:
    """``value`` is a finite scalar whose gradient w.r.t. ``logp`` is finite and zero on padding."""
    assert value.shape == () and torch.isfinite(value), value
    g = grad(value, case.logp)
    assert torch.isfinite(g).all(), g
    assert (g[case.padding] == 0).all(), g


def assert_within(actual: Tensor, expected: Tensor, bound: Tensor) -> None:
    """``|actual - expected| <= bound`` elementwise, give or take float32's underflow."""
    error = (actual.double() - expected.double()).abs() - TINY
    assert (error <= bound).all(), f"max error {(error - bound).max()} over the bound\n{actual}\n{expected}"
