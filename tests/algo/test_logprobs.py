import pytest
import torch

from gpo.algo import linear_token_logprobs, token_logprobs


def naive(logits, tokens, temperature=1.0):
    logp_full = torch.log_softmax(logits.double() / temperature, dim=-1)
    index = tokens if tokens.dim() == logits.dim() else tokens[..., None]
    logp = logp_full.gather(-1, index)
    logp = logp if tokens.dim() == logits.dim() else logp[..., 0]
    entropy = -(logp_full.exp() * logp_full).sum(-1)
    return logp, entropy


@pytest.fixture
def data():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 5, dtype=torch.float64, generator=gen)
    weight = torch.randn(11, 5, dtype=torch.float64, generator=gen)
    bias = torch.randn(11, dtype=torch.float64, generator=gen)
    tokens = torch.randint(0, 11, (2, 7), generator=gen)
    return hidden, weight, bias, tokens


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logits_path_matches_naive_values(data, chunk_size, temperature):
    hidden, weight, _, tokens = data
    logits = hidden @ weight.T
    out = token_logprobs(logits, tokens, temperature=temperature, with_entropy=True, chunk_size=chunk_size)
    ref_logp, ref_entropy = naive(logits, tokens, temperature)
    torch.testing.assert_close(out.logp, ref_logp.float())
    torch.testing.assert_close(out.entropy, ref_entropy.float())
    assert out.logp.shape == tokens.shape and out.entropy.shape == tokens.shape


def test_topk_index_gathers_several_tokens_per_row(data):
    hidden, weight, _, _ = data
    logits = hidden @ weight.T
    top = logits.topk(3, dim=-1).indices  # [2, 7, 3]
    out = token_logprobs(logits, top, chunk_size=5)
    ref, _ = naive(logits, top)
    torch.testing.assert_close(out.logp, ref.float())
    assert out.entropy is None


def test_logits_path_gradcheck_with_entropy(data):
    hidden, weight, _, tokens = data
    logits = (hidden @ weight.T).requires_grad_(True)

    def fn(x):
        out = token_logprobs(x, tokens, temperature=0.8, with_entropy=True, chunk_size=4)
        return out.logp, out.entropy

    # the op returns float32; gradcheck the float64 graph by comparing analytic grads with the naive float64 path
    g_logp, g_ent = torch.randn(2, 7, dtype=torch.float64), torch.randn(2, 7, dtype=torch.float64)
    logp, ent = fn(logits)
    (grad,) = torch.autograd.grad((logp.double() * g_logp).sum() + (ent.double() * g_ent).sum(), logits)
    ref_logp, ref_ent = naive(logits, tokens, 0.8)
    (ref,) = torch.autograd.grad((ref_logp * g_logp).sum() + (ref_ent * g_ent).sum(), logits)
    torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_fused_linear_path_matches_naive_values_and_gradients(data, with_bias, with_entropy):
    hidden, weight, bias, tokens = data
    g = torch.randn(2, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def leaves():
        return [x.clone().requires_grad_(True) for x in ([hidden, weight, bias] if with_bias else [hidden, weight])]

    fused_inputs, naive_inputs = leaves(), leaves()
    out = linear_token_logprobs(
        fused_inputs[0],
        fused_inputs[1],
        tokens,
        bias=fused_inputs[2] if with_bias else None,
        temperature=1.3,
        with_entropy=with_entropy,
        chunk_size=3,
    )
    ref_logp, ref_ent = naive(torch.nn.functional.linear(*naive_inputs), tokens, 1.3)
    torch.testing.assert_close(out.logp, ref_logp.float())
    objective, ref_objective = (out.logp.double() * g).sum(), (ref_logp * g).sum()
    if with_entropy:
        torch.testing.assert_close(out.entropy, ref_ent.float())
        objective = objective + (out.entropy.double() * g.flip(0)).sum()
        ref_objective = ref_objective + (ref_ent * g.flip(0)).sum()
    grads = torch.autograd.grad(objective, fused_inputs)
    ref_grads = torch.autograd.grad(ref_objective, naive_inputs)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fused_linear_path_gradcheck_float64():
    # the kernels compute in float32 by design; gradcheck with a loose tolerance on a tiny, well-scaled problem
    gen = torch.Generator().manual_seed(2)
    h = (torch.randn(3, 4, dtype=torch.float64, generator=gen) * 0.3).requires_grad_(True)
    w = (torch.randn(6, 4, dtype=torch.float64, generator=gen) * 0.3).requires_grad_(True)
    tokens = torch.tensor([1, 5, 0])

    def fn(h, w):
        out = linear_token_logprobs(h, w, tokens, with_entropy=True, chunk_size=2)
        return out.logp.double().sum() + 0.5 * out.entropy.double().sum()

    assert torch.autograd.gradcheck(fn, (h, w), eps=1e-3, atol=2e-3, rtol=2e-3)


def test_bfloat16_logits_are_upcast_per_chunk(data):
    hidden, weight, _, tokens = data
    logits = (hidden @ weight.T).to(torch.bfloat16).requires_grad_(True)
    out = token_logprobs(logits, tokens, chunk_size=3)
    ref, _ = naive(logits.detach(), tokens)
    torch.testing.assert_close(out.logp, ref.float())
    out.logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.all(torch.isfinite(logits.grad.float()))


def test_entropy_of_uniform_distribution_is_log_v():
    logits = torch.zeros(3, 50)
    out = token_logprobs(logits, torch.zeros(3, dtype=torch.long), with_entropy=True)
    torch.testing.assert_close(out.entropy, torch.full((3,), torch.log(torch.tensor(50.0)).item()))
    torch.testing.assert_close(out.logp, torch.full((3,), -torch.log(torch.tensor(50.0)).item()))


def test_temperature_must_be_positive(data):
    hidden, weight, _, tokens = data
    with pytest.raises(ValueError, match="temperature=0"):
        token_logprobs(hidden @ weight.T, tokens, temperature=0)


@pytest.mark.parametrize("chunk_size", [1, 4, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_topk_logprobs_are_the_k_most_likely_tokens_without_the_logits(data, chunk_size, temperature):
    from gpo.algo.logprobs import linear_topk_logprobs, topk_logprobs

    hidden, weight, bias, _ = data
    full = torch.log_softmax((hidden @ weight.T + bias) / temperature, dim=-1)  # float64 reference
    ref = full.topk(4, dim=-1)
    logp, ids = linear_topk_logprobs(hidden, weight, 4, bias=bias, temperature=temperature, chunk_size=chunk_size)
    assert logp.shape == ids.shape == (2, 7, 4) and torch.equal(ids, ref.indices)
    torch.testing.assert_close(logp, ref.values.float())
    logp, ids = topk_logprobs(hidden @ weight.T + bias, 4, temperature=temperature)
    assert torch.equal(ids, ref.indices)
    torch.testing.assert_close(logp, ref.values.float())
    with pytest.raises(ValueError, match="k=12 must be in"):
        linear_topk_logprobs(hidden, weight, 12)
