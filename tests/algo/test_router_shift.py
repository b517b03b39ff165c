"""RSPO's router-shift pieces (``gpo.algo.gates.router``) against a real tiny Qwen2-MoE built locally.

References are float64 and written with explicit Python loops over layers, positions, experts and sequences,
straight from the seed-003 formula (with gamma a damping weight for either sign, as ``RouterShiftGate`` explains),
so they share no vectorisation with the implementation:

    gamma_{i,t} = max(gamma_min, exp(-(1/L) sum_l (1/K) sum_k |log r_l(e_lk) - log r_old_l(e_lk)|))
    score_i     = [prod_t W_t]^(sgn(A_i) / |o_i|) * [prod_t gamma_t]^(1 / |o_i|) * A_i,    W_t = c_t^sgn(A_i)

with ``c_t`` GMPO's clipped ratio: ``min(w_t, clip(w_t))`` for ``A > 0`` and ``max(w_t, clip(w_t))`` for
``A < 0``, ``clip(w) = clip(w, e^-clip_low, e^clip_high)`` (so clip_low bounds falls, clip_high bounds rises).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import Tensor
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

from gpo.algo.aggregators import SequenceMean
from gpo.algo.gates import GeometricMeanGate, RouterShiftGate, router_logprobs, router_shift_weight

VOCAB, LAYERS, EXPERTS, TOP_K = 64, 2, 4, 2
BATCH, SEQ_LEN = 3, 7
PROMPT_LEN = 3  # completions are tokens PROMPT_LEN .. SEQ_LEN - 1
ROUTER_NOISE = 0.03  # std of the perturbation added to the new model's router weights


# ---------------------------------------------------------------------------------------------------------------
# fixtures: a tiny MoE, an "old" copy and a "new" copy whose routers alone moved
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def config() -> Qwen2MoeConfig:
    return Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        initializer_range=0.1,  # larger than the default 0.02 so the routers are clearly non-uniform
    )


@pytest.fixture
def old_model(config: Qwen2MoeConfig) -> Qwen2MoeForCausalLM:
    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(config).eval()


def _is_router(name: str) -> bool:
    # "model.layers.{l}.mlp.gate.weight" (the top-k router), not "...mlp.shared_expert_gate.weight"
    return name.endswith("mlp.gate.weight")


@pytest.fixture
def new_model(old_model: Qwen2MoeForCausalLM) -> Qwen2MoeForCausalLM:
    model = copy.deepcopy(old_model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if _is_router(name):
                param.add_(ROUTER_NOISE * torch.randn(param.shape, generator=generator))
    return model


@pytest.fixture
def tokens() -> Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(2))


# ---------------------------------------------------------------------------------------------------------------
# float64 loop references
# ---------------------------------------------------------------------------------------------------------------


def reference_gamma(router_logp: Tensor, old_router_logp: Tensor, top_k: int, gamma_min: float) -> list[list[float]]:
    """``gamma[b][t]`` from ``[L, B, T, E]`` inputs, one layer / position / expert at a time, in float64."""
    new = router_logp.detach().double().tolist()
    old = old_router_logp.detach().double().tolist()
    n_layers, n_batch, n_pos = len(old), len(old[0]), len(old[0][0])
    gamma = []
    for b in range(n_batch):
        row = []
        for t in range(n_pos):
            total = 0.0
            for layer in range(n_layers):
                old_lp, new_lp = old[layer][b][t], new[layer][b][t]
                chosen = sorted(range(len(old_lp)), key=lambda e, lp=old_lp: -lp[e])[:top_k]  # old router's top-K
                total += sum(abs(new_lp[e] - old_lp[e]) for e in chosen) / top_k
            row.append(max(gamma_min, math.exp(-total / n_layers)))
        gamma.append(row)
    return gamma


def _clip(x: Tensor, low: float, high: float) -> Tensor | float:
    return low if x < low else high if x > high else x


def reference_scores(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    gamma: list[list[float]],
    clip_low: float,
    clip_high: float,
) -> list[Tensor]:
    """``score_i`` per sequence, differentiable w.r.t. ``logp`` (float64, one token at a time; gamma constant)."""
    scores = []
    for i in range(logp.shape[0]):
        real = [t for t in range(logp.shape[1]) if mask[i, t] > 0]
        a = sum(float(adv[i, t]) for t in real) / len(real)
        sgn = (a > 0) - (a < 0)
        product = torch.ones((), dtype=torch.float64)
        for t in real:
            w = torch.exp(logp[i, t].double() - float(old_logp[i, t]))
            clipped = _clip(w, math.exp(-clip_low), math.exp(clip_high))
            c = min(w, clipped) if a > 0 else max(w, clipped)  # GMPO: the pessimistic side of the clip
            product = product * c**sgn  # W_t = c_t^sgn(A_i)
        damping = math.prod(gamma[i][t] for t in real) ** (1 / len(real))  # geomean(gamma), whatever the sign
        scores.append(product ** (sgn / len(real)) * damping * a)  # sgn = 0 gives product^0 * 0 = 0
    return scores


def reference_loss(scores: list[Tensor]) -> Tensor:
    """``-(1/G) sum_i score_i`` (what SequenceMean makes of a per-token loss of ``-score_i``)."""
    return -sum(scores) / len(scores)


# ---------------------------------------------------------------------------------------------------------------
# 1. router_logprobs on the model's own router logits
# ---------------------------------------------------------------------------------------------------------------


def test_router_logprobs_hand_worked() -> None:
    # one layer, B=2, S=1, E=2: logits (0, ln 3) -> probs (1/4, 3/4); logits (ln 2, ln 2) -> (1/2, 1/2)
    logits = torch.tensor([[0.0, math.log(3.0)], [math.log(2.0), math.log(2.0)]])
    out = router_logprobs([logits], batch_size=2)
    assert out.shape == (1, 2, 1, 2)
    expected = torch.tensor([[[[math.log(0.25), math.log(0.75)]], [[math.log(0.5), math.log(0.5)]]]])
    torch.testing.assert_close(out, expected)


def test_router_logprobs_on_qwen2_moe(old_model: Qwen2MoeForCausalLM, tokens: Tensor) -> None:
    with torch.no_grad():
        out = old_model(input_ids=tokens, output_router_logits=True)
    # transformers 5.x: a tuple with one [B * S, E] tensor per MoE layer (recorded from Qwen2MoeTopKRouter)
    assert isinstance(out.router_logits, tuple) and len(out.router_logits) == LAYERS
    assert all(layer.shape == (BATCH * SEQ_LEN, EXPERTS) for layer in out.router_logits)

    logp = router_logprobs(out.router_logits, batch_size=BATCH)
    assert logp.shape == (LAYERS, BATCH, SEQ_LEN, EXPERTS)
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(LAYERS, BATCH, SEQ_LEN))

    # hand log-softmax in float64: x - max - log(sum exp(x - max)), row by row, rows in [B * S] order (b-major)
    for layer, logits in enumerate(out.router_logits):
        for row in range(BATCH * SEQ_LEN):
            x = logits[row].double()
            expected = x - x.max() - torch.log(torch.exp(x - x.max()).sum())
            b, s = divmod(row, SEQ_LEN)
            torch.testing.assert_close(logp[layer, b, s].double(), expected, rtol=1e-6, atol=1e-6)

    # the [B, S] unflattening must match what the model routes for each sequence alone
    for b in range(BATCH):
        with torch.no_grad():
            single = old_model(input_ids=tokens[b : b + 1], output_router_logits=True)
        alone = torch.stack([layer.log_softmax(-1) for layer in single.router_logits])  # [L, S, E]
        torch.testing.assert_close(logp[:, b], alone, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# 2. router_shift_weight between an old and a new router
# ---------------------------------------------------------------------------------------------------------------


def _router_logp(model: Qwen2MoeForCausalLM, tokens: Tensor) -> Tensor:
    with torch.no_grad():
        return router_logprobs(model(input_ids=tokens, output_router_logits=True).router_logits, tokens.shape[0])


def test_new_model_differs_only_in_router(old_model: Qwen2MoeForCausalLM, new_model: Qwen2MoeForCausalLM) -> None:
    old_params = dict(old_model.named_parameters())
    moved = {name for name, p in new_model.named_parameters() if not torch.equal(p, old_params[name])}
    assert moved == {f"model.layers.{layer}.mlp.gate.weight" for layer in range(LAYERS)}


def test_router_shift_weight_hand_worked() -> None:
    # L=1, B=1, T=1, E=3, K=2. old probs (0.5, 0.3, 0.2) -> top-2 experts {0, 1}; new probs (0.4, 0.4, 0.2).
    # |ln .4 - ln .5| = ln 1.25 = 0.22314, |ln .4 - ln .3| = ln(4/3) = 0.28768; mean over K = 0.25541
    # gamma = exp(-0.25541) = (1.25 * 4/3)^(-1/2) = (5/3)^(-1/2) = sqrt(0.6) = 0.774597 (expert 2 is ignored)
    old = torch.tensor([0.5, 0.3, 0.2]).log().reshape(1, 1, 1, 3)
    new = torch.tensor([0.4, 0.4, 0.2]).log().reshape(1, 1, 1, 3)
    gamma = router_shift_weight(new, old, top_k=2, gamma_min=0.1)
    assert gamma.shape == (1, 1)
    assert gamma.item() == pytest.approx(math.sqrt(0.6), rel=1e-6)
    # floor: max(0.8, 0.774597) = 0.8
    assert router_shift_weight(new, old, top_k=2, gamma_min=0.8).item() == pytest.approx(0.8)
    # top_k=1 keeps expert 0 only: gamma = exp(-ln 1.25) = 0.8
    assert router_shift_weight(new, old, top_k=1, gamma_min=0.1).item() == pytest.approx(0.8, rel=1e-6)


def test_router_shift_weight_identical_routers_is_one(old_model: Qwen2MoeForCausalLM, tokens: Tensor) -> None:
    same = copy.deepcopy(old_model)
    gamma = router_shift_weight(_router_logp(same, tokens), _router_logp(old_model, tokens), TOP_K, gamma_min=0.5)
    assert torch.equal(gamma, torch.ones(BATCH, SEQ_LEN))


def test_router_shift_weight_matches_loop_reference(
    old_model: Qwen2MoeForCausalLM, new_model: Qwen2MoeForCausalLM, tokens: Tensor
) -> None:
    old_lp, new_lp = _router_logp(old_model, tokens), _router_logp(new_model, tokens)
    assert not torch.allclose(old_lp, new_lp)

    # unfloored (gamma_min tiny): every value strictly inside (0, 1), matching the loop reference
    raw = router_shift_weight(new_lp, old_lp, TOP_K, gamma_min=1e-9)
    assert raw.shape == (BATCH, SEQ_LEN)
    expected_raw = torch.tensor(reference_gamma(new_lp, old_lp, TOP_K, 1e-9), dtype=torch.float64)
    torch.testing.assert_close(raw.double(), expected_raw, rtol=1e-5, atol=1e-6)
    assert (raw < 1).all() and (raw > 0).all()

    # floor at the median: about half the positions sit exactly on gamma_min, the rest are untouched
    gamma_min = raw.median().item()
    gamma = router_shift_weight(new_lp, old_lp, TOP_K, gamma_min=gamma_min)
    expected = torch.tensor(reference_gamma(new_lp, old_lp, TOP_K, gamma_min), dtype=torch.float64)
    torch.testing.assert_close(gamma.double(), expected, rtol=1e-5, atol=1e-6)
    assert ((gamma >= gamma_min) & (gamma <= 1)).all()
    floored = raw < gamma_min
    assert floored.any() and (~floored).any()
    assert (gamma[floored] == gamma_min).all()
    assert torch.equal(gamma[~floored], raw[~floored])


def test_router_shift_weight_has_no_grad(
    old_model: Qwen2MoeForCausalLM, new_model: Qwen2MoeForCausalLM, tokens: Tensor
) -> None:
    # router log-probs straight from a forward pass with grad: they carry a graph back to the router weights
    new_lp = router_logprobs(new_model(input_ids=tokens, output_router_logits=True).router_logits, BATCH)
    assert new_lp.requires_grad
    old_lp = _router_logp(old_model, tokens).requires_grad_(True)
    gamma = router_shift_weight(new_lp, old_lp, TOP_K, gamma_min=0.5)
    assert not gamma.requires_grad and gamma.grad_fn is None


# ---------------------------------------------------------------------------------------------------------------
# 3. RouterShiftGate against the per-sequence reference
# ---------------------------------------------------------------------------------------------------------------


def _gate_loss_and_grad(gate, logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, **router):
    logp = logp.clone().requires_grad_(True)
    per_token, metrics = gate(logp, old_logp, adv, mask, **router)
    loss = SequenceMean()(per_token, mask)
    loss.backward()
    return per_token.detach(), loss.detach(), logp.grad, metrics


def test_router_shift_gate_hand_worked() -> None:
    # L=1, E=2, K=1. Old router probs (0.6, 0.4) at every position -> top-1 expert 0.
    # New router probs (0.54, 0.46) give gamma = 0.54 / 0.6 = 0.9; (0.48, 0.52) give gamma = 0.48 / 0.6 = 0.8.
    old_r = torch.tensor([0.6, 0.4]).log().expand(1, 2, 2, 2)
    new_r = torch.tensor([[[0.54, 0.46], [0.48, 0.52]]]).log().expand(1, 2, 2, 2)
    logp = torch.tensor([[0.1, 0.5], [-0.5, 0.1]])  # old_logp = 0, so these are the log-ratios
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    mask = torch.ones(2, 2)
    gate = RouterShiftGate(top_k=1, gamma_min=0.5, clip_low=0.3, clip_high=0.2)
    per_token, loss, _, metrics = _gate_loss_and_grad(
        gate, logp, torch.zeros(2, 2), adv, mask, router_logp=new_r, old_router_logp=old_r
    )
    # A = +1: log-ratios (0.1, 0.5) -> min(., 0.2) = (0.1, 0.2), mean 0.15; geomean(gamma) = sqrt(0.72) = 0.848528
    #         score = +1 * e^0.15 * 0.848528 = 1.161834 * 0.848528 = 0.985849
    # A = -2: log-ratios (-0.5, 0.1) -> max(., -0.3) = (-0.3, 0.1), mean -0.1; damped by geomean(gamma) too
    #         score = -2 * e^-0.1 * 0.848528 = -2 * 0.904837 * 0.848528 = -1.535560
    score_pos = math.exp(0.15) * math.sqrt(0.72)
    score_neg = -2 * math.exp(-0.1) * math.sqrt(0.72)
    assert score_pos == pytest.approx(0.985849, abs=1e-6) and score_neg == pytest.approx(-1.535560, abs=1e-6)
    torch.testing.assert_close(per_token, torch.tensor([[-score_pos] * 2, [-score_neg] * 2]))
    # SequenceMean: -(0.985849 - 1.535560) / 2 = 0.274855
    assert loss.item() == pytest.approx(0.274855, abs=1e-5)
    assert metrics["router_shift/min"].item() == pytest.approx(0.8, rel=1e-5)
    assert metrics["router_shift/max"].item() == pytest.approx(0.9, rel=1e-5)


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_routing_drift_damps_the_update_whatever_the_advantages_sign(advantage) -> None:
    """RSPO's router-shift weight is a drift penalty: the further a token's routing moved, the less it counts."""
    old_r = torch.tensor([0.6, 0.4]).log().expand(1, 1, 3, 2)
    drifted = torch.tensor([0.48, 0.52]).log().expand(1, 1, 3, 2)  # gamma = 0.8 at every token
    logp, adv, mask = torch.tensor([[0.05, -0.05, 0.02]]), torch.full((1, 3), advantage), torch.ones(1, 3)
    gate = RouterShiftGate(top_k=1, gamma_min=0.5)
    _, _, grad_same, _ = _gate_loss_and_grad(gate, logp, torch.zeros(1, 3), adv, mask, router_logp=old_r,
                                             old_router_logp=old_r)  # fmt: skip
    _, _, grad_drifted, _ = _gate_loss_and_grad(gate, logp, torch.zeros(1, 3), adv, mask, router_logp=drifted,
                                                old_router_logp=old_r)  # fmt: skip
    torch.testing.assert_close(grad_drifted, 0.8 * grad_same)


CLIP_LOW, CLIP_HIGH = 0.3, 0.2  # asymmetric, so swapping the two bounds is caught
# log-ratios per sequence (old_logp is random; logp = old_logp + these); nan marks padding
LOG_RATIOS = [
    [0.05, 0.35, -0.5, 0.1, -0.1, 0.0],  # A > 0: 0.35 > clip_high clipped; -0.5 not (a fall, A > 0)
    [-0.5, -0.25, 0.4, 0.1, -0.05, 0.15],  # A < 0: -0.5 < -clip_low clipped; -0.25 inside [-0.3, 0); 0.4 not
    [0.3, -0.4, 0.2, 0.1, 0.0, -0.1],  # A = 0: no gradient at all
    [0.25, -0.35, 0.05, math.nan, math.nan, math.nan],  # A > 0, padded after 3 tokens
    [-0.35, 0.5, -0.1, -0.2, math.nan, math.nan],  # A < 0, padded after 4 tokens
]
ADVANTAGES = [1.5, -0.8, 0.0, 0.7, -1.2]


@pytest.fixture
def gate_inputs() -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(3)
    n_seq, n_tok = len(LOG_RATIOS), len(LOG_RATIOS[0])
    log_ratio = torch.tensor(LOG_RATIOS)
    mask = (~log_ratio.isnan()).float()
    old_logp = -torch.rand(n_seq, n_tok, generator=generator) * 3
    # padding carries garbage log-probs; it must reach neither the value nor the gradient
    logp = torch.where(mask.bool(), old_logp + log_ratio.nan_to_num(0.0), torch.full_like(old_logp, 30.0))
    adv = torch.tensor(ADVANTAGES)[:, None].expand(n_seq, n_tok) * mask
    old_router = (torch.randn(LAYERS, n_seq, n_tok, EXPERTS, generator=generator) * 1.5).log_softmax(-1)
    new_router = (old_router + 0.4 * torch.randn(old_router.shape, generator=generator)).log_softmax(-1)
    inputs = {"logp": logp, "old_logp": old_logp, "adv": adv, "mask": mask}
    return {**inputs, "router": new_router, "old_router": old_router}


def test_router_shift_gate_matches_reference(gate_inputs: dict[str, Tensor]) -> None:
    x = gate_inputs
    gamma_raw = torch.tensor(reference_gamma(x["router"], x["old_router"], TOP_K, 1e-9))
    real = x["mask"].bool()
    gamma_min = gamma_raw[real].median().item()  # so the floor is active on about half the real tokens
    assert (gamma_raw[real] < gamma_min).any()
    gamma = reference_gamma(x["router"], x["old_router"], TOP_K, gamma_min)

    # the clip is active in both directions, and at a fall that only a swapped clip_high bound would clip
    lr = torch.tensor(LOG_RATIOS)
    assert (lr[torch.tensor(ADVANTAGES) > 0] > CLIP_HIGH).any()
    assert (lr[torch.tensor(ADVANTAGES) < 0] < -CLIP_LOW).any()
    assert ((lr[1] < -CLIP_HIGH) & (lr[1] > -CLIP_LOW)).any()

    router = x["router"].clone().requires_grad_(True)
    gate = RouterShiftGate(top_k=TOP_K, gamma_min=gamma_min, clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
    logp = x["logp"].clone().requires_grad_(True)
    per_token, metrics = gate(
        logp, x["old_logp"], x["adv"], x["mask"], router_logp=router, old_router_logp=x["old_router"]
    )
    loss = SequenceMean()(per_token, x["mask"])
    loss.backward()

    ref_logp = x["logp"].double().requires_grad_(True)
    scores = reference_scores(ref_logp, x["old_logp"], x["adv"], x["mask"], gamma, CLIP_LOW, CLIP_HIGH)
    ref_loss = reference_loss(scores)
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_logp)

    expected_per_token = torch.stack([-s.detach() for s in scores])[:, None] * x["mask"].double()
    torch.testing.assert_close(per_token.double(), expected_per_token, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logp.grad.double(), ref_grad, rtol=1e-5, atol=1e-7)

    # where the gradient must vanish: A = 0, padding, and clipped tokens
    assert (logp.grad[2] == 0).all()
    assert (logp.grad[~real] == 0).all()
    assert logp.grad[0, 1] == 0 and logp.grad[1, 0] == 0
    assert logp.grad[0, 2] != 0 and logp.grad[1, 1] != 0 and logp.grad[1, 2] != 0  # falls/rises left unclipped
    # gamma is a constant: nothing flows back into the router log-probs
    assert router.grad is None
    assert metrics["router_shift/min"].item() == pytest.approx(gamma_min, rel=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# 4. identical routers: RSPO reduces to GMPO
# ---------------------------------------------------------------------------------------------------------------


def test_identical_routers_equal_geometric_mean_gate(
    gate_inputs: dict[str, Tensor], old_model: Qwen2MoeForCausalLM
) -> None:
    x = gate_inputs
    # the same router run twice: copy the old model and route the same tokens through both
    n_seq, n_tok = x["logp"].shape
    tokens = torch.randint(0, VOCAB, (n_seq, n_tok), generator=torch.Generator().manual_seed(4))
    same_lp = _router_logp(copy.deepcopy(old_model), tokens)
    old_lp = _router_logp(old_model, tokens)
    assert torch.equal(router_shift_weight(same_lp, old_lp, TOP_K, 0.5), torch.ones(n_seq, n_tok))

    args = (x["logp"], x["old_logp"], x["adv"], x["mask"])
    rspo = RouterShiftGate(top_k=TOP_K, gamma_min=0.5, clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
    gmpo = GeometricMeanGate(clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
    per_token_r, loss_r, grad_r, metrics_r = _gate_loss_and_grad(
        rspo, *args, router_logp=same_lp, old_router_logp=old_lp
    )
    per_token_g, loss_g, grad_g, metrics_g = _gate_loss_and_grad(gmpo, *args)
    torch.testing.assert_close(per_token_r, per_token_g, rtol=0, atol=0)
    torch.testing.assert_close(loss_r, loss_g, rtol=0, atol=0)
    torch.testing.assert_close(grad_r, grad_g, rtol=0, atol=0)
    assert metrics_r["router_shift/min"] == 1 and metrics_r["router_shift/max"] == 1
    for key, value in metrics_g.items():
        torch.testing.assert_close(metrics_r[key], value)


# ---------------------------------------------------------------------------------------------------------------
# 5. end to end on the model
# ---------------------------------------------------------------------------------------------------------------


def _completion_inputs(model: Qwen2MoeForCausalLM, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """Token log-probs ``[B, T]`` of the completion and router log-probs ``[L, B, T, E]`` at the same positions.

    Position ``s`` predicts token ``s + 1``: the completion ``tokens[:, P:]`` is scored by positions
    ``P - 1 .. S - 2``, for the logits and the router alike.
    """
    out = model(input_ids=tokens, output_router_logits=True)
    positions = slice(PROMPT_LEN - 1, SEQ_LEN - 1)
    logits = out.logits[:, positions].float()
    logp = logits.log_softmax(-1).gather(-1, tokens[:, PROMPT_LEN:, None]).squeeze(-1)
    router = router_logprobs(out.router_logits, tokens.shape[0])[:, :, positions]
    return logp, router


def test_end_to_end_gradients(old_model: Qwen2MoeForCausalLM, new_model: Qwen2MoeForCausalLM, tokens: Tensor) -> None:
    n_tok = SEQ_LEN - PROMPT_LEN
    with torch.no_grad():
        old_logp, old_router = _completion_inputs(old_model, tokens)
    mask = torch.ones(BATCH, n_tok)
    mask[2, n_tok - 1 :] = 0  # the last sequence is one token shorter
    adv = torch.tensor([1.0, -0.5, 0.8])[:, None] * mask
    gate = RouterShiftGate(top_k=TOP_K, gamma_min=0.5, clip_low=CLIP_LOW, clip_high=CLIP_HIGH)

    def grads(detach_router: bool) -> tuple[dict[str, Tensor], Tensor, Tensor]:
        new_model.zero_grad(set_to_none=True)
        logp, router = _completion_inputs(new_model, tokens)
        assert logp.shape == (BATCH, n_tok) and router.shape == (LAYERS, BATCH, n_tok, EXPERTS)
        assert router.requires_grad  # the router log-probs do carry a graph to the router weights
        if detach_router:
            router = router.detach()
        per_token, _ = gate(logp, old_logp, adv, mask, router_logp=router, old_router_logp=old_router)
        loss = SequenceMean()(per_token, mask)
        loss.backward()
        return {name: p.grad.clone() for name, p in new_model.named_parameters()}, loss.detach(), logp.detach()

    live, loss, logp = grads(detach_router=False)
    detached, loss_detached, _ = grads(detach_router=True)

    # the routers moved, so the completion log-probs and routing both differ from the old model's
    assert not torch.allclose(logp, old_logp)
    new_router = _completion_inputs(new_model, tokens)[1].detach()
    gamma = router_shift_weight(new_router, old_router, TOP_K, 0.5)
    assert not gamma.requires_grad and (gamma < 1).all()

    # every parameter gets a finite gradient; router and non-router ones alike are actually moved
    for name, grad in live.items():
        assert torch.isfinite(grad).all(), name
    for name in ["lm_head.weight", "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"]:
        assert live[name].abs().sum() > 0, name
    for layer in range(LAYERS):
        for suffix in ["mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.shared_expert.up_proj.weight"]:
            name = f"model.layers.{layer}.{suffix}"
            assert live[name].abs().sum() > 0, name

    # gamma adds no gradient path: detaching the router inputs changes nothing, router weights included
    assert loss == loss_detached
    for name, grad in live.items():
        torch.testing.assert_close(grad, detached[name], rtol=0, atol=0, msg=name)

    # and the router weights' gradient is exactly the one through logp with gamma frozen (float64 reference)
    new_model.zero_grad(set_to_none=True)
    logp, _ = _completion_inputs(new_model, tokens)
    gamma_ref = reference_gamma(new_router, old_router, TOP_K, 0.5)
    reference_loss(reference_scores(logp, old_logp, adv, mask, gamma_ref, CLIP_LOW, CLIP_HIGH)).backward()
    for name, param in new_model.named_parameters():
        torch.testing.assert_close(param.grad, live[name], rtol=1e-4, atol=1e-7, msg=name)
