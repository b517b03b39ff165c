"""Real aiohttp servers on loopback for the tests: started in a thread on a free port, stopped after."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web

from gpo.envs.http import bearer


@contextmanager
def serve(app: web.Application) -> Iterator[str]:
    """Run ``app`` on 127.0.0.1 at a free port in a thread of its own; yields its base URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner = web.AppRunner(app)

    async def start() -> int:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner.addresses[0][1]

    port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


class Faults:
    """Middleware that records traffic and injects faults into requests whose path matches ``where``.

    ``fail_first``: each distinct request (method, path, body) answers HTTP 500 that many times before it is served.
    ``lose_answer``: each distinct request is served, but its answer replaced by a 500 that many times (the work is
    done, the client does not know). ``delay_s``: matching requests wait that long first.
    """

    def __init__(self, *, where: str = "", fail_first: float = 0, lose_answer: int = 0, delay_s: float = 0.0) -> None:
        self.where, self.fail_first, self.lose_answer, self.delay_s = where, fail_first, lose_answer, delay_s
        self.seen: Counter = Counter()
        self.requests: list[tuple[str, str]] = []
        self.in_flight = self.max_in_flight = 0

    async def handle(self, request: web.Request, handler):
        self.requests.append((request.method, request.path))  # first: a body refused as too large counts too
        body = await request.text()
        key = (request.method, request.path, body)
        self.seen[key] += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.where not in request.path or request.path == "/health":
                return await handler(request)
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.seen[key] <= self.fail_first:
                return web.json_response({"error": "injected"}, status=500)
            answer = await handler(request)
            if self.seen[key] <= self.lose_answer:
                return web.json_response({"error": "answer lost"}, status=500)
            return answer
        finally:
            self.in_flight -= 1

    def count(self, method: str, fragment: str) -> int:
        return sum(1 for m, path in self.requests if m == method and fragment in path)


def with_faults(app: web.Application, faults: Faults) -> web.Application:
    """``app`` with ``faults`` as its outermost middleware: it sees every request, also those the app's own
    middlewares refuse (a missing token)."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        return await faults.handle(request, handler)

    app.middlewares.insert(0, middleware)
    return app


def post_json(url: str, payload=None, *, raw: bytes | None = None, token: str | None = None) -> tuple[int, dict | str]:
    """A plain blocking POST of ``payload`` as JSON (or of ``raw`` bytes as they are), for protocol checks; the
    status and the answer (decoded JSON, or the text when it is not JSON)."""
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json", **bearer(token)}
    data = raw if raw is not None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data, headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text
