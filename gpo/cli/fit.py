"""``gpo fit``: LightningCLI over GPOModule and PromptDataModule, with gpo's defaults (engine, loggers, checkpoints,
export) and configuration errors that name the key, the file and the fix."""

from __future__ import annotations

import os
import secrets
import sys
import warnings
from pathlib import Path
from typing import Any, Literal

from lightning import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from typing_extensions import override

from gpo.callbacks import ExportPolicy, ResumeCheckpoint, StepProgressBar
from gpo.callbacks.resume_checkpoint import check_no_earlier_run
from gpo.cli import helptext
from gpo.cli.parser import SettingsParser
from gpo.logfilters import drop_messages
from gpo.train.loggers import default_loggers, discard_unused_version
from gpo.train.preflight import check_trainer_loop


class GPOCLI(LightningCLI):
    """LightningCLI whose data module reads the policy's tokenizer unless told otherwise, whose rollout engine is
    transformers' ``generate`` (``HFEngine``) unless ``model.engine`` names another, which logs to CSV and
    TensorBoard under ``trainer.default_root_dir`` unless ``--trainer.logger`` says otherwise, which keeps
    ``<default_root_dir>/checkpoints/last.ckpt`` current (``ResumeCheckpoint``) unless ``trainer.callbacks`` holds a
    ``ModelCheckpoint`` or ``trainer.enable_checkpointing`` is false, which exports the policy when training ends
    (``ExportPolicy``) unless ``export: none``, and whose progress bar counts optimiser steps towards
    ``trainer.max_steps`` (``StepProgressBar``) unless ``trainer.callbacks`` holds a progress bar. ``--ckpt_path
    last`` resumes the run and appends to its newest log folder. ``--help`` shows gpo's settings and the most used
    of the trainer's; ``--help-all`` shows Lightning's full help."""

    def __init__(self, *args, **kwargs) -> None:
        quiet_lightning()
        # gpo builds its optimiser from model.optim: Lightning's --optimizer / --lr_scheduler would be ignored
        kwargs.setdefault("auto_configure_optimizers", False)
        kwargs.setdefault("parser_class", SettingsParser)  # refuses `key: {}` of a setting it does not know
        kwargs.setdefault("seed_everything_default", 0)  # what Lightning picks for True, said without its warning
        argv = kwargs.get("args")
        argv = sys.argv[1:] if argv is None else argv
        self.full_help = isinstance(argv, list | tuple) and helptext.FULL_HELP in argv
        # Only a help request gets the focused help: jsonargparse leaves the settings it hides out of every config it
        # writes too (--print_config, each run's config.yaml), and a run made again from those would lose them.
        self.focused_help = isinstance(argv, list | tuple) and bool({"--help", "-h"} & set(argv))
        self.new_version = False  # whether gpo's default loggers start a new version_N folder (instantiate_trainer)
        super().__init__(*args, **kwargs)

    def _run_subcommand(self, subcommand: str) -> None:
        try:
            super()._run_subcommand(subcommand)
        except BaseException:
            if self.new_version:  # a run refused at set-up leaves no version_N folder behind to skip a number
                discard_unused_version(self.trainer)
            for callback in self.trainer.callbacks:
                if isinstance(callback, RunConfig):  # nor a config-N.yaml of a run never made
                    callback.discard_if_unused(self.trainer)
            raise

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """Lightning's ``fit`` and ``validate`` (``SUBCOMMANDS``), with the Trainer arguments each skips."""
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name in helptext.SUBCOMMANDS}

    def init_parser(self, **kwargs):
        kwargs.setdefault("exit_on_error", False)  # errors are raised, and gpo.cli.run prints them short
        kwargs.setdefault("formatter_class", helptext.HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)  # --trainer.max_step is a mistake, not --trainer.max_steps
        parser = super().init_parser(**kwargs)
        helptext.describe_config(parser)
        return parser

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict, subparser_kwargs: dict) -> None:
        for name, line in helptext.SUBCOMMANDS.items():
            subparser_kwargs.setdefault(name, {}).setdefault("description", helptext.description(line))
        main_kwargs.setdefault("prog", "gpo")  # not python -m gpo.cli's __main__.py
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        names = helptext.SUBCOMMANDS if add_subcommands else [None]  # None: a CLI built with run=False
        for name in names:  # every argument is added now, --seed_everything and --ckpt_path included
            helptext.describe_seed(self._parser(name))
            if self.focused_help:
                helptext.focus(self._parser(name), name or "fit")

    def parse_arguments(self, parser, args) -> None:
        if isinstance(args, list | tuple):
            helptext.check_class_help(args)
            args = ["--help" if arg == helptext.FULL_HELP else arg for arg in args]
        self.config = parser.parse_args(args)
        subcommand = self.config.get("subcommand")
        settings = self.config[subcommand] if subcommand else self.config
        if settings.get("seed_everything") is True:  # a seed drawn at random, as the help says (Lightning's is 0)
            settings["seed_everything"] = secrets.randbelow(2**31)
            print(f"seed_everything: true drew the seed {settings['seed_everything']} (recorded in the run's "
                  "config.yaml; give it as --seed_everything to replay the run)", file=sys.stderr)  # fmt: skip

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments(("model.policy", "model.tokenizer"), "data.tokenizer", compute_fn=_tokenizer_folder)
        parser.set_defaults({"model.engine": {"class_path": "gpo.rollout.HFEngine"}})
        parser.add_argument("--model.rewards.help", action=helptext.RewardClassHelp)
        parser.add_argument(
            "--export",
            type=Literal["merged", "adapter", "none"],
            default="merged",
            help="gpo fit: save the policy to <log dir>/export when training ends: merged (LoRA merged into the "
            "weights), adapter (the LoRA adapter alone) or none",
        )

    def before_instantiate_classes(self) -> None:
        """A new run in the folder of an earlier one is refused before the model loads (a minute for a large one)
        when its checkpoints are gpo's default ones; a checkpoint callback of one's own checks when the fit starts."""
        trainer = self._get(self.config, "trainer", default={}) or {}
        own = [str(callback.get("class_path", "")) for callback in _as_list(trainer.get("callbacks"))]
        default_checkpoints = trainer.get("enable_checkpointing") is not False and not any(
            "Checkpoint" in c for c in own
        )
        if self.subcommand == "fit" and self._get(self.config, "ckpt_path") is None and default_checkpoints:
            check_no_earlier_run(Path(trainer.get("default_root_dir") or os.getcwd()) / "checkpoints")

    def instantiate_trainer(self, **kwargs):
        # A logger default in the parser could not follow --trainer.default_root_dir, so fill it in here.
        trainer = {**self._get(self.config_init, "trainer", default={})}
        check_trainer_loop(trainer.get("gradient_clip_val"), trainer.get("accumulate_grad_batches", 1))
        root = trainer.get("default_root_dir") or os.getcwd()
        if trainer.get("logger") in (None, True) and "logger" not in kwargs:
            resuming = self.subcommand == "fit" and self._get(self.config_init, "ckpt_path") is not None
            kwargs["logger"] = default_loggers(root, resume=resuming)
            self.new_version = not resuming
        configured = _as_list(trainer.get("callbacks"))
        callbacks = [*configured, *(self._get(self.config_init, k) for k in self._callback_keys())]
        added = []
        wants_checkpoints = trainer.get("enable_checkpointing") is not False
        if wants_checkpoints and not any(isinstance(c, ModelCheckpoint) for c in callbacks):
            added.append(ResumeCheckpoint())
        export = self._get(self.config_init, "export", default="merged")
        if export != "none" and not any(isinstance(c, ExportPolicy) for c in callbacks):
            added.append(ExportPolicy(mode=export))
        wants_progress = trainer.get("enable_progress_bar") is not False
        if wants_progress and not any(isinstance(c, ProgressBar) for c in callbacks):
            added.append(StepProgressBar())
        if added:
            kwargs["callbacks"] = [*configured, *added]
        return super().instantiate_trainer(**kwargs)

    def _callback_keys(self) -> list[str]:
        return list(self._parser(self.subcommand).callback_keys) if self.subcommand else []


