"""What the benchmarks share: the tiny-llama GRPO workload's sizes, arguments and reward, TRL's matching settings,
a mean ± sd and a clock that waits for the GPU. Free of gpo's trainer and of TRL, so both environments import it."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

PRESETS = {  # --preset: the sizes of each workload
    "quickstart": {"hidden_size": 64, "num_layers": 2, "max_new_tokens": 4, "lr": 1e-3},
    "long": {"hidden_size": 256, "num_layers": 4, "max_new_tokens": 32, "lr": 1e-6},
}


def positional_match(prompts, completions, answer, **kwargs) -> list[float]:
    """Fraction of the answer's character positions the stripped completion matches (``gpo.rewards``' formula, here
    for TRL's environment, which cannot import ``gpo.rewards``)."""
    return [
        sum(a == b for a, b in zip(c.strip(), gold, strict=False)) / len(gold)
        for c, gold in zip(completions, answer, strict=True)
    ]


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """Model size, batch, completion budget, learning rate, step counts, threads and seed of the workload."""
    parser.add_argument("--hidden-size", type=int, default=256, help="tiny llama hidden size (default: %(default)s)")
    parser.add_argument("--num-layers", type=int, default=4, help="tiny llama layers (default: %(default)s)")
    parser.add_argument("--prompts-per-step", type=int, default=8, help="prompts per step (default: %(default)s)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="completion budget (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps first (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the run and of sampling (default: %(default)s)")


def add_preset_argument(parser: argparse.ArgumentParser) -> None:
    """``--preset quickstart|long``: that workload's sizes become the defaults, so explicit flags still win."""
    parser.add_argument("--preset", choices=sorted(PRESETS), help="workload sizes (explicit flags still override)")
    first = argparse.ArgumentParser(prog=parser.prog, add_help=False)  # read --preset alone, in any spelling
    first.add_argument("--preset", choices=sorted(PRESETS))
    preset = first.parse_known_args()[0].preset
    if preset is not None:
        parser.set_defaults(**PRESETS[preset])


def mean_sd(values: list[float]) -> str:
    """``"mean ± sd"`` with three decimals."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f}"


def trl_settings(args: argparse.Namespace, output_dir: str) -> dict:
    """TRL ``GRPOConfig`` keyword arguments for this workload, matched to gpo's (``trl_compare_cpu.md`` has the
    setting-by-setting table): CPU float32 without gradient checkpointing, one on-policy optimiser step per
    ``prompts_per_step x group_size`` completions, temperature 1 without top-p/top-k, the grpo loss with group
    scaling and no reference model, a constant learning rate, clipping at 1.0, no saving or progress bars."""
    return dict(
        output_dir=output_dir, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=args.prompts_per_step * args.group_size,  # TRL counts completions
        gradient_accumulation_steps=1, num_generations=args.group_size, max_completion_length=args.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, num_iterations=1, loss_type="grpo", scale_rewards="group",
        learning_rate=args.lr, lr_scheduler_type="constant", max_grad_norm=1.0, max_steps=args.warmup + args.steps,
        seed=args.seed, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip


def device_clock(device: torch.device) -> Callable[[], float]:
    """``time.perf_counter``, read once the work queued on ``device`` is done: a CUDA call returns when its kernels
    are launched, so a host clock alone would time the launches."""
    if device.type == "cpu":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return clock
