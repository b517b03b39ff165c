"""``gpo fit``: LightningCLI over GPOModule and PromptDataModule, with gpo's defaults (engine, loggers, checkpoints,
export) and configuration errors that name the key, the file and the fix."""

from __future__ import annotations

import os
from typing import Literal

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

from gpo.callbacks import ExportPolicy, ResumeCheckpoint
from gpo.train.loggers import default_loggers


class GPOCLI(LightningCLI):
    """LightningCLI whose data module reads the policy's tokenizer unless told otherwise, whose rollout engine is
    transformers' ``generate`` (``HFEngine``) unless ``model.engine`` names another, which logs to CSV and
    TensorBoard under ``trainer.default_root_dir`` unless ``--trainer.logger`` says otherwise, which keeps
    ``<default_root_dir>/checkpoints/last.ckpt`` current (``ResumeCheckpoint``) unless ``trainer.callbacks`` holds a
    ``ModelCheckpoint`` or ``trainer.enable_checkpointing`` is false, and which exports the policy when training
    ends (``ExportPolicy``) unless ``export: none``. ``--ckpt_path last`` resumes the run and appends to its newest
    log folder."""

    def __init__(self, *args, **kwargs) -> None:
        # gpo builds its optimiser from model.optim: Lightning's --optimizer / --lr_scheduler would be ignored
        kwargs.setdefault("auto_configure_optimizers", False)
        super().__init__(*args, **kwargs)

    def init_parser(self, **kwargs):
        kwargs.setdefault("exit_on_error", False)  # errors are raised, and gpo.cli.run prints them short
        return super().init_parser(**kwargs)

    def parse_arguments(self, parser, args) -> None:
        self.config = parser.parse_args(args)

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments(("model.policy", "model.tokenizer"), "data.tokenizer", compute_fn=_tokenizer_folder)
        parser.set_defaults({"model.engine": {"class_path": "gpo.rollout.HFEngine"}})
        parser.add_argument(
            "--export",
            type=Literal["merged", "adapter", "none"],
            default="merged",
            help="save the policy to <log dir>/export when training ends: merged (LoRA merged into the weights), "
            "adapter (the LoRA adapter alone) or none",
        )

    def instantiate_trainer(self, **kwargs):
        # A logger default in the parser could not follow --trainer.default_root_dir, so fill it in here.
        trainer = {**self._get(self.config_init, "trainer", default={})}
        root = trainer.get("default_root_dir") or os.getcwd()
        if trainer.get("logger") in (None, True) and "logger" not in kwargs:
            resuming = self.subcommand == "fit" and self._get(self.config_init, "ckpt_path") is not None
            kwargs["logger"] = default_loggers(root, resume=resuming)
        configured = _as_list(trainer.get("callbacks"))
        callbacks = [*configured, *(self._get(self.config_init, k) for k in self._callback_keys())]
        added = []
        wants_checkpoints = trainer.get("enable_checkpointing") is not False
        if wants_checkpoints and not any(isinstance(c, ModelCheckpoint) for c in callbacks):
            added.append(ResumeCheckpoint())
        export = self._get(self.config_init, "export", default="merged")
        if export != "none" and not any(isinstance(c, ExportPolicy) for c in callbacks):
            added.append(ExportPolicy(mode=export))
        if added:
            kwargs["callbacks"] = [*configured, *added]
        return super().instantiate_trainer(**kwargs)

    def _callback_keys(self) -> list[str]:
        return list(self._parser(self.subcommand).callback_keys) if self.subcommand else []


def _tokenizer_folder(policy, tokenizer) -> str:
    """The data module tokenises prompts with ``model.tokenizer`` when it names a folder, else the policy's."""
    return tokenizer if isinstance(tokenizer, str) else policy


def _as_list(value) -> list:
    return [] if value is None else list(value) if isinstance(value, list | tuple) else [value]
