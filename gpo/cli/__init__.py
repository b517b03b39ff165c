"""The ``gpo`` command: ``gpo fit --config configs/grpo.yaml`` (LightningCLI), ``gpo tiny OUT`` (local test assets),
``gpo plot RUN_DIR`` (reward and length curves) and ``gpo export CONFIG CKPT OUT`` (checkpoint to transformers)."""

from __future__ import annotations

import os
import sys

from jsonargparse import ArgumentError

from gpo.cli.commands import export_checkpoint_command, make_tiny, plot_curves
from gpo.cli.errors import explain
from gpo.cli.fit import GPOCLI, default_loggers

COMMANDS = {"tiny": make_tiny, "plot": plot_curves, "export": export_checkpoint_command}
#: Errors that report a configuration or input problem in words a person can act on: printed without traceback.
USER_ERRORS = (
    ArgumentError,
    ValueError,
    TypeError,
    FileNotFoundError,
    FileExistsError,
    ImportError,
    TimeoutError,
    FloatingPointError,
)

__all__ = ["GPOCLI", "default_loggers", "main", "run"]


def main(argv: list[str] | None = None) -> None:
    """Run a ``gpo`` command; ``argv`` defaults to the command line."""
    from gpo.train.data import PromptDataModule
    from gpo.train.module import GPOModule

    args = sys.argv[1:] if argv is None else argv
    if args[:1] and args[0] in COMMANDS:
        COMMANDS[args[0]](args[1:])
        return
    GPOCLI(GPOModule, PromptDataModule, args=args, save_config_kwargs={"overwrite": True})


def run(argv: list[str] | None = None) -> None:
    """The console entry point: ``main``, with configuration and input errors printed as a short message naming the
    setting and the fix (exit status 2) instead of a traceback. ``GPO_TRACEBACK=1`` shows the traceback."""
    from gpo.train.checkpointing import CheckpointError

    args = sys.argv[1:] if argv is None else argv
    try:
        main(args)
    except (*USER_ERRORS, CheckpointError) as error:
        if os.environ.get("GPO_TRACEBACK"):
            raise
        command = " ".join(["gpo", *args[:1]])
        text = explain(str(error), config_files(args), known_groups())
        print(f"{command}: error: {text}\n(GPO_TRACEBACK=1 shows the traceback; {command} --help lists the settings)",
              file=sys.stderr)  # fmt: skip
        sys.exit(2)


def config_files(args: list[str]) -> list[str]:
    """The files named by ``--config``/``-c`` in ``args``."""
    files = []
    for index, arg in enumerate(args):
        if arg in ("--config", "-c") and index + 1 < len(args):
            files.append(args[index + 1])
        elif arg.startswith("--config="):
            files.append(arg.split("=", 1)[1])
    return files


def known_groups() -> dict[str, type]:
    """The classes whose constructor parameters are the keys of each configuration group (for "did you mean")."""
    from lightning import Trainer

    from gpo.algo import EntropyBonus, KLPenalty, RolloutCorrection, StepRewards
    from gpo.models.loading import LoraSettings
    from gpo.rewards.runner import RewardErrors
    from gpo.rollout import Sampling
    from gpo.train.data import PromptDataModule
    from gpo.train.evaluation import Evaluation
    from gpo.train.module import GPOModule
    from gpo.train.optimization import Optimization

    return {
        "model": GPOModule, "model.optim": Optimization, "model.evaluation": Evaluation, "model.lora": LoraSettings,
        "model.reward_errors": RewardErrors, "model.kl": KLPenalty, "model.entropy": EntropyBonus,
        "model.correction": RolloutCorrection, "model.step_rewards": StepRewards,
        "model.engine.init_args.sampling": Sampling, "data": PromptDataModule, "trainer": Trainer,
    }  # fmt: skip
