"""Reward curves of ``GPOModule`` with and without ``DynamicSampling`` at equal optimiser steps, and the extra
rollouts DynamicSampling pays for them.

Workload: the tiny random llama of ``gpo tiny`` (``gpo.testing.save_tiny_model``, hidden 64, 2 layers, character
vocabulary), ``sort_digits`` prompts, ``grpo`` with one optimiser step per rollout batch (on-policy, old log-probs
from the batch), ``prompts_per_step`` prompts x ``group_size`` completions of up to ``max_new_tokens`` tokens,
AdamW. The reward is binary, ``first_digit``: 1 if the completion starts with the smallest digit of the prompt.
A random tiny model gets it about 1 time in 80, so about 9 groups in 10 are uniform (all 0) at the start; once
the policy turns deterministic (sampled = greedy) nearly every group is uniform again (all 0 or all 1).

Both runs of a seed share the initial model, the prompt order of the step's first batch and the sampling seeds;
``DynamicSampling`` (defaults: target = ``prompts_per_step`` informative groups, ``max_rounds`` 8, ``train`` when
it runs out, skip when a step has none at all) draws extra batches until the step holds that many informative
groups. A skipped step is no optimiser step, so a run stops after ``--max-batches`` training batches (default
4 x ``--steps``) even if it has not reached ``--steps``. ``--matched`` adds a third run without DynamicSampling
that stops once it has generated as many completion tokens as the run with it.

Reported per window of optimiser steps: the on-policy reward (mean reward of the step's first batch as sampled,
before any filtering: the same unbiased measure in both runs; the reward of the rows DynamicSampling trains on
is biased towards 0.5 by the filtering, so it is not compared), the fraction of informative groups in it, and
every ``window`` steps the held-out reward (fixed prompts and seed, sampled and greedy). Cost: completion tokens
generated, batches sampled, wall time (held-out evaluation excluded) and the rollout / training seconds that
``GPOModule`` logs (on optimiser steps only: a skipped batch's rollouts count in the wall time, not there). Means
over seeds average the seeds whose run reached that step.

Run from the repository root (1 torch thread; results in ``benchmarks/results/dynamic_sampling_cpu.md``)::

    python benchmarks/dynamic_sampling_curves.py --steps 150 --seeds 0 1 2 3 4 --matched
    python benchmarks/dynamic_sampling_curves.py --steps 300 --seeds 0 1 2 3 4
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path
from statistics import mean

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import gpo from this checkout

from gpo.algo import EntropyBonus
from gpo.callbacks.dynamic_sampling import DynamicSampling
from gpo.rollout import HFEngine, Sampling
from gpo.tasks import make_task, write_jsonl
from gpo.testing import save_tiny_model
from gpo.train.data import PromptDataModule
from gpo.train.hooks import RolloutCallback
from gpo.train.module import GPOModule, Optimization


def first_digit(prompts, completions, answer, **_):
    """1.0 if the completion starts with the answer's first digit (the smallest digit of the prompt), else 0.0."""
    return [float(c.strip()[:1] == a[:1]) for c, a in zip(completions, answer, strict=True)]


