"""The small commands: ``gpo tiny`` (local test assets), ``gpo plot`` (curves) and ``gpo export`` (checkpoint to a
transformers folder)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable


def make_tiny(argv: list[str]) -> None:
    """``gpo tiny OUT``: write a tiny random model and a synthetic task's prompts for a CPU run."""
    from gpo.tasks import TASKS, make_task, write_jsonl

    parser = argparse.ArgumentParser(prog="gpo tiny", description=_description(make_tiny))
    parser.add_argument("out", help="folder to write model/, train.jsonl and val.jsonl into")
    parser.add_argument("--task", default="sort_digits", choices=sorted(TASKS), help="the synthetic task (%(default)s)")
    parser.add_argument(
        "--arch", default="llama", choices=["llama", "qwen2", "qwen2_moe"], help="model architecture (%(default)s)"
    )
    parser.add_argument("--examples", type=int, default=5000, help="training prompts to write (%(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompts (%(default)s)")
    args = parser.parse_args(argv)
    if args.examples < 1:
        parser.error(
            f"--examples {args.examples}: write at least 1 training prompt (an empty train.jsonl trains on none)"
        )
    from gpo.testing import save_tiny_model  # transformers and torch: after --help and argument errors

    model = save_tiny_model(f"{args.out}/model", args.arch, seed=args.seed)
    write_jsonl(make_task(args.task, args.examples, seed=args.seed), f"{args.out}/train.jsonl")
    write_jsonl(make_task(args.task, 64, seed=args.seed + 1), f"{args.out}/val.jsonl")
    print(f"wrote {model}, {args.out}/train.jsonl and {args.out}/val.jsonl")


def plot_curves(argv: list[str]) -> None:
    """``gpo plot RUN_DIR``: plot a run's reward and completion-length curves from its metrics.csv into a PNG."""
    from gpo.plot import find_metrics_csv, metrics_csv_candidates, plot_run, trained

    parser = argparse.ArgumentParser(prog="gpo plot", description=_description(plot_curves))
    parser.add_argument(
        "run_dir", help="a metrics.csv, its version_N folder, their lightning_logs folder or trainer.default_root_dir"
    )
    parser.add_argument("--out", help="PNG to write (default: RUN_DIR/curves.png)")
    parser.add_argument("--metrics", nargs="+", help="columns to plot (default: reward/* and completion/len_*)")
    parser.add_argument("--window", type=int, default=5, help="moving-average width in logged points (1: raw only)")
    args = parser.parse_args(argv)
    try:
        metrics_csv = find_metrics_csv(args.run_dir)
        folder = args.run_dir if os.path.isdir(args.run_dir) else metrics_csv.parent  # RUN_DIR may be the CSV itself
        out = plot_run(metrics_csv, args.out or os.path.join(folder, "curves.png"), args.metrics, args.window)
    except (FileNotFoundError, ValueError) as err:
        parser.exit(2, f"gpo plot: error: {err}\n")
    runs = metrics_csv_candidates(args.run_dir)
    training = sum(map(trained, runs))
    about = [f"the newest of {training} training runs"] if training > 1 else []
    about += [f"{len(runs) - training} validation-only left out"] if 0 < training < len(runs) else []
    print(f"read {metrics_csv}" + (f" ({'; '.join(about)})" if about else ""))
    print(f"wrote {out}")


def export_checkpoint_command(argv: list[str]) -> None:
    """``gpo export CONFIG CKPT OUT``: save the policy of a checkpoint as a transformers folder."""
    parser = argparse.ArgumentParser(prog="gpo export", description=_description(export_checkpoint_command))
    parser.add_argument(
        "config",
        help="the run's saved lightning_logs/version_N/config.yaml; a shipped config's name (quickstart) works when "
        "the run changed none of its model settings",
    )
    parser.add_argument("checkpoint", help="a .ckpt file of that run")
    parser.add_argument(
        "out", help="folder to write the model and tokenizer into: a new or empty one, or an earlier export (replaced)"
    )
    parser.add_argument("--adapter", action="store_true", help="LoRA runs: save the adapter alone, not merged")
    parser.add_argument("--policy", help="base model folder, if the config's model.policy path is not valid here")
    args = parser.parse_args(argv)
    from gpo.cli.shipped import config_path
    from gpo.models.export import export_checkpoint  # Lightning, transformers, torch: after --help and argument errors
    from gpo.train.checkpointing import CheckpointError

    try:
        config = config_path(args.config, argument="CONFIG")
        out = export_checkpoint(config, args.checkpoint, args.out, merge=not args.adapter, policy=args.policy)
    except (FileNotFoundError, FileExistsError, ValueError, CheckpointError) as err:
        parser.exit(2, f"gpo export: error: {err}\n")
    print(f"wrote {out}")


def _description(command: Callable[[list[str]], None]) -> str:
    """A command's docstring as ``--help`` prints it: without the reStructuredText code marks."""
    return (command.__doc__ or "").replace("``", "")
