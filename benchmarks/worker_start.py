"""How long the pipelined ``HFEngine`` worker takes to start: from the first ``generate`` call to its rollout.

``ProcessEngine`` forks its worker from a server process (Python's ``forkserver`` start method) that starts when the
engine is set up and imports gpo's worker and ``HFEngine`` modules (torch and transformers with them) in the
background; each worker imports the policy's model class itself. Each round here
builds a ``ProcessEngine`` over ``HFEngine``, sets it up on a tiny random llama, waits ``--setup-s`` seconds (standing
for the trainer's own set-up between ``setup`` and the first rollout), then times its first ``generate`` (the worker
starts, copies nothing, samples 2 completions of 4 tokens) and closes it. The first round pays for the server's
imports, less whatever overlapped the wait; later rounds of the same process fork from the running server (a
notebook's second ``fit``, a test suite). For comparison, the same number of processes are started with ``spawn``
(each imports those modules afresh, as a spawned worker would before it could serve) and timed until they have.

Run from the repository root, nothing else busy::

    python benchmarks/worker_start.py --rounds 3
"""

from __future__ import annotations

import argparse
import importlib
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import gpo from this checkout
from gpo.rollout.base import Sampling
from gpo.rollout.hf import HFEngine
from gpo.rollout.worker import ProcessEngine
from gpo.testing import save_tiny_model


def forkserver_starts(policy, tokenizer, rounds: int, setup_s: float) -> list[float]:
    """Seconds from the first ``generate`` of a freshly set-up ``ProcessEngine`` to its rollout, per round."""
    seconds = []
    for _ in range(rounds):
        engine = ProcessEngine(HFEngine(sampling=Sampling(max_new_tokens=4)))
        engine.setup(policy, tokenizer)
        time.sleep(setup_s)
        started = time.perf_counter()
        try:
            engine.generate([[5, 6, 7]], 2, seed=0, logprobs=False)
            seconds.append(time.perf_counter() - started)
        finally:
            engine.close()
    return seconds


def import_modules(modules: list[str]) -> None:
    for name in modules:
        importlib.import_module(name)


def spawn_starts(modules: list[str], rounds: int) -> list[float]:
    """Seconds for a spawned process to import ``modules`` and exit, per round."""
    context = torch.multiprocessing.get_context("spawn")
    seconds = []
    for _ in range(rounds):
        started = time.perf_counter()
        process = context.Process(target=import_modules, args=(modules,))
        process.start()
        process.join()
        seconds.append(time.perf_counter() - started)
    return seconds


def describe(seconds: list[float]) -> str:
    return f"{statistics.median(seconds):.3f} ({min(seconds):.3f}-{max(seconds):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="workers started per side")
    parser.add_argument("--setup-s", type=float, default=1.0, help="seconds between setup and the first generate")
    args = parser.parse_args()
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    print(f"- machine: {platform.machine()}, {platform.platform()}; Python {platform.python_version()}")
    print(f"- {args.rounds} rounds a side, {args.setup_s} s between setup and the first generate\n")
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        save_tiny_model(model, "llama", seed=0)
        policy, tokenizer = AutoModelForCausalLM.from_pretrained(model), AutoTokenizer.from_pretrained(model)
        forked = forkserver_starts(policy, tokenizer, args.rounds, args.setup_s)
        modules = ["gpo.rollout.worker", "gpo.rollout.hf", type(policy).__module__]
        spawned = spawn_starts(modules, args.rounds)
    print("| worker | first round, s | later rounds, s (median, min-max) |")
    print("| --- | ---: | ---: |")
    print(f"| forked from the server | {forked[0]:.3f} | {describe(forked[1:]) if len(forked) > 1 else '-'} |")
    print(f"| spawned, imports only | {spawned[0]:.3f} | {describe(spawned[1:]) if len(spawned) > 1 else '-'} |")


if __name__ == "__main__":
    main()
