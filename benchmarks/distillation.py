"""On-policy distillation against RL alone, at equal steps, on the CPU quickstart task.

1. A teacher: ``gpo fit --config quickstart`` trains the quickstart's tiny random llama on ``sort_digits`` for
   ``--teacher-steps`` steps; ``gpo export`` saves its last checkpoint as a transformers folder.
2. Students, from a fresh copy of the same untrained model, each for ``--steps`` steps and each ``--seeds``:
   ``rl`` (the quickstart as shipped: GRPO on ``positional_match``), ``distill`` (``--config distill``: the
   teacher's per-token reverse KL is the whole advantage, no reward is read by the update) and ``rl+distill``
   (GRPO's advantage minus ``coef`` times the reverse KL, ``coef`` 0.1).

Every run is a ``gpo fit`` command (the shipped configs plus flags), 1 torch thread. Reported per mode over the seeds,
mean ± sd: the training reward (``reward/mean``, sampled at temperature 1 on the training prompts) in the first and
last fifth of the run's logged steps, and the held-out greedy reward (``val/reward_greedy`` on the quickstart's
validation prompts) after the last step; for the teacher, the same numbers. The rewards are the quickstart's
``positional_match`` in every mode, so the columns compare.

Run from the repository root (about a minute per student run on one core)::

    python benchmarks/distillation.py                         # teacher 1000 steps; students 200 steps, seeds 0 1 2
    python benchmarks/distillation.py --steps 100 --seeds 0 1
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import gpo from this checkout
from workload import mean_sd  # benchmarks/workload.py (the script's folder)

from gpo.plot import find_metrics_csv, read_metrics

MODES = {
    "rl": (),
    "distill": ("--config", "distill"),
    "rl+distill": ("--config", "distill", "--model.distill.replace=false", "--model.distill.coef=0.1"),
}


def gpo(*args: str) -> None:
    """Run ``gpo ARGS`` on one torch thread; stop with its output when it fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "gpo.cli", *args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"gpo {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def fit(tiny: Path, out: Path, steps: int, seed: int, *extra: str) -> dict[str, list[float]]:
    """One ``gpo fit --config quickstart`` run; its logged ``reward/mean`` and ``val/reward_greedy`` series."""
    gpo("fit", "--config", "quickstart", *extra, f"--model.policy={tiny / 'model'}",
        f"--data.path={tiny / 'train.jsonl'}", f"--data.val_path={tiny / 'val.jsonl'}",
        f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={steps}", f"--seed_everything={seed}",
        f"--trainer.default_root_dir={out}", "--trainer.enable_progress_bar=false")  # fmt: skip
    series = read_metrics(find_metrics_csv(out))
    return {name: series[name][1].tolist() for name in ("reward/mean", "val/reward_greedy")}


def summary(series: dict[str, list[float]]) -> tuple[float, float, float]:
    """First-fifth and last-fifth mean training reward, and the last held-out greedy reward."""
    rewards = series["reward/mean"]
    fifth = max(1, len(rewards) // 5)
    return statistics.mean(rewards[:fifth]), statistics.mean(rewards[-fifth:]), series["val/reward_greedy"][-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher-steps", type=int, default=1000, help="training steps of the teacher")
    parser.add_argument("--steps", type=int, default=200, help="training steps of each student")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seed_everything of the students")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--root", type=Path, default=None, help="work folder (default: a temporary one)")
    args = parser.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="gpo-distill-"))
    tiny, teacher = root / "tiny", root / "teacher_model"
    print("# On-policy distillation vs RL alone (CPU quickstart task)\n")
    print(f"- machine: {platform.machine()}, nproc {os.cpu_count()}; torch {torch.__version__}; 1 torch thread")
    gpo("tiny", str(tiny))
    started = time.perf_counter()
    taught = fit(tiny, root / "teacher", args.teacher_steps, 0)
    run = root / "teacher"
    gpo("export", str(next(run.rglob("config.yaml"))), str(next(run.rglob("last.ckpt"))), str(teacher))
    first, last, greedy = summary(taught)
    print(f"- teacher: {args.teacher_steps} steps of the quickstart (seed 0) in {time.perf_counter() - started:.0f} s: "
          f"training reward {first:.3f} -> {last:.3f}, held-out greedy {greedy:.3f}")  # fmt: skip
    print(f"- students: {args.steps} steps each, seeds {args.seeds}, from the same untrained model\n")
    rows = {}
    for mode in args.modes:
        results, seconds = [], []
        for seed in args.seeds:
            started = time.perf_counter()
            extra = (*MODES[mode], f"--model.teacher={teacher}") if mode != "rl" else ()
            results.append(summary(fit(tiny, root / f"{mode}_{seed}", args.steps, seed, *extra)))
            seconds.append(time.perf_counter() - started)
            print(f"  {mode} seed {seed}: first {results[-1][0]:.3f}, last {results[-1][1]:.3f}, "
                  f"held-out greedy {results[-1][2]:.3f} ({seconds[-1]:.0f} s)", flush=True)  # fmt: skip
        rows[mode] = (results, seconds)
    print("\n| student | training reward, first fifth | training reward, last fifth | held-out greedy | s/run |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for mode, (results, seconds) in rows.items():
        first, last, greedy = ([r[i] for r in results] for i in range(3))
        print(f"| {mode} | {mean_sd(first)} | {mean_sd(last)} | {mean_sd(greedy)} | {statistics.median(seconds):.0f} |")


if __name__ == "__main__":
    main()
