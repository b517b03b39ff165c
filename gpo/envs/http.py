"""HTTP as gpo's services and clients speak it: which failures are retried and how, the wait for ``/health``, the
shared-secret token (sent by clients, required by the reference servers) and JSON requests with a timeout per try."""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import itertools
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: far above any request of the reference protocols
log = logging.getLogger(__name__)


class ServiceError(RuntimeError):
    """A service (task app, judge, inference server) did not answer usably after its retries, or refused a request."""


def retried_status(status: int) -> bool:
    """Whether the same request may succeed if sent again: 408 (the server timed out), 429 (too many requests) and
    5xx (the server's own fault or overload). Any other 4xx refuses the request itself, and would refuse it again."""
    return status in (408, 429) or status >= 500


@dataclass(frozen=True)
class Retries:
    """When a failed request (connection error, timeout, or a status of ``retried_status``) is tried again.

    Retry ``k`` (0, 1, ...) waits ``min(backoff_s * 2**k, max_backoff_s)``. Retries stop after ``attempts`` tries in
    all, or once ``retry_max_s`` seconds have passed since the first failure (the last retry starts then at the
    latest), whichever comes first; None leaves that bound out.

    Args:
        timeout_s: seconds one try may take, connecting included.
        attempts: tries per request (1: no retry).
        backoff_s: wait before the first retry; doubled for each further one.
        max_backoff_s: longest wait between tries.
        retry_max_s: longest time spent retrying, from the first failure.
    """

    timeout_s: float = 30.0
    attempts: int | None = 3
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    retry_max_s: float | None = None

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0 (seconds one request may take).")
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"attempts={self.attempts} must be >= 1 (tries per request; 1: no retry).")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError(f"backoff_s={self.backoff_s} and max_backoff_s={self.max_backoff_s} must be >= 0.")
        if self.retry_max_s is not None and self.retry_max_s < 0:
            raise ValueError(f"retry_max_s={self.retry_max_s} must be >= 0 (seconds of retrying; 0: no retry).")
        if self.attempts is None and self.retry_max_s is None:
            raise ValueError("Retries needs attempts or retry_max_s: without either a request is retried forever.")

    def next_wait(self, retry: int, failing_for_s: float) -> float | None:
        """Seconds to wait before retry number ``retry`` (0, 1, ...), the first failure ``failing_for_s`` ago; None
        when the retries are spent."""
        if self.attempts is not None and retry + 1 >= self.attempts:
            return None
        wait = min(self.backoff_s * 2**retry, self.max_backoff_s)
        if self.retry_max_s is None:
            return wait
        remaining = self.retry_max_s - failing_for_s
        return min(wait, remaining) if remaining > 0 else None

    def waits(self) -> Iterator[float]:
        """The waits before the retries of one request, from ``next_wait``; the clock starts at the first ``next()``
        (the first failure), and the iterator ends when the retries are spent."""
        started = time.monotonic()
        for retry in itertools.count():
            wait = self.next_wait(retry, time.monotonic() - started)
            if wait is None:
                return
            yield wait

    def bound(self, prefix: str = "") -> str:
        """How long a failing request is retried, its settings named with ``prefix``: 'up to attempts=3 tries',
        'up to model.engine.init_args.retry_max_s=60 s'."""
        bounds = [f"{prefix}attempts={self.attempts} tries"] if self.attempts is not None else []
        bounds += [f"{prefix}retry_max_s={self.retry_max_s:g} s"] if self.retry_max_s is not None else []
        return "up to " + " or ".join(bounds)


class Outages:
    """Puts on the log when a service stops answering and when it answers again, once each per outage, so that a
    step waiting out a service's retries (up to minutes) does not look hung.

    One per client, shared by its concurrent requests: the first request to fail opens the service's outage, the
    first to succeed afterwards closes it. Only single dict operations (atomic in CPython), so no lock: a client
    holding one stays picklable."""

    def __init__(self) -> None:
        self._since: dict[str, tuple[float]] = {}  # service -> (when its outage began,)

    def failing(self, service: str, problem: str, retries: str) -> None:
        """A request to ``service`` failed (``problem``) and is retried (``retries``: for how long)."""
        mark = (time.monotonic(),)  # a new tuple: the request that placed it is the one that opened the outage
        if self._since.setdefault(service, mark) is mark:
            log.warning("%s stopped answering (%s); retrying %s, and training waits meanwhile.", service, problem,
                        retries)  # fmt: skip

    def answered(self, service: str) -> None:
        """A request to ``service`` succeeded: the end of its outage, if it had one."""
        since = self._since.pop(service, None) if self._since else None
        if since is not None:
            log.warning("%s answers again, after %.1f s.", service, time.monotonic() - since[0])


