import asyncio
import inspect
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from typing import ClassVar

import pytest
import torch
from aiohttp import web

from gpo.envs import NumberGuess, Step, TaskApp, TaskAppError
from gpo.envs.http import Retries
from gpo.envs.task_app import load_env, make_app
from gpo.rollout import HFEngine, MultiTurnEngine, Sampling
from gpo.testing import char_tokenizer, tiny_model
from tests.envs.servers import Faults, post_json, serve, with_faults
from tests.ports import free_port

FAST = {"timeout_s": 5.0, "attempts": 3, "backoff_s": 0.01}


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return tiny_model("llama", seed=0), char_tokenizer()


def play(model_and_tokenizer, env, *, prompts=2, n=3, **kwargs):
    e = MultiTurnEngine(engine=HFEngine(sampling=Sampling(max_new_tokens=2)), env=env, max_turns=3, **kwargs)
    e.setup(*model_and_tokenizer)
    _, tok = model_and_tokenizer
    return e.generate([tok("guess 1-8:").input_ids] * prompts, n, seed=3)


def open_episodes(url: str, token: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(f"{url}/health", headers=headers), timeout=5) as response:
        return json.loads(response.read())["episodes"]


def test_the_task_app_gives_the_same_rollout_as_the_environment_in_process(model_and_tokenizer):
    local = play(model_and_tokenizer, NumberGuess())
    with serve(make_app(NumberGuess())) as url:
        remote = play(model_and_tokenizer, TaskApp(task_url=url, **FAST))
        assert open_episodes(url) == 0  # every episode closed
    assert torch.equal(remote.completion_ids, local.completion_ids)
    assert torch.equal(remote.loss_mask, local.loss_mask) and remote.fields == local.fields


def test_protocol_example_exchange():
    with serve(make_app(NumberGuess(low=1, high=8))) as url:
        status, created = post_json(f"{url}/episodes", {"seed": 3, "task": "guess 1-8:", "id": "e1"})
        assert (status, created) == (200, {"id": "e1", "observation": ""})
        assert post_json(f"{url}/episodes", {"seed": 3, "task": "guess 1-8:", "id": "e1"})[1] == created  # idempotent
        secret = __import__("random").Random(3).randint(1, 8)
        wrong = 1 if secret != 1 else 2
        status, answer = post_json(f"{url}/episodes/e1/step", {"action": str(wrong), "turn": 0})
        hint = "higher\n" if wrong < secret else "lower\n"
        assert (status, answer) == (200, {"observation": hint, "reward": 0.0, "done": False, "info": {"guess": wrong}})
        assert post_json(f"{url}/episodes/e1/step", {"action": "x", "turn": 0})[1] == answer  # a retry: same answer
        assert post_json(f"{url}/episodes/e1/step", {"action": "1", "turn": 5})[0] == 409  # out of order
        done = post_json(f"{url}/episodes/e1/step", {"action": str(secret), "turn": 1})[1]
        assert done == {"observation": "correct\n", "reward": 1.0, "done": True, "info": {"guess": secret}}
        assert post_json(f"{url}/episodes/e1/step", {"action": "1", "turn": 2})[0] == 409  # after done
        assert post_json(f"{url}/episodes/nope/step", {"action": "1"})[0] == 404
        assert post_json(f"{url}/episodes", {"task": "no seed"})[0] == 400
        request = urllib.request.Request(f"{url}/episodes/e1", method="DELETE")
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.status == 200
        assert open_episodes(url) == 0


def test_turns_are_answered_in_order_once_each_and_a_repeated_create_keeps_the_episode():
    with serve(make_app(NumberGuess(low=1, high=8))) as url:
        secret = __import__("random").Random(3).randint(1, 8)
        wrong = 1 if secret != 1 else 2
        create = {"seed": 3, "task": "t", "id": "e1"}
        post_json(f"{url}/episodes", create)
        assert post_json(f"{url}/episodes/e1/step", {"action": "1", "turn": -1})[0] == 409  # before any turn
        assert post_json(f"{url}/episodes/e1/step", {"action": str(wrong)})[0] == 200  # no turn: the next, turn 0
        assert post_json(f"{url}/episodes", create)[0] == 200  # a retried create: the episode goes on at turn 1
        assert post_json(f"{url}/episodes/e1/step", {"action": str(wrong), "turn": 1})[0] == 200
        assert post_json(f"{url}/episodes/e1/step", {"action": str(wrong), "turn": 0})[0] == 409  # long answered
        status, answer = post_json(f"{url}/episodes/e1/step", {"action": str(secret)})  # no turn: turn 2
        assert status == 200 and answer["done"] is True


