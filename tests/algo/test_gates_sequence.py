"""Sequence-level and divergence gates against float64 references written per sequence with scalars."""

import math

import pytest
import torch

from gpo.algo import (
    DivergenceMaskGate,
    GeometricMeanGate,
    SequenceClipGate,
    SequenceMean,
    VESPOGate,
)


def grad_of(value, logp):
    (grad,) = torch.autograd.grad(value, logp, retain_graph=True)
    return grad


def seq_mean_loss(gate, batch, adv=None):
    loss, metrics = gate(batch.logp, batch.old_logp, batch.adv if adv is None else adv, batch.mask)
    assert torch.all(loss[batch.mask == 0] == 0)
    return SequenceMean()(loss, batch.mask), metrics


def reference_objective(batch, score):
    """-(1/G) sum_i score(i, positions), G = number of non-empty sequences."""
    rows = list(batch.rows())
    return -sum(score(i, positions) for i, positions in rows) / len(rows)


def test_gspo_sequence_ratio_clipped_per_sequence(batch):
    lo, hi = 0.1, 0.1

    def score(i, positions):
        s = torch.exp(sum(batch.logp[i, t] - batch.old_logp[i, t] for t in positions) / len(positions))
        a = batch.seq_adv[i].item()
        return torch.minimum(s * a, torch.clamp(s, 1 - lo, 1 + hi) * a)

    value, metrics = seq_mean_loss(SequenceClipGate(clip_low=lo, clip_high=hi), batch)
    ref = reference_objective(batch, score)
    torch.testing.assert_close(value, ref)
    torch.testing.assert_close(grad_of(value, batch.logp), grad_of(ref, batch.logp))
    # sequence log-ratios: row 0 mean(0.05, 0.35, -0.3, 0.1) = 0.05 -> s = 1.051 (inside);
    # row 1 mean(-0.3, 0.35, -0.05, 0.8, -0.9, 0.1) = 0 -> s = 1; row 4 mean(1.3, -0.45, 0.02) = 0.29 -> s = 1.336,
    # A < 0 so its ratio above the band is not clipped (min picks s * A); row 3 has A = 0.
    assert metrics["clip/high_frac"].item() == 0 and metrics["clip/low_frac"].item() == 0
    assert metrics["seq_ratio/max"].item() == pytest.approx(math.exp(0.29))


def test_gspo_clips_whole_sequence_when_ratio_leaves_band(batch):
    # flip row 4's advantage positive: s = 1.336 > 1.1, so every token of row 4 loses its gradient
    adv = batch.adv.clone()
    adv[4] = -adv[4]
    value, metrics = seq_mean_loss(SequenceClipGate(clip_low=0.1, clip_high=0.1), batch, adv)
    grad = grad_of(value, batch.logp)
    assert torch.all(grad[4] == 0)
    assert torch.all(grad[0, :4] != 0)
    assert metrics["clip/high_frac"].item() == pytest.approx(1 / 4)  # 1 of 4 non-empty sequences


def test_gspo_gradient_weights_tokens_equally(batch):
    # unclipped GSPO gradient: -(1/G) A_i s_i / |o_i| on every token of sequence i
    value, _ = seq_mean_loss(SequenceClipGate(clip_low=0.9, clip_high=5.0), batch)
    lr = (batch.logp - batch.old_logp).detach() * batch.mask
    length = batch.mask.sum(-1).clamp_min(1)
    s = torch.exp(lr.sum(-1) / length)
    expected = -(batch.seq_adv * s / length)[:, None] * batch.mask / 4
    torch.testing.assert_close(grad_of(value, batch.logp), expected)


@pytest.mark.parametrize(("lo", "hi"), [(0.1, 0.1), (0.9, 5.0), (0.01, 0.3)])
def test_gspo_token_with_constant_advantage_equals_gspo(batch, lo, hi):
    seq, _ = seq_mean_loss(SequenceClipGate(clip_low=lo, clip_high=hi), batch)
    tok, _ = seq_mean_loss(SequenceClipGate(clip_low=lo, clip_high=hi, per_token_advantage=True), batch)
    torch.testing.assert_close(tok, seq)
    torch.testing.assert_close(grad_of(tok, batch.logp), grad_of(seq, batch.logp))


