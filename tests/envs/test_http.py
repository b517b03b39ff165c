"""gpo.envs.http: which statuses are retried, the backoff schedule under each bound, where tokens come from, the
health wait, and the warning of a server that listens beyond loopback without a token."""

import argparse
import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from gpo.envs.http import Retries, ServiceError, retried_status, service_token, token_from, wait_healthy
from tests.envs.servers import serve


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


def test_a_token_comes_from_the_setting_else_from_the_environment(monkeypatch):
    monkeypatch.setenv("GPO_TEST_TOKEN", "from-env")
    assert token_from("given", "GPO_TEST_TOKEN") == "given" and token_from(None, "GPO_TEST_TOKEN") == "from-env"
    monkeypatch.setenv("GPO_TEST_TOKEN", "")
    assert token_from(None, "GPO_TEST_TOKEN") is None


@pytest.mark.parametrize(("host", "warned"), [("127.0.0.1", False), ("::1", False), ("0.0.0.0", True)])
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


def wait(url: str, max_wait_s: float) -> None:
    async def run():
        async with aiohttp.ClientSession() as session:
            await wait_healthy(
                session, f"{url}/health", max_wait_s=max_wait_s, timeout_s=1.0, describe="svc", interval_s=0.05
            )

    asyncio.run(run())


def test_the_health_wait_polls_through_503_and_stops_at_once_on_a_refusal():
    with serve(health_app(unhealthy=5)) as url:
        wait(url, 5.0)  # 503 five times, then 200
    with serve(health_app(unhealthy=100, status=401)) as url:
        started = time.monotonic()
        with pytest.raises(ServiceError, match=r"svc: GET .*/health was refused with HTTP 401"):
            wait(url, 5.0)
        assert time.monotonic() - started < 3.0  # not the 5 s of max_wait_s
    with (
        serve(health_app(unhealthy=1000)) as url,
        pytest.raises(ServiceError, match=r"within health_max_wait_s=0.5 s \(last: HTTP 503"),
    ):
        wait(url, 0.5)
