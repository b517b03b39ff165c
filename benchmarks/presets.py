"""The algorithm presets compared where they differ: several optimiser updates per rollout, so the ratio leaves 1.

With one update per rollout (the quickstart) every ratio gate sees ``pi / pi_old = 1`` and the presets differ only in
their advantages and aggregation; here each rollout batch is split into ``--number-of-minibatches`` and trained for
``--ppo-epochs`` passes, against the sampler's log-probs (``--old-logprobs rollout``), so from the second update on the
gates clip, mask or reweight. Each preset is the algorithm its shipped config selects, with that config's values
(``configs/<name>.yaml``, what ``gpo fit --config <name>`` trains with; only ``model.algorithm`` is read: DAPO's
overlong filter, for one, is left out). The workload is the step-time benchmark's quickstart sizes (a tiny random llama
on ``sort_digits``, ``positional_match`` reward, AdamW, float32, 1 torch thread; RSPO on a tiny ``qwen2_moe`` of the
same sizes, as it needs experts). Presets run interleaved within each seed (``--seeds``; ``seed_everything`` sets the
sampling and the data order, the model starts from the same weights); each run is ``--warmup`` then ``--steps``
measured training steps (rollout batches).

Reported per preset over the seeds: the mean training reward (sampled at temperature 1 on the training prompts, not
held out) of the first and last fifth of the measured steps, mean ± sd; steps/s (median, min-max); the mean over
steps of the fraction of tokens the gate clipped or masked (``clip/low_frac + clip/high_frac``, ``dppo/masked_frac``)
and of the gate's own weight where it logs one; the mean of the step's smallest and largest token ratio.

Run from the repository root::

    python benchmarks/presets.py                        # 150 steps, 2 minibatches x 2 epochs, seeds 0 1 2
    python benchmarks/presets.py --presets grpo cispo gspo --steps 300
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import gpo from this checkout
from pipeline import median_range  # benchmarks/pipeline.py (the script's folder)
from step_time import make_workspace
from workload import PRESETS, add_workload_arguments, mean_sd

from gpo.cli.shipped import shipped_algorithm
from gpo.rewards import positional_match
from gpo.rollout import HFEngine, Sampling
from gpo.testing import save_tiny_model
from gpo.train.data import PromptDataModule
from gpo.train.module import GPOModule
from gpo.train.optimization import Optimization

ALGORITHMS = ["grpo", "rloo", "reinforce_pp", "dr_grpo", "maxrl", "dapo", "cispo", "gspo", "sapo", "gmpo", "rspo",
              "vespo", "dppo", "dro", "gopo"]  # fmt: skip
GATED = ("clip/low_frac", "clip/high_frac", "clip/dual_frac", "dppo/masked_frac")  # summed: tokens clipped or masked
WEIGHTS = ("gate/weight_mean", "vespo/weight_mean", "dro/penalty_mean")  # a gate's own smooth statistic


@dataclass
class Run:
    """Per training step: its end time, training reward and what the gate logged; ``start``: when the clock started."""

    ends: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    gated: list[float | None] = field(default_factory=list)
    weight: list[float | None] = field(default_factory=list)
    ratio_min: list[float] = field(default_factory=list)
    ratio_max: list[float] = field(default_factory=list)
    weight_key: str | None = None
    start: float = 0.0

    def after(self, warmup: int) -> Run:
        """The steps after the first ``warmup``, timed from the end of the last of those."""
        lists = {key: value[warmup:] for key, value in vars(self).items() if isinstance(value, list)}
        return Run(**lists, weight_key=self.weight_key, start=self.ends[warmup - 1])


class Recorder(L.Callback):
    def __init__(self) -> None:
        self.run = Run()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        logged, run = trainer.callback_metrics, self.run
        run.ends.append(time.perf_counter())
        run.rewards.append(float(logged["reward"]))
        gated = [float(logged[key]) for key in GATED if key in logged]
        run.gated.append(sum(gated) if gated else None)
        run.weight_key = next((key for key in WEIGHTS if key in logged), None)
        run.weight.append(float(logged[run.weight_key]) if run.weight_key else None)
        run.ratio_min.append(float(logged["ratio/min"]))
        run.ratio_max.append(float(logged["ratio/max"]))


def run(name: str, seed: int, model: str, data: str, args: argparse.Namespace) -> Run:
    L.seed_everything(seed, verbose=False)
    optim = Optimization(lr=args.lr, number_of_minibatches=args.number_of_minibatches, ppo_epochs=args.ppo_epochs)
    module = GPOModule(
        model, [positional_match], algorithm=shipped_algorithm(name), group_size=args.group_size, optim=optim,
        engine=HFEngine(sampling=Sampling(temperature=1.0, max_new_tokens=args.max_new_tokens)),
        old_logprobs=args.old_logprobs,
    )  # fmt: skip
    updates = args.number_of_minibatches * args.ppo_epochs  # optimiser steps per training step: max_steps counts them
    recorder = Recorder()
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            accelerator="cpu", devices=1, default_root_dir=root, max_steps=(args.warmup + args.steps) * updates,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[recorder],
        )  # fmt: skip
        trainer.fit(module, PromptDataModule(data, tokenizer=model, prompts_per_step=args.prompts_per_step))
    return recorder.run.after(args.warmup)


def mean_of(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.mean(present) if present else None


def report(results: dict[str, list[Run]], args: argparse.Namespace) -> None:
    print(f"\n{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} torch thread(s); "
          f"{args.prompts_per_step} prompts x {args.group_size} completions of up to {args.max_new_tokens} tokens, "
          f"hidden {args.hidden_size}, {args.num_layers} layers, lr {args.lr}; "
          f"{args.number_of_minibatches} minibatches x {args.ppo_epochs} epochs per step, old log-probs from the "
          f"{args.old_logprobs}; {args.steps} measured steps after {args.warmup}; seeds {args.seeds}\n")  # fmt: skip
    print("| preset | reward first 1/5 | reward last 1/5 | gain | steps/s | clipped or masked | gate statistic | "
          "ratio min / max |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    fifth = max(1, args.steps // 5)
    for name, runs in results.items():
        first = [statistics.mean(r.rewards[:fifth]) for r in runs]
        last = [statistics.mean(r.rewards[-fifth:]) for r in runs]
        gain = [b - a for a, b in zip(first, last, strict=True)]
        steps_s = [len(r.rewards) / (r.ends[-1] - r.start) for r in runs]
        gated = mean_of([mean_of(r.gated) for r in runs])
        weight = mean_of([mean_of(r.weight) for r in runs])
        low, high = (statistics.mean(mean_of(getattr(r, key)) for r in runs) for key in ("ratio_min", "ratio_max"))
        label = f"{name} (MoE model)" if name == "rspo" else name
        print(f"| {label} | {mean_sd(first)} | {mean_sd(last)} | {mean_sd(gain)} | {median_range(steps_s)} "
              f"| {'-' if gated is None else f'{gated:.2%}'} "
              f"| {'-' if weight is None else f'{weight:.3f} (`{runs[0].weight_key}`)'} "
              f"| {low:.2f} / {high:.2f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    parser.add_argument("--presets", nargs="+", default=ALGORITHMS, help="config names (default: %(default)s)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="(default: %(default)s)")
    parser.add_argument("--number-of-minibatches", type=int, default=2, help="(default: %(default)s)")
    parser.add_argument("--ppo-epochs", type=int, default=2, help="(default: %(default)s)")
    parser.add_argument("--old-logprobs", choices=["rollout", "trainer"], default="rollout", help="(default: rollout)")
    parser.set_defaults(**PRESETS["quickstart"], steps=150, seed=None)
    args = parser.parse_args()
    if args.seed is not None:
        parser.error("--seed is the step-time benchmark's; give this one's seeds with --seeds.")
    if args.steps < 5 or args.warmup < 1:
        parser.error("--steps must be >= 5 (fifths) and --warmup >= 1 (its last step's end starts the clock).")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("gpo").setLevel(logging.ERROR)  # the ungated presets' warning about several updates
    with tempfile.TemporaryDirectory() as root:
        dense, data = make_workspace(Path(root), args)
        moe = str(save_tiny_model(Path(root) / "moe", "qwen2_moe", seed=0, hidden_size=args.hidden_size,
                                  num_layers=args.num_layers))  # fmt: skip
        results: dict[str, list[Run]] = {name: [] for name in args.presets}
        for seed in args.seeds:  # presets interleaved: a slow spell of the machine hits each alike
            for name in args.presets:
                results[name].append(run(name, seed, moe if name == "rspo" else dense, data, args))
                print(f"{name} seed {seed}: {results[name][-1].rewards[-1]:.3f}", file=sys.stderr, flush=True)
    print("$ " + " ".join(["python benchmarks/presets.py", *sys.argv[1:]]))
    report(results, args)


if __name__ == "__main__":
    main()
