"""gpo.envs.http: which statuses are retried, the backoff schedule under each bound, where tokens come from, the
health wait, and the warning of a server that listens beyond loopback without a token."""

import argparse
import asyncio
import itertools
import re
import time

import aiohttp
import pytest
from aiohttp import web

from gpo.envs import http
from gpo.envs.http import (
    Outages,
    Retries,
    ServiceError,
    bearer,
    request_json,
    retried_status,
    service_app,
    service_token,
    token_from,
    wait_healthy,
)
from tests.envs.servers import serve
from tests.ports import free_port


def test_only_what_can_succeed_on_retry_is_retried():
    assert [s for s in (400, 401, 403, 404, 408, 409, 413, 422, 429) if retried_status(s)] == [408, 429]
    assert all(retried_status(s) for s in (500, 502, 503, 504))


def test_backoff_schedule_under_attempts_and_under_a_time_bound():
    # attempts=4: three retries, waiting 0.5, 1, 2 (doubling from backoff_s); then spent
    by_count = Retries(attempts=4, backoff_s=0.5)
    assert [by_count.next_wait(k, 0.0) for k in range(4)] == [0.5, 1.0, 2.0, None]
    # retry_max_s=10, no attempt bound: waits 1, 2, 4, 8 capped at max_backoff_s=3; the last one cut to what is left
    by_time = Retries(attempts=None, backoff_s=1.0, max_backoff_s=3.0, retry_max_s=10.0)
    assert [by_time.next_wait(k, t) for k, t in [(0, 0.0), (1, 1.0), (2, 3.0), (3, 6.0), (4, 9.5), (5, 10.0)]] == [
        1.0, 2.0, 3.0, 3.0, 0.5, None,
    ]  # fmt: skip
    assert Retries(attempts=None, retry_max_s=0.0).next_wait(0, 0.0) is None  # 0: no retry
    with pytest.raises(ValueError, match="retried forever"):
        Retries(attempts=None)


@pytest.mark.parametrize(
    "setting",
    [{"timeout_s": 0.0}, {"attempts": 0}, {"backoff_s": -1.0}, {"max_backoff_s": -1.0}, {"retry_max_s": -1.0}],
)
def test_retry_settings_out_of_range_are_refused(setting):
    with pytest.raises(ValueError, match=f"{next(iter(setting))}="):
        Retries(**setting)


def test_the_waits_of_one_request_end_once_attempts_or_retry_max_s_are_spent(monkeypatch):
    assert list(Retries(attempts=3, backoff_s=0.5).waits()) == [0.5, 1.0]  # 3 tries: 2 retries
    # retry_max_s=3 from the first failure (t=10): at t=10 wait 1; at t=12 wait 2 cut to the 1 s left; at t=13.5 spent
    clock = iter([10.0, 10.0, 12.0, 13.5])
    monkeypatch.setattr(http.time, "monotonic", lambda: next(clock))
    waits = Retries(attempts=None, backoff_s=1.0, retry_max_s=3.0).waits()
    assert list(itertools.islice(waits, 5)) == [1.0, 1.0]


def test_a_token_comes_from_the_setting_else_from_the_environment(monkeypatch):
    monkeypatch.setenv("GPO_TEST_TOKEN", "from-env")
    assert token_from("given", "GPO_TEST_TOKEN") == "given" and token_from(None, "GPO_TEST_TOKEN") == "from-env"
    assert token_from("", "GPO_TEST_TOKEN") is None  # an empty setting is none: not replaced by the variable
    monkeypatch.setenv("GPO_TEST_TOKEN", "")
    assert token_from(None, "GPO_TEST_TOKEN") is None
    assert bearer(None) == {} and bearer("t") == {"Authorization": "Bearer t"}