def token_from(setting: str | None, env_var: str) -> str | None:
    """The shared secret to send: ``setting`` when given, else the environment variable ``env_var``; None (or an
    empty string) for none. The variable keeps the secret out of YAML files and saved run configs."""
    token = setting if setting is not None else os.environ.get(env_var)
    return token or None


def bearer(token: str | None) -> dict[str, str]:
    """The ``Authorization`` header carrying ``token`` (none without a token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


async def request_json(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    payload: Any = None,
    *,
    retries: Retries,
    describe: str,
    outages: Outages,
    ok_status: frozenset[int] = frozenset(),
    hints: Mapping[int, str] | None = None,
) -> Any:
    """``method url`` with JSON ``payload``; returns the decoded JSON answer (None for an empty one, or for a status
    in ``ok_status``). Raises ``ServiceError`` starting with ``describe`` (which service, at which URL, what to
    check) and saying what the last try got; ``hints`` adds what to check after a refusal with that status. A try
    that fails and will be retried opens the service's outage in ``outages``, an answer closes it (both logged)."""
    waits, started = retries.waits(), time.monotonic()
    for tries in itertools.count(1):
        try:
            timeout = aiohttp.ClientTimeout(total=retries.timeout_s)
            async with session.request(method, url, json=payload, timeout=timeout) as response:
                status, body = response.status, await response.text()
        except asyncio.TimeoutError:
            last = f"no answer within timeout_s={retries.timeout_s}"
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            last = f"connection failed ({type(exc).__name__}: {exc})"
        else:
            if status in ok_status or not retried_status(status):  # an answer: the service is up
                outages.answered(describe)
            if status in ok_status:
                return None
            if status < 400:
                return _decoded(body, f"{describe}: {method} {url}")
            if not retried_status(status):
                raise ServiceError(
                    f"{describe}: {method} {url} was refused with HTTP {status} (not retried: the same request would "
                    f"be refused again): {body[:500]}{_hint(hints, status)}"
                )
            last = f"HTTP {status}: {body[:200]}"
        wait = next(waits, None)
        if wait is None:
            raise ServiceError(
                f"{describe}: {method} {url} failed after {tries} attempt(s) in {time.monotonic() - started:.1f} s; "
                f"the last: {last}. To ride out a longer outage, raise attempts or set retry_max_s."
            )
        outages.failing(describe, f"{method} {url}: {last}", retries.bound())
        await asyncio.sleep(wait)


def _decoded(body: str, where: str) -> Any:
    try:
        return json.loads(body) if body else None
    except ValueError as exc:
        raise ServiceError(f"{where} answered with something that is not JSON ({exc}): {body[:200]!r}") from exc


def _hint(hints: Mapping[int, str] | None, status: int) -> str:
    hint = (hints or {}).get(status)
    return f". {hint}" if hint else ""