class RunConfig(SaveConfigCallback):
    """Saves the run's configuration as ``config.yaml`` in its log folder; a later run in the same folder (a resume
    appending to it, or a run whose logger has a fixed folder) keeps that file and saves its own next to it as
    ``config-N.yaml``. So ``config.yaml`` stays the configuration that wrote the run's first checkpoint, which a
    refused resume points to (a configuration that changes the run is refused); a run refused at set-up removes the
    file it saved."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.trained = False  # whether this process ran a training batch

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.save_to_log_dir and not self.already_saved:
            folder = Path(trainer.log_dir)  # a collective: every rank calls it
            name = free_config_name(folder) if trainer.is_global_zero else None
            self.config_filename = trainer.strategy.broadcast(name)
        super().setup(trainer, pl_module, stage)

    @override
    def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
        self.trained = True

    def discard_if_unused(self, trainer: Trainer) -> None:
        """Remove the ``config-N.yaml`` this run saved next to an earlier run's ``config.yaml`` if it stopped before
        its first training batch (refused at set-up). Global rank 0 alone; no collective."""
        if trainer.is_global_zero and self.already_saved and not self.trained and self.config_filename != "config.yaml":
            (Path(trainer.log_dir) / self.config_filename).unlink(missing_ok=True)


def free_config_name(folder: Path) -> str:
    """``config.yaml``, or the first ``config-N.yaml`` (N = 2, 3, ...) not yet in ``folder``."""
    names = ["config.yaml", *(f"config-{n}.yaml" for n in range(2, 10_000))]
    return next(name for name in names if not (folder / name).exists())


def quiet_lightning() -> None:
    """Leave out what Lightning prints that a gpo user cannot act on: its tips advertising its cloud services, the
    deprecation warning its own pytree helper raises under torch 2.13, and its advice on evaluation metrics of a
    one-process run (``ResumeCheckpoint`` leaves out its hint for a ``--ckpt_path last`` that finds no checkpoint)."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        drop_messages(name, "\N{ELECTRIC LIGHT BULB} Tip:")
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # an in-process vLLM engine starts torch.distributed (a world of one), and Lightning then asks for sync_dist on
    # every evaluation metric of a one-process run; gpo's evaluation logs with sync_dist where it counts
    warnings.filterwarnings("ignore", message=r"It is recommended to use `self.log\('val/")


def _tokenizer_folder(policy, tokenizer) -> str:
    """The data module tokenises prompts with ``model.tokenizer`` when it names a folder, else the policy's."""
    return tokenizer if isinstance(tokenizer, str) else policy


def _as_list(value) -> list:
    return [] if value is None else list(value) if isinstance(value, list | tuple) else [value]
