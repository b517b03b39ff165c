"""Peak memory and time of the policy log-prob path on CPU: naive log-softmax vs ``gpo.algo.logprobs``.

Each variant computes the log-probabilities of the chosen tokens from the final hidden states ``[B, T, H]`` and
the output-embedding weight ``[V, H]``, sums them into a scalar loss and runs the backward pass (gradients
w.r.t. both hidden and weight):

* ``naive``: ``logits = hidden @ weight.T``, then ``log_softmax(logits.float(), -1).gather(...)``.
* ``lean_logits``: the same logits, then ``gpo.algo.logprobs.token_logprobs(logits, tokens)``.
* ``lean_fused``: ``gpo.algo.logprobs.linear_token_logprobs(hidden, weight, tokens)``, which never holds
  the ``[B, T, V]`` logits.

The ``+entropy`` variants also compute each row's entropy and add its sum to the loss.

Every variant runs in a fresh subprocess (this script re-invoked with ``--worker``), because torch's CPU
allocations are invisible to ``tracemalloc``. The worker reports its peak resident set size
(``ru_maxrss``, kept small in the parent so it is not inherited across ``exec``) and the increment of that
peak over the RSS measured right after the inputs were created. A variant that runs out of memory or is
killed is reported as such.

Run from the repository root::

    python benchmarks/logprob_memory.py --check   # small-size equality of logp, entropy and gradients
    python benchmarks/logprob_memory.py           # B=8, T=1024, V=151,936, H=896, float32, 1 thread

See ``--help`` for the sizes, dtype, threads, chunk size, repeats and the variants to run.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import gpo from this checkout
from gpo.algo.logprobs import TokenLogProbs, linear_token_logprobs, token_logprobs

GIB = 2**30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHECK_SIZES = {"batch": 2, "seq": 16, "vocab": 1000, "hidden": 64}


def naive(hidden: Tensor, weight: Tensor, tokens: Tensor, with_entropy: bool, chunk_size: int | None):
    logits = hidden @ weight.T
    log_probs = torch.log_softmax(logits.float(), -1)
    logp = log_probs.gather(-1, tokens[..., None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None
    return TokenLogProbs(logp, entropy)


def lean_logits(hidden: Tensor, weight: Tensor, tokens: Tensor, with_entropy: bool, chunk_size: int | None):
    logits = hidden @ weight.T
    return token_logprobs(logits, tokens, with_entropy=with_entropy, chunk_size=chunk_size)


def lean_fused(hidden: Tensor, weight: Tensor, tokens: Tensor, with_entropy: bool, chunk_size: int | None):
    return linear_token_logprobs(hidden, weight, tokens, with_entropy=with_entropy, chunk_size=chunk_size)


PATHS = {"naive": naive, "lean_logits": lean_logits, "lean_fused": lean_fused}
VARIANTS = [*PATHS, *(f"{name}+entropy" for name in PATHS)]


def run_variant(variant: str, hidden: Tensor, weight: Tensor, tokens: Tensor, chunk_size: int | None) -> TokenLogProbs:
    """Forward and backward of one variant; gradients land in ``hidden.grad`` and ``weight.grad``."""
    name, _, entropy_suffix = variant.partition("+")
    out = PATHS[name](hidden, weight, tokens, bool(entropy_suffix), chunk_size)
    loss = out.logp.sum()
    if out.entropy is not None:
        loss = loss + out.entropy.sum()
    loss.backward()
    return out


def make_inputs(batch: int, seq: int, vocab: int, hidden: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Hidden states ``[B, T, H]`` and weight ``[V, H]`` (both requiring grad, logits of unit scale), tokens."""
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(batch, seq, hidden, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden, generator=generator) * hidden**-0.5).to(dtype).requires_grad_()
    tokens = torch.randint(vocab, (batch, seq), generator=generator)
    return states, weight, tokens


def worker(args: argparse.Namespace) -> None:
    """Measure one variant in this (fresh) process and print the result as one JSON line."""
    (variant,) = args.variants
    hidden, weight, tokens = make_inputs(args.batch, args.seq, args.vocab, args.hidden, DTYPES[args.dtype])
    inputs_rss = psutil.Process().memory_info().rss
    times = []
    for _ in range(args.repeats):
        hidden.grad = weight.grad = None
        start = time.perf_counter()
        run_variant(variant, hidden, weight, tokens, args.chunk_size)
        times.append(time.perf_counter() - start)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"inputs_rss": inputs_rss, "peak_rss": peak_rss, "time": min(times)}))