class Closes(NumberGuess):
    closed: ClassVar[list] = []

    def close(self) -> None:
        Closes.closed.append(self.secret)


def test_closing_an_episode_closes_its_environment_and_closing_it_again_is_no_error():
    async def open_and_close_twice(url: str) -> None:
        async with TaskApp(task_url=url + "/", **FAST) as app:  # a trailing slash is dropped
            episode, _ = await app.open(3, "t")
            await app.close(episode)
            await app.close(episode)  # the app answers 404: already closed

    with serve(make_app(Closes())) as url:
        asyncio.run(open_and_close_twice(url))
        assert open_episodes(url) == 0
    assert Closes.closed == [__import__("random").Random(3).randint(1, 8)]


def test_a_task_app_outside_async_with_refuses_to_call():
    async def after_exit(app: TaskApp) -> None:
        async with app:
            pass
        await app.open(3, "t")

    with serve(make_app(NumberGuess())) as url, pytest.raises(RuntimeError, match="outside `async with`"):
        asyncio.run(after_exit(TaskApp(task_url=url, **FAST)))


def test_task_app_keeps_its_retry_settings_and_refuses_bad_ones():
    app = TaskApp(task_url="https://h:1", timeout_s=2.0, attempts=None, backoff_s=0.1, max_backoff_s=3.0,
                  retry_max_s=60.0)  # fmt: skip
    assert app.retries == Retries(timeout_s=2.0, attempts=None, backoff_s=0.1, max_backoff_s=3.0, retry_max_s=60.0)
    with pytest.raises(ValueError, match="task_url='ftp://h:1' must be an http:// or https:// URL"):
        TaskApp(task_url="ftp://h:1")
    with pytest.raises(ValueError, match="health_max_wait_s=0 must be > 0"):
        TaskApp(task_url="http://h:1", health_max_wait_s=0)


def test_load_env_builds_an_environment_and_refuses_anything_else():
    env = load_env("gpo.envs.NumberGuess", {"high": 4})
    assert isinstance(env, NumberGuess) and env.high == 4
    with pytest.raises(TypeError, match=r"--env collections\.OrderedDict is not a gpo\.envs\.Environment"):
        load_env("collections.OrderedDict", {})


def test_500s_then_success_are_retried(model_and_tokenizer):
    clean = play(model_and_tokenizer, NumberGuess())
    faults = Faults(where="/episodes", fail_first=2)  # every create, step and close answers 500 twice first
    with serve(with_faults(make_app(NumberGuess()), faults)) as url:
        rollout = play(model_and_tokenizer, TaskApp(task_url=url, **FAST))
        assert open_episodes(url) == 0
    assert torch.equal(rollout.completion_ids, clean.completion_ids) and rollout.fields == clean.fields
    assert faults.count("POST", "/step") == 3 * sum(len(t) for t in clean.fields["turns"])  # each step tried 3 times
    assert faults.count("DELETE", "/episodes") == 3 * 6


def test_with_retry_max_s_instead_of_attempts_a_longer_outage_is_ridden_out(model_and_tokenizer):
    clean = play(model_and_tokenizer, NumberGuess())
    faults = Faults(where="/step", fail_first=6)  # each step fails 6 times: past the default 3 attempts
    with serve(with_faults(make_app(NumberGuess()), faults)) as url:
        with pytest.raises(TaskAppError, match=r"failed after 3 attempt\(s\) in .* raise attempts or set retry_max_s"):
            play(model_and_tokenizer, TaskApp(task_url=url, **FAST))
        faults.seen.clear()
        patient = TaskApp(task_url=url, attempts=None, retry_max_s=30.0, backoff_s=0.01, max_backoff_s=0.05)
        rollout = play(model_and_tokenizer, patient)
    assert rollout.fields == clean.fields
    assert patient.retries.attempts is None and patient.retries.retry_max_s == 30.0