def test_gspo_token_gradient_with_per_token_advantages(batch):
    # A_{i,t} varies within a sequence; gradient on token t: -(1/G)(1/|o_i|) sg(s_i) A_{i,t} (all unclipped here)
    adv = torch.linspace(-1, 1, 30, dtype=torch.float64).reshape(5, 6) * batch.mask
    value, _ = seq_mean_loss(SequenceClipGate(clip_low=0.9, clip_high=5.0, per_token_advantage=True), batch, adv)
    lr = (batch.logp - batch.old_logp).detach() * batch.mask
    length = batch.mask.sum(-1).clamp_min(1)
    s = torch.exp(lr.sum(-1) / length)
    expected = -(s / length)[:, None] * adv * batch.mask / 4
    torch.testing.assert_close(grad_of(value, batch.logp), expected)


def test_gmpo_matches_paper_product_form(batch):
    lo = hi = 0.4

    def score_log_space(i, positions):
        a = batch.seq_adv[i].item()
        clipped = []
        for t in positions:
            lr = batch.logp[i, t] - batch.old_logp[i, t]
            clipped.append(torch.clamp(lr, max=hi) if a > 0 else torch.clamp(lr, min=-lo))
        return a * torch.exp(sum(clipped) / len(positions))

    def score_paper(i, positions):
        # sgn(A) * (prod_t |min(rho A, clip(rho, e^-lo, e^hi) A)|)^(1/|o|)
        a = batch.seq_adv[i].item()
        prod = torch.ones((), dtype=torch.float64)
        for t in positions:
            rho = torch.exp(batch.logp[i, t] - batch.old_logp[i, t])
            c = torch.minimum(rho * a, torch.clamp(rho, math.exp(-lo), math.exp(hi)) * a)
            prod = prod * c.abs()
        return math.copysign(1.0, a) * prod ** (1 / len(positions)) if a != 0 else prod * 0

    value, metrics = seq_mean_loss(GeometricMeanGate(clip_low=lo, clip_high=hi), batch)
    for score in (score_log_space, score_paper):
        ref = reference_objective(batch, score)
        torch.testing.assert_close(value, ref)
        torch.testing.assert_close(grad_of(value, batch.logp), grad_of(ref, batch.logp))
    # clipped tokens: A>0 & lr>0.4 -> none in row 0; A<0 & lr<-0.4 -> row 1 (-0.9), row 4 (-0.45): 2 of 15
    assert metrics["clip/low_frac"].item() == pytest.approx(2 / 15)


@pytest.mark.parametrize("gate", [GeometricMeanGate(), GeometricMeanGate(clip_low=0.2, clip_high=0.3)])
def test_gmpo_zero_advantage_sequence_with_a_runaway_ratio_adds_nothing(gate):
    # row 1 has zero advantage and a mean log-ratio of 100 (exp overflows float32): its score is 0, not 0 x inf
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, -0.2, 0.3], [100.0, 100.0, 100.0]], requires_grad=True)
    adv, mask = torch.tensor([[1.0] * 3, [0.0] * 3]), torch.ones(2, 3)
    value = SequenceMean()(gate(logp, old, adv, mask)[0], mask)
    alone = logp[:1].detach().requires_grad_()
    expected = SequenceMean()(gate(alone, old[:1], adv[:1], mask[:1])[0], mask[:1]) / 2
    torch.testing.assert_close(value, expected)
    grad = grad_of(value, logp)
    torch.testing.assert_close(grad[0], grad_of(expected, alone)[0])
    assert torch.equal(grad[1], torch.zeros(3))


def test_gmpo_gradient_is_geometric_mean_weighted(batch):
    # d score_i / d logp_t = A_i * exp(mean l) / |o_i| on unclipped tokens (gradient of the loss is minus that / G)
    lo = hi = 0.4
    value, _ = seq_mean_loss(GeometricMeanGate(clip_low=lo, clip_high=hi), batch)
    lr = (batch.logp - batch.old_logp).detach()
    pos = (batch.seq_adv > 0)[:, None]
    clipped = torch.where(pos, lr.clamp(max=hi), lr.clamp(min=-lo)) * batch.mask
    unclipped = torch.where(pos, lr <= hi, lr >= -lo) & (batch.mask > 0)
    length = batch.mask.sum(-1).clamp_min(1)
    geo = torch.exp(clipped.sum(-1) / length)
    expected = -(batch.seq_adv * geo / length)[:, None] * unclipped / 4
    torch.testing.assert_close(grad_of(value, batch.logp), expected)