class Probe(RolloutCallback):
    """Placed before DynamicSampling: each step's first batch as sampled; per-step times; held-out evaluation."""

    def __init__(self, eval_batch: dict, window: int, samples: int, max_batches: int, token_budget: int | None) -> None:
        self.eval_batch, self.window, self.samples = eval_batch, window, samples
        self.max_batches, self.token_budget, self.batches = max_batches, token_budget, 0
        self.steps: list[dict] = []  # one per optimiser step
        self.evals: list[dict] = []
        self.tokens, self.eval_s, self._first = 0, 0.0, None

    def on_rollout_end(self, trainer, pl_module, rollout):
        informative, groups = DynamicSampling().informative_groups(rollout)
        self._first = {"reward": float(rollout.reward.mean()), "informative": len(informative) / groups}
        self.tokens += int(rollout.completion_mask.sum())

    def on_train_start(self, trainer, pl_module):
        self._evaluate(trainer, pl_module, 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches += 1
        if self.batches >= self.max_batches:
            trainer.should_stop = True  # a policy whose groups are all uniform can skip step after step
        if trainer.global_step == len(self.steps):
            return  # a skipped batch (no informative group at all): no optimiser step
        logged = trainer.callback_metrics
        times = {k: float(logged[f"time/{k}_s"]) for k in ("rollout", "scoring", "training")}
        self.steps.append({**self._first, **times})
        if self.token_budget is not None and self.tokens >= self.token_budget:
            trainer.should_stop = True  # spent as many rollout tokens as the run with DynamicSampling
        if trainer.global_step % self.window == 0:
            self._evaluate(trainer, pl_module, trainer.global_step)

    def on_train_end(self, trainer, pl_module):
        if self.evals[-1]["step"] != trainer.global_step:
            self._evaluate(trainer, pl_module, trainer.global_step)

    @torch.no_grad()
    def _evaluate(self, trainer, module, step: int) -> None:
        started = time.perf_counter()
        row = {"step": step, "tokens": self.tokens}
        sampling = next((c for c in trainer.callbacks if isinstance(c, DynamicSampling)), None)
        if sampling is not None:
            row["tokens"] = sampling.totals["tokens_drawn"]
        for kind, n, greedy in (("sampled", self.samples, False), ("greedy", 1, True)):
            rollout = module.collector.sample(self.eval_batch, seed=1234, greedy=greedy, n=n)
            row[kind] = mean(first_digit(rollout.prompts, rollout.completions, **rollout.fields))
        self.evals.append(row)
        self.eval_s += time.perf_counter() - started


def run(args, paths, eval_batch, seed: int, mode: str, token_budget: int | None = None) -> dict:
    """``mode``: ``without`` / ``with`` DynamicSampling for ``args.steps`` steps, or ``matched``: without it, until
    it has generated ``token_budget`` completion tokens."""
    model, train = paths
    L.seed_everything(seed, verbose=False)
    module = GPOModule(
        model, [first_digit], group_size=args.group_size, optim=Optimization(lr=args.lr), old_logprobs="trainer",
        engine=HFEngine(sampling=Sampling(max_new_tokens=args.max_new_tokens)), seed=seed,
        entropy=EntropyBonus(coef=args.entropy) if args.entropy else None,
    )  # fmt: skip
    max_batches = 10**9 if token_budget else args.max_batches or 4 * args.steps
    probe = Probe(eval_batch, args.window, args.eval_samples, max_batches, token_budget)
    sampling = DynamicSampling(max_rounds=args.max_rounds)
    trainer = L.Trainer(
        max_steps=-1 if token_budget else args.steps, max_epochs=-1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        callbacks=[probe, sampling] if mode == "with" else [probe],
    )  # fmt: skip
    started = time.perf_counter()
    trainer.fit(module, PromptDataModule(train, tokenizer=model, prompts_per_step=args.prompts, seed=seed))
    cost = {
        "steps": trainer.global_step,
        "wall_s": time.perf_counter() - started - probe.eval_s,
        "rollout_s": sum(s["rollout"] for s in probe.steps),
        "training_s": sum(s["training"] for s in probe.steps),
        "tokens": probe.tokens,
        "batches": trainer.global_step,
        "exhausted": 0,
        "skipped": probe.batches - trainer.global_step,
    }
    if mode == "with":
        totals = sampling.totals
        cost.update(tokens=totals["tokens_drawn"], batches=totals["steps"] + totals["rounds"])
        cost.update(exhausted=totals["exhausted_steps"])
    return {"steps": probe.steps, "evals": probe.evals, "cost": cost}


def average(values) -> float | str:
    """The mean, or "-" where there is nothing to average (a run stopped before that step)."""
    values = list(values)
    return mean(values) if values else "-"


def windows(values: list[float], size: int) -> list[float]:
    return [mean(values[i : i + size]) for i in range(0, len(values), size)]


def table(header: list[str], rows: list[list]) -> list[str]:
    def cell(x) -> str:
        if isinstance(x, float):
            return f"{x:,.1f}" if abs(x) >= 10 else f"{x:.3f}"
        return f"{x:,}" if isinstance(x, int) else str(x)

    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    return lines + ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows] + [""]


def curves(args, runs: list[dict]) -> list[list]:
    """Rows ``[steps, reward without, reward with, informative without, informative with]``, means over the seeds
    whose run reached the window."""
    spans = [f"{i + 1}-{min(i + args.window, args.steps)}" for i in range(0, args.steps, args.window)]
    columns = []
    for key in ("reward", "informative"):
        for mode in ("without", "with"):
            per_run = [windows([s[key] for s in r[mode]["steps"]], args.window) for r in runs]
            columns.append([average(w[i] for w in per_run if i < len(w)) for i in range(len(spans))])
    return [[span, *values] for span, *values in zip(spans, *columns, strict=True)]