def test_a_step_applied_but_answered_500_is_not_applied_twice(model_and_tokenizer):
    clean = play(model_and_tokenizer, NumberGuess())
    faults = Faults(where="/step", lose_answer=1)  # the app steps, then the answer is lost; the retry must not step
    with serve(with_faults(make_app(NumberGuess()), faults)) as url:
        rollout = play(model_and_tokenizer, TaskApp(task_url=url, **FAST))
    assert rollout.fields == clean.fields


def test_an_app_that_keeps_failing_fails_the_rollout_and_closes_every_episode(model_and_tokenizer):
    faults = Faults(where="/step", fail_first=float("inf"))
    with serve(with_faults(make_app(NumberGuess()), faults)) as url:
        with pytest.raises(TaskAppError) as error:
            play(model_and_tokenizer, TaskApp(task_url=url, **FAST))
        assert open_episodes(url) == 0  # nothing left open on the app
    message = str(error.value)
    assert f"task_url={url}" in message and "failed after 3 attempt(s)" in message and "HTTP 500" in message
    assert faults.count("POST", "/step") == 6 * 3 and faults.count("DELETE", "/episodes") == 6


def test_an_app_that_times_out_fails_after_its_retries(model_and_tokenizer):
    faults = Faults(where="/step", delay_s=2.0)
    with serve(with_faults(make_app(NumberGuess()), faults)) as url:
        started = time.perf_counter()
        with pytest.raises(TaskAppError, match=r"no answer within timeout_s=0.2"):
            play(model_and_tokenizer, TaskApp(task_url=url, timeout_s=0.2, attempts=2, backoff_s=0.01))
        assert time.perf_counter() - started < 1.5  # 2 tries of 0.2 s, not the app's 2 s
        assert open_episodes(url) == 0


def test_a_health_poll_that_hangs_is_given_up_after_timeout_s_and_polled_again():
    asked, release = [], threading.Event()

    async def health(request: web.Request) -> web.Response:
        asked.append(request.path)
        while len(asked) == 1 and not release.is_set():  # the first poll hangs until a second one comes
            await asyncio.sleep(0.02)
        return web.json_response({"status": "ok"})

    async def enter(url: str) -> None:
        async with TaskApp(task_url=url, timeout_s=0.2, attempts=1, health_max_wait_s=3.0):
            pass

    app = web.Application()
    app.router.add_get("/health", health)
    with serve(app) as url:
        try:
            asyncio.run(enter(url))  # the first poll cut after 0.2 s, the second 0.5 s later answered
        finally:
            release.set()
    assert len(asked) == 2


def test_an_app_that_is_down_is_named_after_health_max_wait_s(model_and_tokenizer):
    assert inspect.signature(TaskApp).parameters["health_max_wait_s"].default <= 30
    url = f"http://127.0.0.1:{free_port()}"  # a port nobody listens on
    started = time.monotonic()
    with pytest.raises(
        TaskAppError,
        match=rf"task_url={url} \(is it running.*GET {url}/health did not answer 200 within health_max_wait_s=1.0 s",
    ):
        play(model_and_tokenizer, TaskApp(task_url=url, health_max_wait_s=1.0, **FAST))
    assert 0.5 < time.monotonic() - started < 5.0


class PickyGuess(NumberGuess):
    """Raises ValueError for a task or an action it cannot use at all, as ``Environment.reset`` and ``step`` say."""

    def reset(self, seed: int, task: str) -> str:
        if task == "refuse":
            raise ValueError("this task means nothing here")
        return super().reset(seed, task)

    def step(self, action: str) -> Step:
        if action == "refuse":
            raise ValueError("this action means nothing here")
        return super().step(action)


