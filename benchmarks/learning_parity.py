"""Learning parity: does gpo learn as fast per step as Hugging Face TRL's ``GRPOTrainer`` on the same workload?

One workload, the CPU quickstart's model and task without its entropy bonus (TRL has none): the tiny random llama of
``gpo tiny`` (``gpo.testing.save_tiny_model``, seed 0, hidden 64, 2 layers, character vocabulary, float32), the
quickstart's 5,000 ``sort_digits`` training prompts (``make_task(..., seed=0)``), 8 prompts x 8 completions per
optimiser step, ``max_new_tokens`` 4, temperature 1 (no top-p/top-k), the positional-match reward (one function,
below, for both), ``grpo`` (group mean/std advantages, plain policy gradient, mean over sequences of token means),
beta 0, one optimiser step per rollout with the old log-probs those of the step's own pass, AdamW lr 1e-3 with a
constant schedule and gradient clipping at 1.0, 300 steps, 1 torch thread. Every other setting is each trainer's own
default; ``--trl-set`` and the gpo flags change one at a time.

Recorded per run (JSON): per-step training reward (gpo's ``reward/mean``, TRL's logged ``reward``: both the mean
reward of the step's freshly sampled completions, before the update), completion length and gradient norm; the
resolved optimiser parameter groups and schedule; and, at the end, the greedy reward over every one of the task's
1,000 prompts (``000=`` .. ``999=``; 5,000 random training prompts cover nearly all of them, so nothing is truly
held out), computed by one function (``greedy_reward``) on the trained transformers model for both trainers.

gpo runs a plain ``lightning.Trainer`` with ``GPOModule``; TRL runs in its own virtual environment (it cannot import
lightning, so gpo's trainer is imported only by the ``gpo`` command). From the repository root::

    OMP_NUM_THREADS=1 python benchmarks/learning_parity.py gpo --seed 0 --out /tmp/parity/gpo_0.json
    OMP_NUM_THREADS=1 /tmp/trl-venv/bin/python benchmarks/learning_parity.py trl --seed 0 --out /tmp/parity/trl_0.json
    python benchmarks/learning_parity.py report /tmp/parity/gpo_*.json /tmp/parity/trl_*.json

``report`` groups the files by their ``label`` (``--label``; default: the trainer and its non-default flags).
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import gpo from this checkout
from workload import PRESETS, add_workload_arguments, mean_sd, positional_match, trl_settings  # benchmarks/workload.py

from gpo.tasks import make_task
from gpo.testing import save_tiny_model

TASK, TRAIN_EXAMPLES = "sort_digits", 5000  # `gpo tiny`'s train.jsonl, which the quickstart trains on
EVAL_RECORDS = [{"prompt": f"{n:03d}=", "answer": "".join(sorted(f"{n:03d}"))} for n in range(1000)]
LAST = 10  # the training reward is summarised over the last LAST steps
TRL_RESOLVED = (  # GRPOConfig fields recorded as resolved: those left at TRL's defaults and those that could differ
    "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "optim", "lr_scheduler_type", "warmup_steps", "top_k",
    "top_p", "temperature", "epsilon", "epsilon_high", "scale_rewards", "shuffle_dataset", "mask_truncated_completions",
    "generation_batch_size", "steps_per_generation", "max_completion_length",
)  # fmt: skip
QUICKSTART = {**PRESETS["quickstart"], "warmup": 0, "steps": 300}


@torch.no_grad()
def greedy_reward(model, tokenizer, records: list[dict[str, str]], max_new_tokens: int, batch: int = 250) -> float:
    """Mean ``positional_match`` of ``model.generate(do_sample=False)`` over ``records`` (prompts left-padded)."""
    was_training = model.training
    model.eval()
    scores = []
    for start in range(0, len(records), batch):
        rows = records[start : start + batch]
        inputs = tokenizer([r["prompt"] for r in rows], return_tensors="pt", padding=True, padding_side="left")
        out = model.generate(
            **inputs,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        completions = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        scores += positional_match(None, completions, [r["answer"] for r in rows])
    model.train(was_training)
    return statistics.mean(scores)


def make_model(root: Path, args: argparse.Namespace) -> Path:
    return save_tiny_model(root / "model", "llama", seed=0, hidden_size=args.hidden_size, num_layers=args.num_layers)


def param_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimiser's settings per parameter group (everything but the tensors), plus the group's size."""
    groups = []
    for group in optimizer.param_groups:
        settings = {k: v for k, v in group.items() if k != "params" and isinstance(v, (int, float, bool, tuple, str))}
        groups.append({**settings, "num_tensors": len(group["params"]), "type": type(optimizer).__name__})
    return groups


# ---- gpo ---------------------------------------------------------------------------------------------------------