def spawn_worker(variant: str, args: argparse.Namespace) -> dict:
    """Run ``worker`` for one variant in a subprocess; on failure return ``{"error": ...}``."""
    command = [sys.executable, __file__, "--worker", "--variants", variant]
    for flag in ("batch", "seq", "vocab", "hidden", "dtype", "threads", "repeats", "chunk_size"):
        value = getattr(args, flag)
        if value is not None:
            command += [f"--{flag.replace('_', '-')}", str(value)]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode == 0:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    if proc.returncode == -9:
        return {"error": "killed by SIGKILL (out of memory)"}
    print(f"--- {variant} failed (exit {proc.returncode}); stderr:\n{proc.stderr}", file=sys.stderr)
    last_line = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit code {proc.returncode}"
    return {"error": "out of memory" if "allocate memory" in last_line else f"failed: {last_line}"}


def benchmark(args: argparse.Namespace) -> None:
    print(
        f"B={args.batch} T={args.seq} V={args.vocab} H={args.hidden} dtype={args.dtype} threads={args.threads} "
        f"chunk_size={args.chunk_size or 'default'} repeats={args.repeats}"
    )
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {psutil.cpu_count()} CPUs")
    print(f"[B*T, V] logits in float32: {args.batch * args.seq * args.vocab * 4 / GIB:.2f} GiB\n")
    results = {}
    for variant in args.variants:
        results[variant] = spawn_worker(variant, args)
        print(f"{variant}: {results[variant]}", file=sys.stderr, flush=True)

    print("| variant | peak RSS (GiB) | increment over inputs (GiB) | fwd+bwd time (s) | increment / naive |")
    print("|---|---:|---:|---:|---:|")
    for variant, result in results.items():
        if "error" in result:
            print(f"| {variant} | {result['error']} | | | |")
            continue
        increment = result["peak_rss"] - result["inputs_rss"]
        _, plus, suffix = variant.partition("+")
        naive_result = results.get(f"naive{plus}{suffix}", {})
        ratio = (
            f"{increment / (naive_result['peak_rss'] - naive_result['inputs_rss']):.3f}"
            if "peak_rss" in naive_result
            else "n/a"
        )
        print(
            f"| {variant} | {result['peak_rss'] / GIB:.2f} | {increment / GIB:.2f} | {result['time']:.2f} | {ratio} |"
        )
    inputs = next((r["inputs_rss"] for r in results.values() if "inputs_rss" in r), None)
    if inputs is not None:
        print(f"\nRSS right after creating the inputs (torch imported, hidden, weight, tokens): {inputs / GIB:.2f} GiB")


def check(args: argparse.Namespace) -> bool:
    """Every variant gives the naive path's logp, entropy and gradients at a small size, in ``args.dtype``."""
    print(f"check at {CHECK_SIZES}, dtype={args.dtype}, threads={args.threads}, chunk_size in (default, 5)")
    tolerances = {"rtol": 1e-4, "atol": 1e-5} if args.dtype == "float32" else {"rtol": 2e-2, "atol": 2e-2}
    ok = True
    for with_entropy in (False, True):
        reference = None
        for name in PATHS:
            for chunk_size in (None, 5) if name != "naive" else (None,):
                variant = f"{name}+entropy" if with_entropy else name
                hidden, weight, tokens = make_inputs(**CHECK_SIZES, dtype=DTYPES[args.dtype])
                out = run_variant(variant, hidden, weight, tokens, chunk_size)
                values = {
                    "logp": out.logp,
                    "entropy": out.entropy,
                    "grad hidden": hidden.grad,
                    "grad weight": weight.grad,
                }
                values = {key: value.detach().float() for key, value in values.items() if value is not None}
                if reference is None:
                    reference = values
                diffs = {key: (value - reference[key]).abs().max().item() for key, value in values.items()}
                same = all(torch.allclose(value, reference[key], **tolerances) for key, value in values.items())
                ok &= same
                details = ", ".join(f"{key} {diff:.1e}" for key, diff in diffs.items())
                verdict = "OK" if same else "MISMATCH"
                print(f"  {variant:<20} chunk_size={chunk_size!s:<4} max |diff| vs naive: {details}  {verdict}")
    print("all variants match" if ok else "MISMATCH")
    return ok


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", "-B", type=int, default=8)
    parser.add_argument("--seq", "-T", type=int, default=1024)
    parser.add_argument("--vocab", "-V", type=int, default=151_936, help="default: the Qwen2 vocabulary")
    parser.add_argument("--hidden", "-H", type=int, default=896, help="default: Qwen2.5-0.5B")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="of hidden, weight and logits")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default: %(default)s)")
    parser.add_argument("--chunk-size", type=int, default=None, help="rows per chunk of the lean paths")
    parser.add_argument("--repeats", type=int, default=1, help="report the minimum time over this many runs")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=VARIANTS,
        metavar="VARIANT",
        help=f"any of {', '.join(VARIANTS)} (default: all)",
    )
    parser.add_argument("--check", action="store_true", help="only check that the variants agree, at a small size")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.worker:
        worker(args)
    elif args.check:
        sys.exit(0 if check(args) else 1)
    else:
        benchmark(args)


if __name__ == "__main__":
    main()