def held_out(runs: list[dict]) -> list[list]:
    """Rows ``[step, sampled without, sampled with, greedy without, greedy with, tokens without, tokens with]`` at
    the evaluation steps of the run without DynamicSampling, means over the seeds evaluated at that step."""
    rows = []
    for step in [e["step"] for e in runs[0]["without"]["evals"]]:
        at = {m: [e for r in runs for e in r[m]["evals"] if e["step"] == step] for m in ("without", "with")}
        values = [average(e[key] for e in at[m]) for key in ("sampled", "greedy") for m in at]
        tokens = [round(average(e["tokens"] for e in at[m])) if at[m] else "-" for m in at]
        rows.append([step, *values, *tokens])
    return rows


def report(args, results: dict[int, dict[str, dict]]) -> str:
    lines = []
    groups = {"mean over seeds " + " ".join(map(str, results)): list(results.values())} if len(results) > 1 else {}
    groups.update({f"seed {seed}": [runs] for seed, runs in results.items()})
    for title, runs in groups.items():
        lines += [f"### {title}", "", "On-policy reward (the step's first batch, unfiltered), per window:", ""]
        lines += table(["steps", "reward without", "reward with", "informative without", "informative with"],
                       curves(args, runs))  # fmt: skip
        lines += [f"Held-out reward (64 prompts, sampled x{args.eval_samples} and greedy); completion tokens generated "
                  "so far:", ""]  # fmt: skip
        lines += table(["step", "sampled without", "sampled with", "greedy without", "greedy with", "tokens without",
                        "tokens with"], held_out(runs))  # fmt: skip
        modes = ("without", "with", "matched") if "matched" in runs[0] else ("without", "with")
        keys = ("steps", "skipped", "wall_s", "rollout_s", "training_s", "tokens", "batches", "exhausted")
        rows = [[key, *(round(mean(r[m]["cost"][key] for r in runs), 1) for m in modes)] for key in keys]
        rows += [[f"held-out {kind} at the end", *(mean(r[m]["evals"][-1][kind] for r in runs) for m in modes)]
                 for kind in ("sampled", "greedy")]  # fmt: skip
        lines += ["Cost (and `matched`: the run without DynamicSampling given the same rollout tokens):", ""]
        lines += table(["", *modes], rows)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="optimiser steps per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (DynamicSampling's target)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--entropy", type=float, default=0.0, help="entropy bonus coefficient (0: none)")
    parser.add_argument("--max-rounds", type=int, default=8, help="DynamicSampling's max_rounds")
    parser.add_argument("--window", type=int, default=25, help="steps per row of the curves")
    parser.add_argument("--eval-samples", type=int, default=8, help="sampled completions per held-out prompt")
    parser.add_argument("--max-batches", type=int, help="stop a run after this many batches (default 4 x steps)")
    parser.add_argument("--matched", action="store_true", help="also run without it on the same rollout tokens")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel("ERROR")
    with tempfile.TemporaryDirectory() as root:
        model = str(save_tiny_model(Path(root) / "model", "llama", seed=0))
        train = str(write_jsonl(make_task("sort_digits", 5000, seed=0), Path(root) / "train.jsonl"))
        val = str(write_jsonl(make_task("sort_digits", 64, seed=1), Path(root) / "val.jsonl"))
        data = PromptDataModule(train, val_path=val, tokenizer=model, prompts_per_step=64)
        data.setup()
        eval_batch = next(iter(data.val_dataloader()))
        results = {}
        for seed in args.seeds:
            runs = {mode: run(args, (model, train), eval_batch, seed, mode) for mode in ("without", "with")}
            if args.matched:
                runs["matched"] = run(args, (model, train), eval_batch, seed, "matched", runs["with"]["cost"]["tokens"])
            results[seed] = runs
    print(f"# DynamicSampling reward curves ({' '.join(sys.argv)})\n")
    print(f"- machine: {platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}, "
          f"lightning {L.__version__}, {args.threads} torch thread(s)")  # fmt: skip
    print(f"- workload: {vars(args)}\n")
    print(report(args, results))


if __name__ == "__main__":
    main()