async def wait_healthy(
    session: aiohttp.ClientSession,
    url: str,
    *,
    max_wait_s: float,
    timeout_s: float,
    describe: str,
    interval_s: float = 0.5,
    hints: Mapping[int, str] | None = None,
    up_status: frozenset[int] = frozenset(),
) -> None:
    """Poll ``GET url`` until it answers 200 (or a status of ``up_status``: a server without that route is up too).
    A refusal (a 4xx other than 408/429: a wrong token, say) raises ``ServiceError`` at once; no answer, a connection
    error or a retried status keep polling until ``max_wait_s`` (the client's ``health_max_wait_s``) has passed,
    then raise."""
    deadline, last = time.monotonic() + max_wait_s, "no answer"
    while True:
        remaining = deadline - time.monotonic()
        try:
            timeout = aiohttp.ClientTimeout(total=max(min(timeout_s, remaining), 0.1))
            async with session.get(url, timeout=timeout) as response:
                if response.status == 200 or response.status in up_status:
                    return
                body = await response.text()
                if not retried_status(response.status):
                    raise ServiceError(
                        f"{describe}: GET {url} was refused with HTTP {response.status}: {body[:300]}"
                        f"{_hint(hints, response.status)}"
                    )
                last = f"HTTP {response.status}: {body[:200]}"
        except asyncio.TimeoutError:
            last = "no answer in time"
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            last = f"connection failed ({type(exc).__name__}: {exc})"
        if time.monotonic() + interval_s > deadline:
            raise ServiceError(
                f"{describe}: GET {url} did not answer 200 within health_max_wait_s={max_wait_s} s (last: {last}). "
                "If it is still starting, raise health_max_wait_s."
            )
        await asyncio.sleep(interval_s)


# ---- the reference servers' side ------------------------------------------------------------------------------------


def json_error(status: type[web.HTTPException], message: str, **kwargs) -> web.HTTPException:
    """An HTTP error whose body is ``{"error": message}``."""
    return status(text=json.dumps({"error": message}), content_type="application/json", **kwargs)


async def json_body(request: web.Request) -> Any:
    """The request's body decoded from JSON; a 400 when it is not JSON."""
    try:
        return json.loads(await request.text())
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply to decode
        raise json_error(web.HTTPBadRequest, f"the body is not JSON: {str(exc)[:200]}") from exc


def require_token(token: str) -> Any:
    """aiohttp middleware answering 401 to every request without ``Authorization: Bearer TOKEN`` (compared in
    constant time)."""
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, expected):
            message = "missing or wrong token: send 'Authorization: Bearer TOKEN' with the server's token"
            raise json_error(web.HTTPUnauthorized, message, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check


def service_app(routes: web.RouteTableDef, *, token: str | None, max_body_bytes: int) -> web.Application:
    """An application serving ``routes``: requests need ``token`` when one is given (401 otherwise) and bodies above
    ``max_body_bytes`` are refused (413)."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes={max_body_bytes} must be >= 1 (the largest request body accepted).")
    app = web.Application(client_max_size=max_body_bytes, middlewares=[require_token(token)] if token else [])
    app.add_routes(routes)
    return app


def add_service_arguments(parser: argparse.ArgumentParser, *, port: int, token_env: str) -> None:
    """The command-line flags every reference server takes: where it listens, its token and its body bound."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument(
        "--token",
        default=None,
        help=f"shared secret clients must send as 'Authorization: Bearer TOKEN' (default: ${token_env}; unset: none)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest request body accepted; larger ones are answered 413 (default: {DEFAULT_MAX_BODY_BYTES})",
    )


def service_token(args: argparse.Namespace, token_env: str) -> str | None:
    """The server's token from ``--token`` or ``token_env``; warns on stderr when it listens beyond loopback
    without one."""
    token = token_from(args.token, token_env)
    if token is None and not _is_loopback(args.host):
        print(
            f"warning: listening on {args.host} without a token: anyone who can reach port {args.port} can use this "
            f"server. Set {token_env} (or --token) here and in the clients.",
            file=sys.stderr,
        )
    return token


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def protocol_problem(answer: Any, fields: Mapping[str, tuple[tuple[type, ...], str]]) -> str | None:
    """What is wrong with a service's JSON ``answer`` against ``fields`` (each key: the JSON types it may have,
    checked exactly, so that a JSON ``true`` is no number; and how the protocol describes them; every one required
    but ``info``), or None."""
    required = tuple(key for key in fields if key != "info")
    if not (isinstance(answer, dict) and all(key in answer for key in required)):
        return f"expected an object with {required}"
    for key, (types, described) in fields.items():
        value = answer.get(key)
        if key in answer and (type(value) not in types or (float in types and not _finite(value))):
            return f"its field {key!r} must be {described}, not {value!r:.60}"
    return None


def _finite(number: float) -> bool:
    try:
        return math.isfinite(number)
    except OverflowError:  # an integer past float's range
        return False
