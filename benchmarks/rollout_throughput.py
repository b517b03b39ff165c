"""Rollout tokens/s of the transformers engine (``HFEngine``) and the in-process vLLM engine (``VLLMEngine``) on the
same workload.

Workload (sizes are flags): a tiny random llama built locally by ``gpo.testing.save_tiny_model`` (hidden 256, 4
layers, character vocabulary, float32 in both engines), ``sort_digits`` prompts from ``gpo.tasks``, ``prompts`` x
``n`` completions per call of up to ``max_new_tokens`` tokens at temperature 1 (no top-p/top-k), a new seed per
call. Each engine generates ``warmup`` calls, then ``calls`` measured calls; tokens/s = generated completion tokens
(up to and including EOS) / wall seconds of ``engine.generate``. Both with the sampled tokens' log-probs (what the
trainer reads with ``model.old_logprobs: rollout``; HFEngine pays one extra forward pass for them, vLLM returns
them with the samples) and without.

Run from the repository root (1 torch thread by default, the engine's own thread count on the CPU; keep the other
cores idle while it runs)::

    python benchmarks/rollout_throughput.py
    python benchmarks/rollout_throughput.py --prompts 16 --n 16 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import gpo from this checkout
from gpo.rollout import HFEngine, Sampling
from gpo.rollout.vllm import VLLMEngine
from gpo.tasks import make_task
from gpo.testing import save_tiny_model


def measure(engine, prompt_ids: list[list[int]], n: int, warmup: int, calls: int, logprobs: bool) -> list[float]:
    """Tokens/s of each measured ``generate`` call."""
    rates = []
    for call in range(warmup + calls):
        started = time.perf_counter()
        rollout = engine.generate(prompt_ids, n, seed=call, logprobs=logprobs)
        seconds = time.perf_counter() - started
        if call >= warmup:
            rates.append(float(rollout.completion_mask.sum()) / seconds)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")

    folder = save_tiny_model(Path(tempfile.mkdtemp()) / "llama", hidden_size=args.hidden, num_layers=args.layers)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt_ids = [tokenizer(row["prompt"]).input_ids for row in make_task("sort_digits", args.prompts)]
    sampling = Sampling(temperature=1.0, max_new_tokens=args.max_new_tokens)
    length = max(len(p) for p in prompt_ids) + args.max_new_tokens
    engines = {
        "HFEngine": HFEngine(sampling=sampling),
        "VLLMEngine": VLLMEngine(
            sampling=sampling,
            dtype="float32",
            max_model_len=length,
            kv_cache_memory_bytes=256 << 20,
            enforce_eager=True,
        ),
    }
    load = os.getloadavg()[0]
    rows = []
    for name, engine in engines.items():
        engine.setup(model, tokenizer)
        for logprobs in (True, False):
            rates = measure(engine, prompt_ids, args.n, args.warmup, args.calls, logprobs)
            rows.append((name, logprobs, statistics.mean(rates), statistics.stdev(rates) if len(rates) > 1 else 0.0))
    print("# rollout throughput\n")
    print(f"- machine: {platform.machine()}, nproc {os.cpu_count()}, {platform.platform()}")
    print(f"- versions: Python {platform.python_version()}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, vllm {_vllm_version()}")  # fmt: skip
    print(f"- torch threads: {args.threads} (the vLLM engine runs its calls on 1 thread on the CPU)")
    print(f"- workload: tiny llama hidden {args.hidden}, {args.layers} layers, float32; sort_digits, {args.prompts} "
          f"prompts x {args.n} completions, max_new_tokens {args.max_new_tokens}, temperature 1.0; "
          f"{args.warmup} warm-up + {args.calls} measured calls per row")  # fmt: skip
    print(f"- load average (1 min) before / after: {load:.2f} / {os.getloadavg()[0]:.2f}\n")
    print("| engine | log-probs | tokens/s (mean ± sd) |\n| --- | --- | ---: |")
    for name, logprobs, mean, sd in rows:
        print(f"| {name} | {'yes' if logprobs else 'no'} | {mean:,.0f} ± {sd:,.0f} |")


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


if __name__ == "__main__":
    main()