def test_input_the_app_cannot_use_is_answered_4xx_never_500():
    with serve(make_app(PickyGuess(), max_body_bytes=20_000)) as url:
        status, answer = post_json(f"{url}/episodes", {"seed": 3, "task": "refuse"})
        assert status == 422 and "cannot use this task or seed" in answer["error"]
        assert post_json(f"{url}/episodes", {"seed": 3, "task": "t", "id": "e1"})[0] == 200
        status, answer = post_json(f"{url}/episodes/e1/step", {"action": "refuse", "turn": 0})
        assert status == 422 and "cannot use this action" in answer["error"]
        status, answer = post_json(f"{url}/episodes/e1/step", {"action": "9" * 5000, "turn": 0})
        assert status == 200 and answer["observation"] == "invalid\n"  # beyond int()'s digits: a turn, answered
        assert post_json(f"{url}/episodes/e1/step", {"action": "1", "turn": 0})[0] == 200  # the episode goes on
        refused = {
            "not JSON": (b"{", 400),
            "not a JSON object": (b'[3, "t"]', 400),
            "not UTF-8": (b'{"seed": 3, "task": "\xff"}', 400),
            "nested too deeply to decode": (b"[" * 5000 + b"]" * 5000, 400),
            "a number of 5,000 digits": (b'{"seed": ' + b"9" * 5000 + b', "task": "t"}', 400),
            "a seed that is a boolean": (b'{"seed": true, "task": "t"}', 400),
            "an id that is not a string": (b'{"seed": 3, "task": "t", "id": 7}', 400),
            "above --max-body-bytes": (b'{"seed": 3, "task": "' + b"x" * 30_000 + b'"}', 413),
        }
        for what, (body, expected) in refused.items():
            assert post_json(f"{url}/episodes", raw=body)[0] == expected, what
        assert post_json(f"{url}/episodes/e1/step", {"action": "1", "turn": "1"})[0] == 400  # a turn not a number


class DoneAsText(NumberGuess):
    def step(self, action: str):
        return "higher\n", 0.0, "false", {}


@pytest.mark.parametrize(
    ("env", "action", "says"),
    [
        (PickyGuess(), "refuse", "cannot use this action"),
        # a served environment whose answer is no Step: 422, not a retried 500 that would step the episode again
        (DoneAsText(), "4", "DoneAsText.step returned done='false'"),
    ],
    ids=["refused_action", "answer_not_a_step"],
)
def test_the_client_does_not_retry_a_refusal_and_says_what_was_refused(env, action, says):
    faults = Faults(where="/step")

    async def one_turn(url: str) -> None:
        async with TaskApp(task_url=url, **FAST) as app:
            episode, _ = await app.open(3, "guess 1-8:")
            await app.step(episode, action, 0)

    refused = pytest.raises(TaskAppError, match=rf"refused with HTTP 422 \(not retried.*{re.escape(says)}")
    with serve(with_faults(make_app(env), faults)) as url, refused:
        asyncio.run(one_turn(url))
    assert faults.count("POST", "/step") == 1


class StartsGymStyle(NumberGuess):
    def reset(self, seed: int, task: str):
        return super().reset(seed, task), {}


def test_a_served_first_observation_that_is_not_a_str_is_refused_with_422():
    async def open_one(url: str) -> None:
        async with TaskApp(task_url=url, **FAST) as app:
            await app.open(3, "guess 1-8:")

    says = "StartsGymStyle.reset returned ('"
    with serve(make_app(StartsGymStyle())) as url, pytest.raises(TaskAppError, match=rf"HTTP 422.*{re.escape(says)}"):
        asyncio.run(open_one(url))


def test_with_a_token_the_app_refuses_requests_without_it_and_the_client_sends_it(model_and_tokenizer, monkeypatch):
    monkeypatch.delenv("GPO_TASK_APP_TOKEN", raising=False)
    create = {"seed": 3, "task": "t"}
    with serve(make_app(NumberGuess(), token="s3cret")) as url:
        assert post_json(f"{url}/episodes", create)[0] == 401
        assert post_json(f"{url}/episodes", create, token="wrong")[0] == 401
        assert post_json(f"{url}/episodes", create, token="s3cret")[0] == 200
        started = time.monotonic()
        with pytest.raises(TaskAppError, match=r"/health was refused with HTTP 401.*GPO_TASK_APP_TOKEN"):
            play(model_and_tokenizer, TaskApp(task_url=url, **FAST))
        assert time.monotonic() - started < 5  # at once, not after health_max_wait_s
        play(model_and_tokenizer, TaskApp(task_url=url, token="s3cret", **FAST))
        monkeypatch.setenv("GPO_TASK_APP_TOKEN", "s3cret")
        play(model_and_tokenizer, TaskApp(task_url=url, **FAST))
        assert open_episodes(url, "s3cret") == 1  # only the one created by hand: every played episode closed


