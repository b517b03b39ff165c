"""Seconds per optimiser step of Hugging Face TRL's ``GRPOTrainer`` on the workload of ``step_time.py``.

The same tiny random llama (``gpo.testing.save_tiny_model``, hidden 256, 4 layers, character vocabulary, float32),
the same ``sort_digits`` prompts (``gpo.tasks``), a positional-match reward written inline, 8 prompts x 8
completions per optimiser step (TRL counts completions: ``per_device_train_batch_size`` 64, ``num_generations``
8, no gradient accumulation), ``max_completion_length`` 32, temperature 1 with top-p/top-k off, transformers
``generate`` (no vLLM), ``beta`` 0 (no reference model), ``loss_type="grpo"`` (per-sequence token mean, group
std scaling), one iteration per generation (on-policy: TRL skips the old-log-prob pass), AdamW lr 1e-6 with a
constant schedule and gradient clipping at 1.0, no bf16, no gradient checkpointing, logging, saving and
progress bars off, 1 torch thread.

Measured: wall time from the end of one optimiser step to the end of the next (``TrainerCallback.on_step_end``),
over ``steps`` steps after ``warmup`` steps, split by wrapping the trainer's own methods: rollout
(``_generate``: tokenising, ``generate``, decoding), scoring (``_calculate_rewards``), the rest of
``_generate_and_score_completions`` (advantages, padding) and the rest of the step (loss forward/backward,
optimiser, Trainer loop).

TRL is installed in its own virtual environment so that it cannot change the system packages (torch stays at
2.13.0+cpu; see ``benchmarks/results/trl_compare_cpu.md``). ``gpo.testing`` and ``gpo.tasks`` import only
torch, tokenizers and transformers, so this script builds the model itself. Run from the repository root::

    /tmp/trl-venv/bin/python benchmarks/trl_compare.py
    python benchmarks/step_time.py            # gpo on the same workload, for the side-by-side
    /tmp/trl-venv/bin/python benchmarks/trl_compare.py --preset quickstart --steps 300   # short steps

See ``--help`` for the sizes, steps and threads (the defaults match ``step_time.py``).
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import datasets
import torch
import transformers
import trl
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import gpo from this checkout
from workload import (  # benchmarks/workload.py (the script's folder)
    add_preset_argument,
    add_workload_arguments,
    mean_sd,
    positional_match,
    trl_settings,
)

from gpo.tasks import make_task
from gpo.testing import save_tiny_model


class StepClock(TrainerCallback):
    """Wall time between consecutive optimiser-step ends, and time spent in wrapped trainer methods per step."""

    def __init__(self) -> None:
        self.walls: list[float] = []
        self.parts: list[dict[str, float]] = []
        self.tokens: list[int] = []
        self.current = {"rollout": 0.0, "generate": 0.0, "scoring": 0.0, "generate_and_score": 0.0}
        self.current_tokens = 0
        self.last_end: float | None = None

    def wrap(self, trainer: GRPOTrainer) -> None:
        for method, key in (
            ("_generate", "rollout"),
            ("_generate_single_turn", "generate"),
            ("_calculate_rewards", "scoring"),
            ("_generate_and_score_completions", "generate_and_score"),
        ):
            setattr(trainer, method, self._timed(getattr(trainer, method), key))

    def _timed(self, fn, key):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                self.current[key] += time.perf_counter() - started
            if key == "generate":  # completion token lists, cut after the first EOS (EOS included)
                self.current_tokens += sum(len(ids) for ids in out[0])
            return out

        return wrapper

    def on_train_begin(self, args, state, control, **kwargs):
        self.last_end = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.walls.append(now - self.last_end)
        self.parts.append(self.current)
        self.tokens.append(self.current_tokens)
        self.current = dict.fromkeys(self.current, 0.0)
        self.current_tokens = 0
        self.last_end = time.perf_counter()


def run(args: argparse.Namespace, root: Path) -> StepClock:
    model_path = save_tiny_model(
        root / "model", "llama", seed=0, hidden_size=args.hidden_size, num_layers=args.num_layers
    )
    dataset = datasets.Dataset.from_list(make_task("sort_digits", 4096, seed=0))  # columns: prompt, answer
    config = GRPOConfig(**trl_settings(args, str(root / "out")), logging_strategy="no")
    clock = StepClock()
    trainer = GRPOTrainer(
        model=str(model_path),
        reward_funcs=[positional_match],
        args=config,
        train_dataset=dataset,
        callbacks=[clock],
    )
    trainer.remove_callback(PrinterCallback)  # it prints the end-of-training summary even with logging off
    clock.wrap(trainer)
    trainer.train()
    return clock


def report(clock: StepClock, warmup: int) -> None:
    walls, parts, tokens = clock.walls[warmup:], clock.parts[warmup:], clock.tokens[warmup:]
    column = {key: [p[key] for p in parts] for key in parts[0]}
    inner = zip(column["generate_and_score"], column["rollout"], column["scoring"], strict=True)
    rest_of_scoring = [total - rollout - scoring for total, rollout, scoring in inner]
    training = [w - g for w, g in zip(walls, column["generate_and_score"], strict=True)]
    rows = [
        ("rollout (`_generate`)", column["rollout"]),
        ("- of which `generate` (`_generate_single_turn`)", column["generate"]),
        ("scoring (`_calculate_rewards`)", column["scoring"]),
        ("rest of `_generate_and_score_completions`", rest_of_scoring),
        ("training + Trainer loop (the rest of the step)", training),
        ("**step (wall)**", walls),
    ]
    print("\n## TRL GRPOTrainer, time per optimiser step (mean ± sd over the measured steps)\n")
    print("| phase | TRL s/step |")
    print("| --- | ---: |")
    for name, values in rows:
        print(f"| {name} | {mean_sd(values)} |")
    print(f"\n**TRL: {statistics.mean(walls):.3f} s per optimiser step** (median {statistics.median(walls):.3f} s)")
    print(f"\n- generated tokens per step (up to EOS): {statistics.mean(tokens):.0f}")
    print(f"- rollout tokens/s: {sum(tokens) / sum(column['rollout']):,.0f}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    add_preset_argument(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    logging.getLogger("trl").setLevel(logging.ERROR)
    print("# TRL GRPOTrainer step time\n")
    print(f"- machine: {platform.machine()}, nproc {os.cpu_count()}, {platform.platform()}")
    print(
        f"- versions: Python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, trl {trl.__version__}, datasets {datasets.__version__}"
    )
    print(f"- torch threads: {torch.get_num_threads()}")
    print(
        f"- workload: tiny llama hidden {args.hidden_size}, {args.num_layers} layers, float32; sort_digits, "
        f"{args.prompts_per_step} prompts x {args.group_size} completions, max_completion_length "
        f"{args.max_new_tokens}, temperature 1.0; loss_type grpo, beta 0, 1 optimiser step per generation, AdamW lr "
        f"{args.lr}; {args.warmup} warm-up + {args.steps} measured steps"
    )
    print(f"- load average (1 min) before the run: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        clock = run(args, Path(tmp))
    print(f"- load average (1 min) after the run: {os.getloadavg()[0]:.2f}")
    report(clock, args.warmup)


if __name__ == "__main__":
    main()