@pytest.mark.parametrize(
    ("host", "warned"), [("127.0.0.1", False), ("::1", False), ("localhost", False), ("0.0.0.0", True)]
)
def test_a_server_beyond_loopback_without_a_token_warns(host, warned, capsys, monkeypatch):
    monkeypatch.delenv("GPO_TEST_TOKEN", raising=False)
    args = argparse.Namespace(host=host, port=8001, token=None)
    assert service_token(args, "GPO_TEST_TOKEN") is None
    assert ("without a token" in capsys.readouterr().err) == warned
    monkeypatch.setenv("GPO_TEST_TOKEN", "s3cret")
    assert service_token(args, "GPO_TEST_TOKEN") == "s3cret" and capsys.readouterr().err == ""


def health_app(*, unhealthy: int = 0, status: int = 503) -> web.Application:
    """``/health`` answers ``status`` the first ``unhealthy`` times, then 200."""
    asked = []

    async def health(request: web.Request) -> web.Response:
        asked.append(1)
        return web.Response(status=status if len(asked) <= unhealthy else 200)

    app = web.Application()
    app.router.add_get("/health", health)
    return app


def wait(url: str, max_wait_s: float, *, timeout_s: float = 1.0, interval_s: float = 0.05) -> None:
    async def run():
        async with aiohttp.ClientSession() as session:
            await wait_healthy(
                session, url, max_wait_s=max_wait_s, timeout_s=timeout_s, describe="svc", interval_s=interval_s
            )

    asyncio.run(run())


def test_the_health_wait_polls_through_503_and_stops_at_once_on_a_refusal():
    with serve(health_app(unhealthy=5)) as url:
        wait(f"{url}/health", 5.0)  # 503 five times, then 200
    with serve(health_app(unhealthy=100, status=401)) as url:
        started = time.monotonic()
        with pytest.raises(ServiceError, match=r"svc: GET .*/health was refused with HTTP 401"):
            wait(f"{url}/health", 5.0)
        assert time.monotonic() - started < 3.0  # not the 5 s of max_wait_s
    with (
        serve(health_app(unhealthy=1000)) as url,
        pytest.raises(ServiceError, match=r"within health_max_wait_s=0.5 s \(last: HTTP 503"),
    ):
        wait(f"{url}/health", 0.5)


def test_the_health_wait_ends_at_max_wait_s_neither_after_a_pending_poll_nor_after_one_more_interval():
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(1.0)
        return web.Response()

    app = health_app(unhealthy=1000)
    app.router.add_get("/slow", slow)
    with serve(app) as url:
        # a 503, then the next poll (2 s later) would start past the deadline: raised at once
        # a poll that answers after 1 s: cut at the deadline (0.3 s), not after its timeout_s of 5 s
        for path, interval_s in (("health", 2.0), ("slow", 0.05)):
            started = time.monotonic()
            with pytest.raises(ServiceError, match=r"within health_max_wait_s=0.3 s"):
                wait(f"{url}/{path}", 0.3, timeout_s=5.0, interval_s=interval_s)
            assert time.monotonic() - started < 0.9


def test_a_server_refuses_a_body_bound_below_one_byte():
    with pytest.raises(ValueError, match="max_body_bytes=0 must be >= 1"):
        service_app(web.RouteTableDef(), token=None, max_body_bytes=0)


def answers_app(asked: list) -> web.Application:
    """``/bad`` refuses with 400, ``/busy`` answers 503, ``/empty`` answers 200 with no body; records each path."""

    async def handler(request: web.Request) -> web.Response:
        asked.append(request.path)
        status = {"/bad": 400, "/busy": 503, "/empty": 200}[request.path]
        return web.Response(status=status, text="" if status == 200 else '{"error": "no"}')

    app = web.Application()
    app.router.add_post("/{name}", handler)
    return app


def call(url: str, retries: Retries, outages: Outages | None = None):
    async def run():
        async with aiohttp.ClientSession() as session:
            return await request_json(
                session, "POST", url, {}, retries=retries, describe="svc", outages=outages or Outages()
            )

    return asyncio.run(run())