def test_vespo_kernel_weight_and_gradient(batch):
    gate = VESPOGate(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)

    def phi(i, positions):
        w = math.exp(sum((batch.logp[i, t] - batch.old_logp[i, t]).item() for t in positions))
        k, lam = (2.0, 3.0) if batch.seq_adv[i] >= 0 else (3.0, 2.0)
        return w**k * math.exp(lam * (1 - w))

    def score(i, positions):
        a = batch.seq_adv[i].item()
        return phi(i, positions) * a * sum(batch.logp[i, t] for t in positions) / len(positions)

    value, metrics = seq_mean_loss(gate, batch)
    ref = reference_objective(batch, score)
    torch.testing.assert_close(value, ref)
    torch.testing.assert_close(grad_of(value, batch.logp), grad_of(ref, batch.logp))
    # row 1: W = exp(0) = 1 -> phi = 1 (the kernel is calibrated to 1 at W = 1)
    assert phi(1, list(range(6))) == pytest.approx(1.0)
    assert metrics["vespo/weight_max"].item() == pytest.approx(max(phi(i, p) for i, p in batch.rows()))


def test_vespo_extreme_log_weight_stays_finite(batch):
    old = batch.old_logp.clone()
    old[0] -= 200.0  # W = e^800 for row 0
    old[1] += 200.0  # W = e^-1200 for row 1
    loss, _ = VESPOGate()(batch.logp, old, batch.adv, batch.mask)
    value = SequenceMean()(loss, batch.mask)
    assert torch.isfinite(value)
    assert torch.all(torch.isfinite(grad_of(value, batch.logp)))


def bernoulli_kl(p, q):
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


@pytest.mark.parametrize("mode", ["binary_tv", "binary_kl"])
def test_dppo_binary_masks_only_updates_pushing_out(batch, mode):
    threshold = 0.02 if mode == "binary_tv" else 0.005
    dropped_count = kept_far_count = 0

    def term(i, t):
        nonlocal dropped_count, kept_far_count
        p, q = math.exp(batch.logp[i, t].item()), math.exp(batch.old_logp[i, t].item())
        d = abs(p - q) if mode == "binary_tv" else bernoulli_kl(p, q)
        a = batch.seq_adv[i].item()
        pushing_out = (a > 0 and p > q) or (a < 0 and p < q)
        if d > threshold and pushing_out:
            dropped_count += 1
            return torch.zeros((), dtype=torch.float64)
        kept_far_count += d > threshold
        return -a * torch.exp(batch.logp[i, t] - batch.old_logp[i, t])

    ref = sum(term(i, t) for i, positions in batch.rows() for t in positions)
    loss, metrics = DivergenceMaskGate(mode=mode, threshold=threshold)(
        batch.logp, batch.old_logp, batch.adv, batch.mask
    )
    torch.testing.assert_close(loss.sum(), ref)
    torch.testing.assert_close(grad_of(loss.sum(), batch.logp), grad_of(ref, batch.logp))
    assert dropped_count > 0 and kept_far_count > 0  # the fixture exercises both sides of the rule
    assert metrics["dppo/masked_frac"].item() == pytest.approx(dropped_count / 15)


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_dppo_topk_divergence_is_exact_on_coarse_bins_and_a_lower_bound(kind):
    gen = torch.Generator().manual_seed(3)
    old_logits = torch.randn(4, 6, dtype=torch.float64, generator=gen) * 2
    new_logits = old_logits + torch.randn(4, 6, dtype=torch.float64, generator=gen) * 0.5
    old_full, new_full = old_logits.softmax(-1), new_logits.softmax(-1)
    top = old_full.topk(3, dim=-1).indices
    gate = DivergenceMaskGate(mode=f"topk_{kind}", threshold=0.1)
    d = gate.divergence(
        torch.zeros(1, 4), torch.zeros(1, 4), new_full.gather(-1, top).log()[None], old_full.gather(-1, top).log()[None]
    )[0]
    for row in range(4):
        p = [new_full[row, j].item() for j in top[row]]
        q = [old_full[row, j].item() for j in top[row]]
        p.append(1 - sum(p))
        q.append(1 - sum(q))
        if kind == "tv":
            coarse = 0.5 * sum(abs(a - b) for a, b in zip(p, q, strict=True))
            full = 0.5 * (new_full[row] - old_full[row]).abs().sum().item()
        else:
            coarse = sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))
            full = (new_full[row] * (new_full[row] / old_full[row]).log()).sum().item()
        assert d[row].item() == pytest.approx(coarse, rel=1e-5)
        assert coarse <= full + 1e-9


def test_dppo_topk_requires_the_topk_inputs(batch):
    gate = DivergenceMaskGate(mode="topk_kl", threshold=0.1)
    assert gate.requires == {"topk_logp", "old_topk_logp"}
    with pytest.raises(ValueError, match="needs topk_logp"):
        gate(batch.logp, batch.old_logp, batch.adv, batch.mask)
    assert DivergenceMaskGate(mode="binary_tv", threshold=0.1).requires == frozenset()


