"""HTTP client of running vLLM OpenAI-compatible servers: health checks, retried POSTs, calls spread over servers."""

from __future__ import annotations

import http.client
import itertools
import json
import logging
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import ExitStack
from functools import partial
from typing import Any, TypeVar

from gpo.envs.http import Outages, Retries, ServiceError, bearer, retried_status, token_from

API_KEY_ENV = "VLLM_API_KEY"  # also the variable vLLM's server reads for its own --api-key
DEV_ROUTES = ("/collective_rpc", "/reset_prefix_cache")
T = TypeVar("T")
#: A call on the servers still waiting after this long is said in a warning (request_timeout_s defaults to 600 s).
UNANSWERED_WARNING_S = 60.0
log = logging.getLogger(__name__)


class VLLMServerError(ServiceError):
    """A vLLM server failed after the retries, refused a request, or answered out of protocol."""


class VLLMServers:
    """One or more vLLM OpenAI-compatible servers, reached over HTTP.

    ``VLLMServerEngine`` samples from them, ``ServerTeacher`` scores with them.

    Failures: connection errors, timeouts and HTTP 408/429/5xx are retried with exponential backoff (from
    ``retry_backoff_s``, doubled up to 8 s) for at most ``retry_max_s`` after the first failure; then
    ``VLLMServerError`` names the server, the route, the first and last failure and what to check. Once one of a
    server's calls has given up, its other calls fail at once. Other 4xx answers are not retried: the error says
    what was refused. ``api_key`` (or the environment variable ``VLLM_API_KEY``) is sent as a bearer token.

    Args:
        base_url: the server's address, e.g. ``http://127.0.0.1:8000``, or a list of addresses.
        where: where these settings sit in a run's YAML (``model.engine.init_args``), named in messages.
        api_key: the servers' ``--api-key``; None: the environment variable ``VLLM_API_KEY`` if set, else none.
        health_max_wait_s: longest wait for every server's ``/health`` in ``wait_until_healthy``.
        health_interval_ms: pause between health checks.
        request_timeout_s: longest wait for one HTTP answer.
        retry_max_s: longest time a failing request is retried, from its first failure (0: no retry).
        retry_backoff_s: wait before the first retry; doubled for each further one, up to 8 s.
        max_concurrent_requests: requests in flight at once, per server.
        weights_dir: the folder weight reloads read, named when a reload fails.
    """

    def __init__(
        self,
        base_url: str | list[str],
        *,
        where: str,
        api_key: str | None,
        health_max_wait_s: float,
        health_interval_ms: int,
        request_timeout_s: float,
        retry_max_s: float,
        retry_backoff_s: float,
        max_concurrent_requests: int,
        weights_dir: str | None = None,
    ) -> None:
        for name, value in (
            ("health_max_wait_s", health_max_wait_s),
            ("health_interval_ms", health_interval_ms),
            ("request_timeout_s", request_timeout_s),
            ("max_concurrent_requests", max_concurrent_requests),
        ):
            if not value > 0:
                raise ValueError(f"{where}.{name}={value} must be > 0.")
        for name, value in (("retry_max_s", retry_max_s), ("retry_backoff_s", retry_backoff_s)):
            if not value >= 0:
                raise ValueError(f"{where}.{name}={value} must be >= 0 (seconds).")
        self.urls, self.where, self.weights_dir = _server_urls(base_url, where), where, weights_dir
        self.api_key = token_from(api_key, API_KEY_ENV)
        self.health_max_wait_s, self.health_interval_ms = health_max_wait_s, health_interval_ms
        self.max_concurrent_requests = max_concurrent_requests
        self.retries = Retries(
            timeout_s=request_timeout_s, attempts=None, backoff_s=retry_backoff_s, retry_max_s=retry_max_s
        )
        self.outages = Outages()

    def spread(self, count: int) -> list[str]:
        """The server of each of ``count`` requests: request ``i`` goes to server ``i mod S``, so the work is spread
        evenly and a run that sends the same requests sends each to the same server."""
        return [self.urls[i % len(self.urls)] for i in range(count)]

    def wait_until_healthy(self) -> None:
        """Poll every server's ``GET /health`` until each has answered 200; TimeoutError naming those that did not
        after ``health_max_wait_s``. A 404 is final (no waiting makes a missing route appear): VLLMServerError."""
        deadline = time.monotonic() + self.health_max_wait_s
        waiting = {url: "no answer" for url in self.urls}
        while True:
            for url in list(waiting):
                problem = self._health_problem(url, deadline)
                if problem is None:
                    del waiting[url]
                else:
                    waiting[url] = problem
            if not waiting:
                return
            pause = self.health_interval_ms / 1000
            if time.monotonic() + pause > deadline:
                servers = "; ".join(f"{url} (last: {problem})" for url, problem in waiting.items())
                raise TimeoutError(
                    f"vLLM server(s) in {self.where}.base_url did not answer GET /health with 200 within "
                    f"{self.where}.health_max_wait_s={self.health_max_wait_s} s: {servers}. Is each one running, and "
                    "reachable from this machine (host, port, firewall)? A server still loading its model needs "
                    "longer (a large model can take minutes): raise health_max_wait_s."
                )
            time.sleep(pause)

    def _health_problem(self, url: str, deadline: float) -> str | None:
        """None when ``url`` answers ``GET /health`` with 200, else what it did; VLLMServerError on a 404."""
        timeout = max(min(deadline - time.monotonic(), 5.0), 0.1)
        request = urllib.request.Request(f"{url}/health", headers=bearer(self.api_key))
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return None if response.status == 200 else f"HTTP {response.status}"
        except urllib.error.HTTPError as error:
            if error.code == 404:  # final: no waiting makes a missing route appear
                raise VLLMServerError(
                    f"{url} answered GET /health with HTTP 404: it is not the root of a vLLM OpenAI-compatible "
                    f"server. Set {self.where}.base_url to the server's root, e.g. http://127.0.0.1:8000 (no /v1)."
                ) from error
            return f"HTTP {error.code}"
        except (urllib.error.URLError, http.client.HTTPException, OSError) as error:
            return _connection_problem(error)

    def _say_if_unanswered(self, futures: list[Future], servers: list[str]) -> None:
        """Wait for ``futures``; if some are still running after ``UNANSWERED_WARNING_S``, say which servers they wait
        on, once: a server whose engine died behind an open HTTP front answers nothing until ``request_timeout_s``."""
        _, running = wait(futures, timeout=UNANSWERED_WARNING_S)
        if running:
            waiting = sorted({server for future, server in zip(futures, servers, strict=True) if future in running})
            log.warning(
                f"{len(running)} requests to {', '.join(waiting)} unanswered after {UNANSWERED_WARNING_S:g} s; "
                f"training waits until they answer or {self.where}.request_timeout_s={self.retries.timeout_s} s "
                "ends them. A server whose engine stopped may still hold its connections open: check its log."
            )

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """The log-prob of each token of each sequence after its first, given the tokens before it, under the
        servers' weights at temperature 1: ``POST /v1/completions`` with the sequence as the prompt,
        ``prompt_logprobs: 0`` and ``max_tokens: 1`` (the one sampled token is ignored); sequence ``i`` goes to
        server ``i mod S``, as in ``generate``."""
        servers = self.spread(len(sequences))
        scoring = {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        calls = [
            (server, partial(self.post, server, "/v1/completions", {"prompt": list(ids), **scoring}))
            for server, ids in zip(servers, sequences, strict=True)
        ]
        answers = self.on_servers(calls)
        return [_scored_prompt(server, ids, a) for server, ids, a in zip(servers, sequences, answers, strict=True)]

    def on_servers(self, calls: list[tuple[str, Callable[[], T]]]) -> list[T]:
        """Run each ``(server, call)`` concurrently, at most ``max_concurrent_requests`` at once per server; the
        results in order. Once one of a server's calls has given up, its other calls fail at once; the error names
        every server that failed."""
        failed: dict[str, VLLMServerError] = {}

        def run(server: str, call: Callable[[], T]) -> T:
            if server in failed:
                raise VLLMServerError(f"vLLM server {server} gave up earlier in this call")
            try:
                return call()
            except VLLMServerError as error:
                failed.setdefault(server, error)
                raise

        with ExitStack() as stack:
            pools = {
                server: stack.enter_context(ThreadPoolExecutor(max_workers=min(count, self.max_concurrent_requests)))
                for server, count in Counter(server for server, _ in calls).items()
            }
            futures = [pools[server].submit(run, server, call) for server, call in calls]
            self._say_if_unanswered(futures, [server for server, _ in calls])
        for future in futures:  # an error that is not a server's (a bug) goes up as it is
            error = future.exception()
            if error is not None and not isinstance(error, VLLMServerError):
                raise error
        if len(failed) == 1:
            raise next(iter(failed.values()))
        if failed:
            messages = "\n".join(f"- {error}" for error in failed.values())
            raise VLLMServerError(f"{len(failed)} of {len(self.urls)} vLLM servers failed:\n{messages}")
        return [future.result() for future in futures]

    def on_every_server(self, call: Callable[[str], T]) -> list[T]:
        """``call(url)`` for every server, concurrently (as ``on_servers``)."""
        return self.on_servers([(url, partial(call, url)) for url in self.urls])

    def post(self, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """``POST url+path`` with a JSON body; the JSON answer. Retried as the class docstring says."""
        request = urllib.request.Request(
            f"{url}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **bearer(self.api_key)},
            method="POST",
        )
        waits, first, failing_since, service = self.retries.waits(), None, 0.0, f"vLLM server {url}"
        for tries in itertools.count(1):
            try:
                with urllib.request.urlopen(request, timeout=self.retries.timeout_s) as response:
                    answer = response.read()
                self.outages.answered(service)
                return _decoded(answer, url, path)
            except urllib.error.HTTPError as error:
                detail = _error_detail(error)
                if not retried_status(error.code):
                    self.outages.answered(service)
                    raise VLLMServerError(self._refused(url, path, error.code, detail, body)) from error
                problem = f"HTTP {error.code}: {detail}"
            except (urllib.error.URLError, http.client.HTTPException, OSError) as error:
                problem = _connection_problem(error, f"{self.where}.request_timeout_s={self.retries.timeout_s} s")
            if first is None:
                first, failing_since = problem, time.monotonic()
            wait = next(waits, None)
            if wait is None:
                raise VLLMServerError(self._gave_up(url, path, first, problem, tries, time.monotonic() - failing_since))
            self.outages.failing(service, f"POST {path}: {problem}", self.retries.bound(f"{self.where}."))
            time.sleep(wait)

    def _gave_up(self, url: str, path: str, first: str, last: str, tries: int, seconds: float) -> str:
        reads = (
            f" and that it can read {self.where}.weights_dir={self.weights_dir}" if path == "/collective_rpc" else ""
        )
        return (
            f"vLLM server {url} failed: POST {path} got no usable answer in {tries} tries over {seconds:.1f} s "
            f"(retried for at most {self.where}.retry_max_s={self.retries.retry_max_s} s); first: {first}; "
            f"last: {last}. Check that the server is still running (its log says why it stopped: a crash, out of "
            f"memory, killed) and reachable from this machine{reads}; to wait out a server restart, raise "
            f"{self.where}.retry_max_s."
        )

    def _refused(self, url: str, path: str, status: int, detail: str, body: dict[str, Any]) -> str:
        hint = ""
        if status in (401, 403):
            hint = f" Give the servers' --api-key as {self.where}.api_key or the environment variable {API_KEY_ENV}."
        elif status == 404 and path in DEV_ROUTES:
            hint = " Start the server with VLLM_SERVER_DEV_MODE=1 in its environment for this route."
        elif status == 404:
            hint = f" Is {url} a vLLM OpenAI-compatible server (the address in {self.where}.base_url)?"
        elif path == "/v1/completions":
            hint = (
                f" The request had {len(body['prompt'])} prompt tokens and max_tokens={body['max_tokens']}: a "
                "prompt plus completion longer than the server's --max-model-len is refused."
            )
        return f"vLLM server {url} refused POST {path} with HTTP {status} (not retried): {detail}.{hint}"


def _server_urls(base_url: str | list[str], where: str) -> list[str]:
    urls = [base_url] if isinstance(base_url, str) else list(base_url)
    if not urls:
        raise ValueError(f"{where}.base_url is an empty list; give at least one server, e.g. http://127.0.0.1:8000.")
    for url in urls:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(
                f"{where}.base_url={url!r} must be an http:// or https:// URL, e.g. http://127.0.0.1:8000."
            )
    urls = [url.rstrip("/") for url in urls]
    if len(set(urls)) != len(urls):
        raise ValueError(f"{where}.base_url={urls} names a server twice; list each server once.")
    return urls


def _decoded(text: bytes, url: str, path: str) -> dict[str, Any]:
    try:
        return json.loads(text) if text else {}
    except ValueError as error:
        raise VLLMServerError(
            f"vLLM server {url} answered POST {path} with something that is not JSON: {text[:200]!r}"
        ) from error


def _scored_prompt(url: str, ids: list[int], answer: dict[str, Any]) -> list[float]:
    """The log-probs of ``ids[1:]`` in a ``prompt_logprobs`` answer (a list over the prompt's positions of
    ``{token id: {"logprob": ...}}``, None at the first)."""
    try:
        entries = answer["choices"][0]["prompt_logprobs"]
        return [float(entries[t][str(token)]["logprob"]) for t, token in enumerate(ids) if t > 0]
    except (KeyError, IndexError, TypeError) as error:
        raise VLLMServerError(
            f"vLLM server {url} answered POST /v1/completions without the prompt log-probs of the sent tokens "
            f"({type(error).__name__}: {error}): {str(answer)[:300]}. Is it a vLLM OpenAI-compatible server (gpo is "
            "tested with vLLM 0.32, which takes prompt_logprobs)?"
        ) from error


def _error_detail(error: urllib.error.HTTPError) -> str:
    try:
        return error.read().decode(errors="replace")[:500]
    except (http.client.HTTPException, OSError):
        return "(the body could not be read)"


def _connection_problem(error: BaseException, timeout: str | None = None) -> str:
    """What a failed connection was, in a few words: 'ConnectionResetError: [Errno 104] Connection reset by peer'."""
    reason = error.reason if isinstance(error, urllib.error.URLError) else error
    if isinstance(reason, TimeoutError) and timeout is not None:
        return f"no answer within {timeout}"
    return f"{type(reason).__name__}: {reason}"