def test_a_request_is_refused_at_once_retried_after_its_backoff_or_answered_none_for_an_empty_body():
    asked = []
    with serve(answers_app(asked)) as url:
        with pytest.raises(ServiceError, match=r"svc: POST .*/bad was refused with HTTP 400 \(not retried"):
            call(f"{url}/bad", Retries(attempts=3, backoff_s=0.01))
        assert asked == ["/bad"]
        started = time.monotonic()
        with pytest.raises(ServiceError, match=r"failed after 3 attempt\(s\).*the last: HTTP 503"):
            call(f"{url}/busy", Retries(attempts=3, backoff_s=0.1))
        assert asked.count("/busy") == 3 and time.monotonic() - started >= 0.3  # waited 0.1, then 0.2
        assert call(f"{url}/empty", Retries()) is None


def test_a_connection_refused_is_retried_then_reported():
    url = f"http://127.0.0.1:{free_port()}/x"  # nobody listens
    with pytest.raises(ServiceError, match=r"failed after 2 attempt\(s\).*the last: connection failed"):
        call(url, Retries(attempts=2, backoff_s=0.01))


def test_the_retry_bound_is_said_with_the_settings_that_set_it():
    assert Retries(attempts=3).bound() == "up to attempts=3 tries"
    assert Retries(attempts=None, retry_max_s=60).bound("model.engine.init_args.") == (
        "up to model.engine.init_args.retry_max_s=60 s"
    )
    assert Retries(attempts=5, retry_max_s=120.5).bound() == "up to attempts=5 tries or retry_max_s=120.5 s"


def outage_messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gpo.envs.http"]


def test_an_outage_is_logged_once_when_it_begins_and_once_when_it_ends(caplog):
    """Three concurrent requests whose first tries all get 503: one warning that the service stopped answering, one
    that it answers again (not one per request); a refusal and a plain answer log nothing."""
    tries = itertools.count()

    async def flaky(request: web.Request) -> web.Response:
        busy = next(tries) < 3
        return web.Response(status=503 if busy else 200, text='{"error": "busy"}' if busy else '{"ok": 1}')

    app = web.Application()
    app.router.add_post("/flaky", flaky)
    outages, retries = Outages(), Retries(attempts=4, backoff_s=0.05)

    async def three(url: str) -> list:
        async with aiohttp.ClientSession() as session:
            asks = [request_json(session, "POST", url, {}, retries=retries, describe="svc at U", outages=outages)
                    for _ in range(3)]  # fmt: skip
            return await asyncio.gather(*asks)

    caplog.set_level("WARNING", logger="gpo.envs.http")
    with serve(app) as url:
        assert asyncio.run(three(f"{url}/flaky")) == [{"ok": 1}] * 3
        began, ended = outage_messages(caplog)
        assert began.startswith(f"svc at U stopped answering (POST {url}/flaky: HTTP 503: ")
        assert began.endswith("retrying up to attempts=4 tries, and training waits meanwhile.")
        assert re.fullmatch(r"svc at U answers again, after 0\.\d s\.", ended)
        asyncio.run(three(f"{url}/flaky"))  # answered at once: no outage
    asked = []
    with serve(answers_app(asked)) as url, pytest.raises(ServiceError):
        call(f"{url}/bad", Retries(attempts=3), outages)
    assert len(outage_messages(caplog)) == 2


def test_a_refusal_ends_an_outage_too(caplog):
    """A 4xx is an answer: the service is up again, although this request is refused."""
    asked, outages = [], Outages()
    caplog.set_level("WARNING", logger="gpo.envs.http")
    with serve(answers_app(asked)) as url:
        with pytest.raises(ServiceError, match="failed after 2 attempt"):
            call(f"{url}/busy", Retries(attempts=2, backoff_s=0.01), outages)
        with pytest.raises(ServiceError, match="refused"):
            call(f"{url}/bad", Retries(attempts=2), outages)
    assert [m.split(" (")[0].split(",")[0] for m in outage_messages(caplog)] == [
        "svc stopped answering",
        "svc answers again",
    ]
