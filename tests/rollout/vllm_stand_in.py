"""A stand-in for ``vllm serve`` that speaks the four routes ``VLLMServerEngine`` uses, for failures a real server
will not show on demand: an API key, a server not yet healthy, a prefix cache that is busy, a slow answer; it runs in
a thread (``serve``) or as a process of its own (``stand_in_process``) that a test can kill outright.

Completions are deterministic: the tokens of sample ``i`` depend on the prompt, the seed and ``i`` only (greedy: on
the prompt only), so the same request gives the same answer on any stand-in.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from aiohttp import web

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


class StandIn:
    """One stand-in server's behaviour and what it saw.

    Args:
        api_key: like ``vllm serve --api-key``: routes under ``/v1`` answer 401 without ``Bearer KEY``.
        healthy_after_s: ``/health`` answers 503 until this long after the app is made.
        busy_resets: the first that many ``/reset_prefix_cache`` answer ``{"success": false}``.
        delay_s: each completion waits this long first.
        max_model_len: a prompt plus ``max_tokens`` longer than this is refused with 400, as vLLM does.
    """

    def __init__(
        self,
        *,
        api_key: str | None = None,
        healthy_after_s: float = 0.0,
        busy_resets: int = 0,
        delay_s: float = 0.0,
        max_model_len: int = 128,
    ) -> None:
        self.api_key, self.busy_resets, self.delay_s, self.max_model_len = api_key, busy_resets, delay_s, max_model_len
        self.healthy_at = time.monotonic() + healthy_after_s
        self.seen: list[tuple[str, dict]] = []  # (path, body) of every POST
        self.authorization: list[str | None] = []  # the Authorization header of every request

    def app(self) -> web.Application:
        routes = web.RouteTableDef()

        @routes.get("/health")
        async def health(request: web.Request) -> web.Response:
            return web.Response(status=200 if time.monotonic() >= self.healthy_at else 503)

        @routes.post("/v1/completions")
        async def completions(request: web.Request) -> web.Response:
            body = await request.json()
            if len(body["prompt"]) + body["max_tokens"] > self.max_model_len:
                message = f"This model's maximum context length is {self.max_model_len} tokens."
                return web.json_response({"error": {"message": message, "code": 400}}, status=400)
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            return web.json_response({"choices": [sample(body, i) for i in range(body["n"])]})

        @routes.post("/collective_rpc")
        async def collective_rpc(request: web.Request) -> web.Response:
            return web.json_response({"results": [None]})

        @routes.post("/reset_prefix_cache")
        async def reset_prefix_cache(request: web.Request) -> web.Response:
            busy = sum(path == "/reset_prefix_cache" for path, _ in self.seen) <= self.busy_resets
            return web.json_response({"success": not busy})

        @web.middleware
        async def record(request: web.Request, handler):
            self.authorization.append(request.headers.get("Authorization"))
            if request.method == "POST":
                self.seen.append((request.path, await request.json()))
            if (
                self.api_key
                and request.path.startswith("/v1")
                and request.headers.get("Authorization") != (f"Bearer {self.api_key}")
            ):
                return web.json_response({"error": "Unauthorized"}, status=401)
            return await handler(request)

        app = web.Application(middlewares=[record])
        app.add_routes(routes)
        return app

    def prompts(self) -> list[list[int]]:
        """The prompts of the completion requests this stand-in answered or refused, in order."""
        return [body["prompt"] for path, body in self.seen if path == "/v1/completions"]

    def paths(self) -> list[str]:
        return [path for path, _ in self.seen]


def sample(body: dict, index: int) -> dict:
    """Sample ``index`` of a completion request: up to ``max_tokens`` ids in [3, 30), ending with the stop token
    when the draw says so; log-probs -0.5 each."""
    greedy = body["temperature"] == 0
    rng = random.Random(f"{body['prompt']}/{None if greedy else body['seed']}/{0 if greedy else index}")
    tokens = [rng.randrange(3, 30) for _ in range(rng.randint(1, body["max_tokens"]))]
    if len(tokens) < body["max_tokens"]:
        tokens.append(body["stop_token_ids"][0])
    logprobs = {"token_logprobs": [-0.5] * len(tokens)} if body["logprobs"] is not None else None
    return {"index": index, "token_ids": tokens, "logprobs": logprobs}


@contextlib.contextmanager
def stand_in_process(port: int | None = None, *, delay_s: float = 0.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """A stand-in in a process of its own on ``port`` (default: a free one); yields (base URL, process) once it
    answers ``/health``. The process is killed afterwards if it still runs."""
    port = port or free_port()
    command = [sys.executable, "-m", "tests.rollout.vllm_stand_in", "--port", str(port), "--delay-s", str(delay_s)]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                assert process.poll() is None, process.stderr.read().decode()
                assert time.monotonic() < deadline, "the stand-in did not start within 30 s"
                time.sleep(0.1)
        yield url, process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)
        process.stderr.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="a stand-in for vllm serve (tests only)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay-s", type=float, default=0.0)
    args = parser.parse_args()
    web.run_app(StandIn(delay_s=args.delay_s).app(), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
