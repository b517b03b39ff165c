"""The ``gpo`` command: ``gpo fit --config configs/grpo.yaml`` (LightningCLI), ``gpo tiny`` (local test assets) and
``gpo plot RUN_DIR`` (reward and length curves) and ``gpo export CONFIG CKPT OUT`` (checkpoint to transformers)."""

from __future__ import annotations

import argparse
import os
import sys

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger

from gpo.callbacks import ResumeCheckpoint
from gpo.train.data import PromptDataModule
from gpo.train.module import GPOModule


class GPOCLI(LightningCLI):
    """LightningCLI whose data module reads the policy's tokenizer unless told otherwise, which logs to CSV and
    TensorBoard under ``trainer.default_root_dir`` unless ``--trainer.logger`` says otherwise, and which keeps
    ``<default_root_dir>/checkpoints/last.ckpt`` current (``ResumeCheckpoint``) unless ``trainer.callbacks`` holds a
    ``ModelCheckpoint`` or ``trainer.enable_checkpointing`` is false. ``--ckpt_path last`` resumes the run and
    appends to its newest log folder."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments(("model.policy", "model.tokenizer"), "data.tokenizer", compute_fn=_tokenizer_folder)

    def instantiate_trainer(self, **kwargs):
        # A logger default in the parser could not follow --trainer.default_root_dir, so fill it in here.
        trainer = {**self._get(self.config_init, "trainer", default={})}
        root = trainer.get("default_root_dir") or os.getcwd()
        if trainer.get("logger") in (None, True) and "logger" not in kwargs:
            resuming = self.subcommand == "fit" and self._get(self.config_init, "ckpt_path") is not None
            kwargs["logger"] = default_loggers(root, resume=resuming)
        configured = _as_list(trainer.get("callbacks"))
        callbacks = [*configured, *(self._get(self.config_init, k) for k in self._callback_keys())]
        wants_checkpoints = trainer.get("enable_checkpointing") is not False
        if wants_checkpoints and not any(isinstance(c, ModelCheckpoint) for c in callbacks):
            kwargs["callbacks"] = [*configured, ResumeCheckpoint()]
        return super().instantiate_trainer(**kwargs)

    def _callback_keys(self) -> list[str]:
        return list(self._parser(self.subcommand).callback_keys) if self.subcommand else []


def _tokenizer_folder(policy, tokenizer) -> str:
    """The data module tokenises prompts with ``model.tokenizer`` when it names a folder, else the policy's."""
    return tokenizer if isinstance(tokenizer, str) else policy


def _as_list(value) -> list:
    return [] if value is None else list(value) if isinstance(value, list | tuple) else [value]


def default_loggers(root: str, resume: bool = False) -> list[Logger]:
    """CSV and TensorBoard loggers sharing ``<root>/lightning_logs/version_N/`` (TensorBoard's files in ``tb/``);
    ``resume`` continues the newest existing version instead of starting a new one.

    The CSV logger comes first, so the saved ``config.yaml`` lands next to ``metrics.csv``."""
    csv = CSVLogger(root)
    if resume and csv.version > 0:
        csv = CSVLogger(root, version=csv.version - 1)  # the next free version minus one: the newest run
    return [csv, TensorBoardLogger(root, version=csv.version, sub_dir="tb", default_hp_metric=False)]


def make_tiny(argv: list[str]) -> None:
    """``gpo tiny OUT``: write a tiny random model and a synthetic task's prompts for a CPU run."""
    from gpo.tasks import TASKS, make_task, write_jsonl
    from gpo.testing import save_tiny_model

    parser = argparse.ArgumentParser(prog="gpo tiny", description=make_tiny.__doc__)
    parser.add_argument("out", help="folder to write model/, train.jsonl and val.jsonl into")
    parser.add_argument("--task", default="sort_digits", choices=sorted(TASKS))
    parser.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen2_moe"])
    parser.add_argument("--examples", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model = save_tiny_model(f"{args.out}/model", args.arch, seed=args.seed)
    write_jsonl(make_task(args.task, args.examples, seed=args.seed), f"{args.out}/train.jsonl")
    write_jsonl(make_task(args.task, 64, seed=args.seed + 1), f"{args.out}/val.jsonl")
    print(f"wrote {model}, {args.out}/train.jsonl and {args.out}/val.jsonl")


def plot_curves(argv: list[str]) -> None:
    """``gpo plot RUN_DIR``: plot a run's reward and completion-length curves from its metrics.csv into a PNG."""
    from gpo.plot import find_metrics_csv, metrics_csv_candidates, plot_run

    parser = argparse.ArgumentParser(prog="gpo plot", description=plot_curves.__doc__)
    parser.add_argument("run_dir", help="a version_N folder, its lightning_logs folder or trainer.default_root_dir")
    parser.add_argument("--out", help="PNG to write (default: RUN_DIR/curves.png)")
    parser.add_argument("--metrics", nargs="+", help="columns to plot (default: reward/* and completion/len_*)")
    parser.add_argument("--window", type=int, default=5, help="moving-average width in logged points (1: raw only)")
    args = parser.parse_args(argv)
    try:
        metrics_csv = find_metrics_csv(args.run_dir)
        out = plot_run(metrics_csv, args.out or os.path.join(args.run_dir, "curves.png"), args.metrics, args.window)
    except (FileNotFoundError, ValueError) as err:
        parser.exit(2, f"gpo plot: error: {err}\n")
    runs = len(metrics_csv_candidates(args.run_dir))
    print(f"read {metrics_csv}" + (f" (the newest of {runs} runs)" if runs > 1 else ""))
    print(f"wrote {out}")


def export_checkpoint_command(argv: list[str]) -> None:
    """``gpo export CONFIG CKPT OUT``: save the policy of a checkpoint as a transformers folder."""
    from gpo.models.export import export_checkpoint
    from gpo.train.checkpointing import CheckpointError

    parser = argparse.ArgumentParser(prog="gpo export", description=export_checkpoint_command.__doc__)
    parser.add_argument("config", help="the run's saved config.yaml")
    parser.add_argument("checkpoint", help="a .ckpt file of that run")
    parser.add_argument("out", help="folder to write the model and tokenizer into")
    parser.add_argument("--adapter", action="store_true", help="LoRA runs: save the adapter alone, not merged")
    parser.add_argument("--policy", help="base model folder, if the config's model.policy path is not valid here")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.config, args.checkpoint, args.out, merge=not args.adapter, policy=args.policy)
    except (FileNotFoundError, ValueError, CheckpointError) as err:
        parser.exit(2, f"gpo export: error: {err}\n")
    print(f"wrote {out}")


COMMANDS = {"tiny": make_tiny, "plot": plot_curves, "export": export_checkpoint_command}


def main(argv: list[str] | None = None) -> None:
    """Entry point; ``argv`` defaults to the command line."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] and args[0] in COMMANDS:
        COMMANDS[args[0]](args[1:])
        return
    GPOCLI(GPOModule, PromptDataModule, args=argv, save_config_kwargs={"overwrite": True})  # None: Lightning reads argv


if __name__ == "__main__":
    main()