def run_gpo(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """``args.warmup + args.steps`` steps of ``GPOModule`` under a plain Lightning ``Trainer``."""
    import datasets
    import lightning as L
    from lightning import Callback

    from gpo.algo import EntropyBonus, GroupNormAdvantage, SequenceMean
    from gpo.algo.gates import NoGate
    from gpo.algo.presets import Algorithm, Custom
    from gpo.rollout import HFEngine, Sampling
    from gpo.tasks import write_jsonl
    from gpo.train.data import PromptDataModule
    from gpo.train.module import GPOModule
    from gpo.train.optimization import Optimization

    class Series(Callback):
        """The step's metrics as ``GPOModule`` hands them to the callbacks."""

        def __init__(self) -> None:
            self.rows: dict[str, list[float]] = defaultdict(list)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            logged = trainer.callback_metrics
            for key, name in (("reward/mean", "reward"), ("completion/len_mean", "length"), ("grad/norm", "grad")):
                self.rows[name].append(float(logged[key]))

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # after the import, which sets INFO
    datasets.disable_progress_bars()
    L.seed_everything(args.seed, verbose=False)
    model_path = make_model(root, args)
    data = write_jsonl(make_task(TASK, TRAIN_EXAMPLES, seed=0), root / "train.jsonl")
    algorithm: Algorithm | str = "grpo"
    if (args.adv_std, args.adv_eps) != ("population", 1e-6):  # the grpo preset's parts, but this advantage
        advantage = GroupNormAdvantage(std=args.adv_std, eps=args.adv_eps)
        algorithm = Custom(advantage=advantage, gate=NoGate(), aggregator=SequenceMean())
    module = GPOModule(
        str(model_path),
        [positional_match],
        algorithm=algorithm,
        engine=HFEngine(sampling=Sampling(temperature=1.0, max_new_tokens=args.max_new_tokens)),
        group_size=args.group_size,
        optim=Optimization(lr=args.lr, weight_decay=args.weight_decay, max_grad_norm=1.0),
        old_logprobs=args.old_logprobs,
        entropy=EntropyBonus(coef=args.entropy_coef) if args.entropy_coef else None,
    )
    series = Series()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        default_root_dir=root,
        max_steps=args.warmup + args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[series],
    )
    datamodule = PromptDataModule(str(data), tokenizer=str(model_path), prompts_per_step=args.prompts_per_step)
    started = time.perf_counter()
    trainer.fit(module, datamodule)
    train_s = time.perf_counter() - started
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    parts = module.learner.objective
    settings = {
        "optimizer": param_groups(trainer.optimizers[0]),
        "scheduler": f"{type(scheduler).__name__} last_lr={scheduler.get_last_lr()}",
        "advantage": {"class": type(module.credit.advantage).__name__, **vars(module.credit.advantage)},
        "objective": f"gate={type(parts.gate).__name__} aggregator={type(parts.aggregator).__name__}",
        "sampling": repr(module.engine.sampling),
        "old_logprobs": args.old_logprobs,
        "entropy_coef": args.entropy_coef,
    }
    return {
        "series": dict(series.rows),
        "settings": settings,
        "train_s": train_s,
        "model": module.model,
        "tokenizer": module.tokenizer,
    }


# ---- TRL ---------------------------------------------------------------------------------------------------------


