"""TokenScorer: the one place tokens are scored; top-k sets of the old policy and log-probs at given token ids."""

import pytest
import torch

from gpo.models.scorer import TokenScorer, score_tokens
from gpo.rollout import Rollout
from gpo.testing import tiny_model


def naive(model, ids, mask, width, temperature=1.0):
    """Full float64 log-softmax of the model's own logits at the completion positions, ``[B, T, V]``."""
    from gpo.models.scorer import position_ids

    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    return torch.log_softmax(logits[:, -width - 1 : -1].double() / temperature, -1)


@pytest.fixture(scope="module")
def batch():
    model = tiny_model("llama", seed=3).eval()
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [9, 10, 11, 12, 13, 14, 1]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    return model, ids, mask


@torch.no_grad()
def test_topk_of_each_position_equals_the_full_softmax_topk(batch):
    model, ids, mask = batch
    out = score_tokens(model, ids, mask, 4, temperature=0.7, topk=5)
    ref = naive(model, ids, mask, 4, 0.7).topk(5, dim=-1)
    assert torch.equal(out.topk_ids, ref.indices)
    torch.testing.assert_close(out.topk_logp.double(), ref.values, atol=1e-5, rtol=1e-5)


def test_log_probs_at_given_ids_carry_the_gradient(batch):
    model, ids, mask = batch
    at = torch.randint(0, 90, (2, 4, 3), generator=torch.Generator().manual_seed(0))
    out = score_tokens(model, ids, mask, 4, at_ids=at)
    full = naive(model, ids, mask, 4)
    torch.testing.assert_close(out.topk_logp.double(), full.gather(-1, at), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logp.double(), full.gather(-1, ids[:, -4:, None])[..., 0], atol=1e-5, rtol=1e-5)
    out.topk_logp.sum().backward()
    assert model.lm_head.weight.grad is not None or model.model.embed_tokens.weight.grad is not None
    model.zero_grad()


def test_batched_rollout_scores_equal_one_pass(batch):
    model, ids, mask = batch
    rollout = Rollout(
        ids[:, :3], mask[:, :3], ids[:, 3:], mask[:, 3:], torch.zeros(2, dtype=torch.bool), torch.arange(2)
    )
    scorer = TokenScorer(model, temperature=0.9)
    whole = scorer.rollout_scores(rollout, entropy=True, topk=2)
    split = scorer.rollout_scores(rollout, entropy=True, topk=2, batch_size=1)
    for a, b in zip(whole[:2] + whole[3:], split[:2] + split[3:], strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("training", [False, True])
def test_a_scoring_pass_builds_no_kv_cache(batch, training):
    """Scoring runs the model once over whole sequences: a KV cache would be built layer by layer for nothing."""
    model, ids, mask = batch
    caches = []
    hook = model.model.register_forward_hook(lambda _, args, out: caches.append(out.past_key_values))
    try:
        with torch.set_grad_enabled(training):
            score_tokens(model, ids, mask, 4, entropy=training)
    finally:
        hook.remove()
    assert caches == [None]
