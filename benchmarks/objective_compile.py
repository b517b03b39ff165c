"""Would fusing the objective's small tensor operations pay? Eager against ``torch.compile`` on the quickstart's loss.

The quickstart step runs some 50 small tensor operations in the objective (the GRPO gate, the sequence-mean
aggregator, the entropy bonus and their diagnostics), each paying its Python and dispatch (on a GPU: a kernel
launch). ``torch.compile`` can fuse them into a few kernels. This times one call of ``PolicyObjective`` and its
backward pass on ``[batch, width]`` tensors, the eager objective and the compiled one alternating call by call (the
same inputs for both), after a warm-up that includes the compilation (dynamic shapes, so other widths reuse it).

Run from the repository root::

    python benchmarks/objective_compile.py                  # CPU, 64 x 4 (the quickstart's rollout), 300 calls
    python benchmarks/objective_compile.py --device cuda    # the same on a GPU (timers wait for its queue)
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import gpo from this checkout
from workload import device_clock  # benchmarks/workload.py (the script's folder)

from gpo.algo import EntropyBonus, PolicyObjective, preset

Inputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


def make_inputs(batch: int, width: int, device: torch.device, generator: torch.Generator) -> Inputs:
    """Log-probs and entropy that need gradients, old log-probs near them, advantages, a loss mask with some padding,
    and the minibatch's normaliser (its sequence count)."""

    def draw(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator).to(device)

    logp = (-draw(batch, width).abs()).requires_grad_()
    old = logp.detach() + 0.01 * draw(batch, width)
    mask = (torch.rand(batch, width, generator=generator) > 0.2).float().to(device)
    entropy = draw(batch, width).abs().requires_grad_()
    return logp, old, draw(batch, width), mask, torch.tensor(float(batch), device=device), entropy


def timed_call(objective: Callable, inputs: Inputs, clock: Callable[[], float]) -> float:
    """Seconds for one forward and backward pass of ``objective`` on ``inputs``."""
    logp, old, adv, mask, normaliser, entropy = inputs
    logp.grad = entropy.grad = None
    started = clock()
    loss, _ = objective(logp, old, adv, mask, normaliser, entropy=entropy)
    loss.backward()
    return clock() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="completions (default: 64, the quickstart's 8 x 8)")
    parser.add_argument("--width", type=int, default=4, help="completion tokens (default: 4)")
    parser.add_argument("--calls", type=int, default=300, help="timed calls of each (default: 300)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default: 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    clock = device_clock(device)
    parts = preset("grpo").parts(args.width)
    objective = PolicyObjective(parts.gate, parts.aggregator, entropy=EntropyBonus(coef=0.01))
    variants = {"eager": objective.__call__, "compiled": torch.compile(objective.__call__, dynamic=True)}
    generator = torch.Generator().manual_seed(0)
    warm_up = clock()
    for _ in range(3):
        for call in variants.values():
            timed_call(call, make_inputs(args.batch, args.width, device, generator), clock)
    warm_up_s = clock() - warm_up
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.calls):
        inputs = make_inputs(args.batch, args.width, device, generator)
        for name, call in variants.items():
            times[name].append(timed_call(call, inputs, clock))
    print("# The objective's forward + backward: eager against torch.compile\n")
    print(f"- {platform.machine()}, {platform.platform()}; torch {torch.__version__}; {args.threads} thread(s)")
    print(f"- {args.device}, [{args.batch}, {args.width}] tensors; grpo gate and aggregator, entropy bonus 0.01")
    print(f"- warm-up with the compilation: {warm_up_s:.1f} s; then {args.calls} calls of each, alternating\n")
    print("| objective | median ms | 10th-90th percentile ms |\n| --- | ---: | ---: |")
    for name, seconds in times.items():
        deciles = statistics.quantiles([1e3 * s for s in seconds], n=10)
        print(f"| {name} | {1e3 * statistics.median(seconds):.3f} | {deciles[0]:.3f}-{deciles[-1]:.3f} |")


if __name__ == "__main__":
    main()