def test_max_concurrent_rollouts_bounds_the_requests_in_flight(model_and_tokenizer):
    faults = Faults(where="/episodes", delay_s=0.05)
    with serve(with_faults(make_app(NumberGuess()), faults)) as url:
        play(model_and_tokenizer, TaskApp(task_url=url, **FAST), prompts=4, n=2, max_concurrent_rollouts=3)
    assert faults.max_in_flight == 3


def test_python_m_task_app_takes_its_token_from_the_environment_and_bounds_bodies():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "gpo.envs.task_app", "--port", str(port), "--env-args", '{"high": 4}']
    command += ["--max-body-bytes", "1000"]
    env = {**os.environ, "GPO_TASK_APP_TOKEN": "s3cret"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                assert open_episodes(url, "s3cret") == 0
                break
            except OSError:
                assert process.poll() is None, process.stderr.read().decode()
                assert time.monotonic() < deadline, "the task app did not start within 30 s"
                time.sleep(0.2)
        assert post_json(f"{url}/episodes", {"seed": 1, "task": "t"})[0] == 401
        assert post_json(f"{url}/episodes", {"seed": 1, "task": "t" * 2000}, token="s3cret")[0] == 413
        assert post_json(f"{url}/episodes", {"seed": 1, "task": "t"}, token="s3cret")[0] == 200
    finally:
        process.terminate()
        process.wait(10)
        process.stderr.close()


def answering(created: dict, stepped: dict):
    """An app out of protocol: healthy, answering every create with ``created`` and every step with ``stepped``."""

    async def health(_):
        return web.json_response({"status": "ok", "episodes": 0})

    def fixed(body):
        async def handler(_):
            return web.Response(text=json.dumps(body), content_type="application/json")  # NaN as Python writes it

        return handler

    app = web.Application()
    app.add_routes([web.get("/health", health), web.post("/episodes", fixed(created)),
                    web.post("/episodes/{id}/step", fixed(stepped))])  # fmt: skip
    return app


GOOD_STEP = {"observation": "higher\n", "reward": 0, "done": False}


@pytest.mark.parametrize(
    ("created", "stepped", "message"),
    [
        ({"id": "e", "observation": None}, GOOD_STEP, r"POST /episodes answered .*'observation' must be a string"),
        ({"id": 7, "observation": ""}, GOOD_STEP, r"its field 'id' must be a string, not 7"),
        ({"id": "e", "observation": ""}, {**GOOD_STEP, "done": "false"},
         r"POST /episodes/e/step answered .*its field 'done' must be true or false, not 'false'"),
        ({"id": "e", "observation": ""}, {**GOOD_STEP, "observation": None}, r"'observation' must be a string"),
        ({"id": "e", "observation": ""}, {**GOOD_STEP, "reward": "abc"}, r"'reward' must be a finite number"),
        ({"id": "e", "observation": ""}, {**GOOD_STEP, "reward": float("nan")}, r"'reward' must be a finite number"),
        ({"id": "e", "observation": ""}, {**GOOD_STEP, "reward": True}, r"'reward' must be a finite number, not True"),
        ({"id": "e", "observation": ""}, {**GOOD_STEP, "info": [1]}, r"'info' must be an object"),
        ({"id": "e", "observation": ""}, {**GOOD_STEP, "reward": 10**400}, r"'reward' must be a finite number"),
        ({"id": "e", "observation": ""}, {"observation": "", "reward": 0}, r"expected an object with \('observation'"),
    ],
)  # fmt: skip
def test_an_answer_out_of_protocol_is_refused_naming_the_app_route_and_field(created, stepped, message):
    """Answers are checked, not converted: ``bool("false")`` is True, and would have ended every episode."""

    async def one_step(url: str) -> Step:
        async with TaskApp(task_url=url, **FAST) as app:
            episode, _ = await app.open(3, "guess 1-8:")
            return await app.step(episode, "4", 0)

    with serve(answering(created, stepped)) as url, pytest.raises(TaskAppError, match=message) as refused:
        asyncio.run(one_step(url))
    assert f"task_url={url}" in str(refused.value)
    for info in ({}, None):  # an integer reward is a number; a null info is none
        with serve(answering({"id": "e", "observation": ""}, {**GOOD_STEP, "reward": 1, "info": info})) as url:
            assert asyncio.run(one_step(url)) == Step("higher\n", 1.0, False, {})