def trl_overrides(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; values parsed as Python literals where they are one (``0.0``, ``None``), else strings."""
    out = {}
    for pair in pairs:
        key, _, text = pair.partition("=")
        try:
            out[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[key] = text
    return out


def run_trl(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """``args.warmup + args.steps`` steps of TRL's ``GRPOTrainer`` with the settings that match gpo's run."""
    import datasets
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    datasets.disable_progress_bars()
    logging.getLogger("trl").setLevel(logging.ERROR)

    class Series(TrainerCallback):
        """TRL's logged metrics, one row per optimiser step (``logging_steps=1``)."""

        def __init__(self) -> None:
            self.rows: dict[str, list[float]] = defaultdict(list)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                for key, name in (("reward", "reward"), ("completions/mean_length", "length"), ("grad_norm", "grad")):
                    self.rows[name].append(float(logs[key]))

    model_path = make_model(root, args)
    dataset = datasets.Dataset.from_list(make_task(TASK, TRAIN_EXAMPLES, seed=0))  # columns: prompt, answer
    matched = trl_settings(args, str(root / "out")) | {"logging_strategy": "steps", "logging_steps": 1}
    overrides = trl_overrides(args.trl_set)
    config = GRPOConfig(**(matched | overrides))
    series = Series()
    trainer = GRPOTrainer(
        model=str(model_path), reward_funcs=[positional_match], args=config, train_dataset=dataset, callbacks=[series]
    )
    trainer.remove_callback(PrinterCallback)  # it prints every log row
    started = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - started
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it
    settings = {
        "optimizer": param_groups(optimizer),
        "scheduler": f"{type(trainer.lr_scheduler).__name__} last_lr={trainer.lr_scheduler.get_last_lr()}",
        "config": {k: str(getattr(config, k)) for k in TRL_RESOLVED},
        "overrides": overrides,
        "model_dtype": str(trainer.model.dtype),
        "generation_config": trainer.generation_config.to_diff_dict(),
    }
    return {
        "series": dict(series.rows),
        "settings": settings,
        "train_s": train_s,
        "model": trainer.model,
        "tokenizer": trainer.processing_class,
    }


# ---- report ------------------------------------------------------------------------------------------------------


def report(paths: list[str]) -> None:
    """A markdown table: a row per seed and one of mean ± sd, a column per label with the last-LAST-step training
    reward and the greedy reward."""
    runs: dict[str, dict[int, dict]] = defaultdict(dict)
    for path in paths:
        run = json.loads(Path(path).read_text())
        runs[run["label"]][run["seed"]] = run
    seeds = sorted({seed for by_seed in runs.values() for seed in by_seed})
    print(f"train: mean reward of the last {LAST} training steps; greedy: greedy reward over all 1,000 prompts\n")
    print(
        "| seed | " + " | ".join(f"{label} (n={len(by_seed)}) train / greedy" for label, by_seed in runs.items()) + " |"
    )
    print("| ---: |" + " ---: |" * len(runs))
    for seed in seeds:
        cells = [
            f"{r['last_reward']:.3f} / {r['greedy_reward']:.3f}" if (r := runs[k].get(seed)) else "-" for k in runs
        ]
        print(f"| {seed} | " + " | ".join(cells) + " |")
    means = []
    for by_seed in runs.values():
        last, greedy = ([r[key] for r in by_seed.values()] for key in ("last_reward", "greedy_reward"))
        means.append(f"{mean_sd(last)} / {mean_sd(greedy)}")
    print("| mean ± sd | " + " | ".join(means) + " |")


# ---- command line ------------------------------------------------------------------------------------------------


def label_of(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """The trainer's name and every flag that differs from its default (seed, out and threads aside)."""
    changed = [
        f"{key}={value}"
        for key, value in sorted(vars(args).items())
        if key not in ("command", "seed", "out", "threads", "label") and value != parser.get_default(key)
    ]
    return " ".join([args.command, *changed])


def parse_args() -> tuple[argparse.Namespace, argparse.ArgumentParser | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    trainers = {}
    for name in ("gpo", "trl"):
        sub = commands.add_parser(name, help=f"train with {name} and write a JSON")
        add_workload_arguments(sub)
        sub.set_defaults(**QUICKSTART)
        sub.add_argument("--out", required=True, help="JSON file to write")
        sub.add_argument("--label", help="name of the run's group in the report (default: trainer + changed flags)")
        trainers[name] = sub
    gpo = trainers["gpo"]
    gpo.add_argument("--weight-decay", type=float, default=0.0, help="Optimization.weight_decay (%(default)s)")
    gpo.add_argument("--adv-std", choices=["population", "sample"], default="population", help="(%(default)s)")
    gpo.add_argument("--adv-eps", type=float, default=1e-6, help="GroupNormAdvantage eps (%(default)s)")
    gpo.add_argument("--old-logprobs", choices=["trainer", "rollout"], default="trainer", help="(%(default)s)")
    gpo.add_argument("--entropy-coef", type=float, default=0.0, help="entropy bonus; the quickstart's is 0.01")
    trainers["trl"].add_argument(
        "--trl-set", action="append", default=[], metavar="KEY=VALUE", help="override a GRPOConfig field"
    )
    summary = commands.add_parser("report", help="print the markdown table of the JSONs given")
    summary.add_argument("paths", nargs="+")
    args = parser.parse_args()
    return args, trainers.get(args.command)


def main() -> None:
    args, sub = parse_args()
    if args.command == "report":
        report(args.paths)
        return
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        trained = (run_gpo if args.command == "gpo" else run_trl)(args, Path(tmp))
    greedy = greedy_reward(trained["model"], trained["tokenizer"], EVAL_RECORDS, args.max_new_tokens)
    rewards = trained["series"]["reward"]
    result = {
        "label": args.label or label_of(args, sub),
        "trainer": args.command,
        "seed": args.seed,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__}
        | ({"trl": __import__("trl").__version__} if args.command == "trl" else {}),
        "train_s": trained["train_s"],
        "steps": len(rewards),
        "last_reward": statistics.mean(rewards[-LAST:]),
        "greedy_reward": greedy,
        "settings": trained["settings"],
        "series": trained["series"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(
        f"{result['label']} seed {args.seed}: {len(rewards)} steps in {trained['train_s']:.0f} s, last-{LAST} reward "
        f"{result['last_reward']:.3f}, greedy reward {greedy:.3f} -> {args.out}"
    )


if __name__ == "__main__":
    main()
