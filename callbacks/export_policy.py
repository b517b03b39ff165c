"""ExportPolicy: save the trained policy as a transformers folder when training ends."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from lightning import Callback, LightningModule, Trainer
from typing_extensions import override

from gpo.train.hooks import require_source

ExportMode = Literal["merged", "adapter"]


class ExportPolicy(Callback):
    """Writes the trained policy and its tokenizer to a folder when training ends.

    When training ends, writes the policy and its tokenizer to ``<log dir>/export`` (or ``folder``) with
    ``save_pretrained``: a folder that transformers and vLLM load. A LoRA policy is saved merged into its base
    weights (``merged``: a plain model folder) or as the adapter alone (``adapter``: load it with peft on top of the
    base model); the trained model itself is left untouched. The folder appears whole or not at all, and must be
    new, empty or an earlier export (replaced whole): one holding other files is refused when the fit sets up.

    ``gpo fit`` adds one unless ``export: none``. Refused under FSDP (the policy is sharded over the processes;
    exporting a sharded run is not built yet).

    What the LightningModule must provide: ``gpo.train.hooks.RolloutSource``'s ``policy`` and ``tokenizer``.

    Args:
        mode: ``merged`` or ``adapter`` (LoRA runs; a fully fine-tuned policy is saved whole either way).
        folder: where to write; None: ``<trainer.log_dir>/export`` (``default_root_dir`` without a logger).
    """

    def __init__(self, *, mode: ExportMode = "merged", folder: str | None = None) -> None:
        if mode not in ("merged", "adapter"):
            raise ValueError(f"ExportPolicy mode={mode!r} is not valid; choose 'merged' or 'adapter'.")
        if folder is not None and not isinstance(folder, str | os.PathLike):
            raise ValueError(f"ExportPolicy folder={folder!r} must be a path, or None for <log dir>/export.")
        self.mode, self.folder = mode, folder
        self._exported = False  # by this fit

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        from gpo.models.export import check_export_folder
        from gpo.parallel.fsdp import is_sharded

        require_source(self, pl_module, ("policy", "tokenizer"))
        if stage == "fit":
            check_export_folder(self._folder(trainer), "ExportPolicy folder")  # refused now, not after the training
        if is_sharded(trainer.strategy):
            raise ValueError(
                "exporting under FSDP is not supported yet (the policy is sharded over the processes): set "
                "export: none (configs/fsdp.yaml does); to export a checkpoint later with gpo export, write it as one "
                "file: --trainer.strategy.init_args.save_distributed_checkpoint false."
            )

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._exported = False

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from gpo.models.export import export_policy

        folder = self._folder(trainer)  # on every rank: trainer.log_dir broadcasts rank 0's
        if trainer.is_global_zero:
            export_policy(pl_module.policy, pl_module.tokenizer, folder, merge=self.mode == "merged")
        self._exported = True

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A fit with nothing left to train (resumed from its last step's checkpoint: a run killed during its export)
        gets no ``on_train_end`` from Lightning, and ended without the export."""
        if not self._exported:
            self.on_train_end(trainer, pl_module)

    def _folder(self, trainer: Trainer) -> Path:
        """``folder``, else ``<log dir>/export``; to be asked on every rank (``trainer.log_dir`` is a collective)."""
        return Path(self.folder or Path(trainer.log_dir or trainer.default_root_dir) / "export")