@pytest.mark.parametrize(
    "gate",
    [
        SequenceClipGate(),
        SequenceClipGate(per_token_advantage=True),
        GeometricMeanGate(),
        VESPOGate(),
        DivergenceMaskGate(mode="binary_tv", threshold=0.01),
        DivergenceMaskGate(mode="binary_kl", threshold=0.01),
    ],
    ids=lambda g: type(g).__name__,
)
def test_on_policy_gradient_is_reinforce(gate, batch):
    # ratio 1: every gate gives the sequence-mean REINFORCE gradient -(1/G) A_i / |o_i|
    loss, _ = gate(batch.logp, batch.logp.detach(), batch.adv, batch.mask)
    value = SequenceMean()(loss, batch.mask)
    length = batch.mask.sum(-1).clamp_min(1)
    expected = -(batch.seq_adv / length)[:, None] * batch.mask / 4
    torch.testing.assert_close(grad_of(value, batch.logp), expected)


@pytest.mark.parametrize(
    "gate",
    [SequenceClipGate(), SequenceClipGate(per_token_advantage=True), GeometricMeanGate(), VESPOGate()],
    ids=lambda g: type(g).__name__,
)
def test_nan_on_padding_never_leaks(gate, batch):
    logp = batch.logp.detach().clone()
    logp[batch.mask == 0] = float("nan")
    logp.requires_grad_(True)
    loss, metrics = gate(logp, batch.old_logp, batch.adv, batch.mask)
    value = SequenceMean()(loss, batch.mask)
    (grad,) = torch.autograd.grad(value, logp)
    assert torch.isfinite(value) and torch.all(torch.isfinite(grad)) and torch.all(grad[batch.mask == 0] == 0)
    assert all(torch.isfinite(v) for v in metrics.values())


def test_divergence_gate_refuses_unknown_mode():
    with pytest.raises(ValueError, match="'binary_tv', 'binary_kl', 'topk_tv', 'topk_kl'"):
        DivergenceMaskGate(mode="tv", threshold=0.1)


def test_vespo_zero_mean_per_token_advantage_takes_the_non_negative_kernel():
    """VESPO: phi(W) = W^k exp(lambda (1 - W)) with (k_pos, lambda_pos) where mean_t A_t >= 0, a mean of 0 included."""
    # one sequence, two tokens, per-token advantages (+1, -1): sequence mean exactly 0 -> the (k_pos, lambda_pos) kernel
    # log W = 0.3 - 0.1 = 0.2; phi = e^(2 * 0.2) exp(3 (1 - e^0.2)) (the negative kernel: e^0.6 exp(2 (1 - e^0.2)))
    old = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    logp = (old + torch.tensor([[0.3, -0.1]], dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    loss, _ = VESPOGate(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)(logp, old, adv, torch.ones(1, 2))
    w = math.exp(0.2)
    phi = w**2 * math.exp(3 * (1 - w))
    # loss_t = -phi A_t log pi(o_t); gradient -phi A_t (phi is a constant)
    expected = [-phi * 1.0 * logp[0, 0].item(), -phi * -1.0 * logp[0, 1].item()]
    torch.testing.assert_close(loss.detach(), torch.tensor([expected], dtype=torch.float64))
    (g,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(g, torch.tensor([[-phi, phi]], dtype=torch.float64))


def test_dppo_keeps_a_token_whose_divergence_equals_the_threshold():
    """DPPO: M_t = 0 only if D_t > delta (strict) and the update pushes out; D_t == delta keeps -A_t r_t."""
    # pi = 0.5, pi_old = 0.25 (exact in binary): binary TV = |0.5 - 0.25| = 0.25 == delta; r = 2, A = 1 pushes out
    old = torch.tensor([[0.25]], dtype=torch.float64).log()
    logp = torch.tensor([[0.5]], dtype=torch.float64).log().requires_grad_(True)
    gate = DivergenceMaskGate(mode="binary_tv", threshold=0.25)
    loss, metrics = gate(logp, old, torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1))
    assert gate.divergence(logp.detach(), old, None, None).item() == 0.25  # the tie is exact
    assert loss.item() == -2.0 and metrics["dppo/masked_frac"].item() == 0
    (g,) = torch.autograd.grad(loss.sum(), logp)
    assert g.item() == -2.0  # d(-A r)/d logp = -A r
