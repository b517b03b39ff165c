"""The ``gpo`` command: ``gpo fit --config quickstart`` (LightningCLI; ``gpo validate`` likewise), ``gpo tiny OUT``
(local test assets), ``gpo plot RUN_DIR`` (reward and length curves) and ``gpo export CONFIG CKPT OUT`` (checkpoint to
transformers). ``gpo --help`` lists them."""

from __future__ import annotations

import errno
import os
import sys
import warnings
from collections.abc import Callable
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path

from jsonargparse import ArgumentError

import gpo
from gpo import lazy_exports
from gpo.cli.blame import raised_in_user_code, with_owner
from gpo.cli.commands import export_checkpoint_command, make_tiny, plot_curves
from gpo.cli.errors import explain
from gpo.cli.helptext import SUBCOMMANDS
from gpo.cli.shipped import command_line_keys, config_files, setup_steps, with_shipped_configs
from gpo.suggest import did_you_mean

#: The small commands, by name: the function that runs one (given the arguments after its name) and its line in
#: ``gpo --help``.
COMMANDS = {
    "tiny": (make_tiny, "write a tiny random model and a synthetic task's prompts for a CPU run (no download)"),
    "plot": (plot_curves, "plot a run's reward and completion-length curves from its metrics.csv into a PNG"),
    "export": (export_checkpoint_command, "save the policy of a checkpoint as a transformers folder"),
}
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

#: How Python prints a warning: its file, line number, category, message, and the line of code.
PYTHON_WARNING_FORM = warnings.formatwarning

#: ``OSError`` numbers of a disk that refuses to be written (read-only, not allowed, full, over quota): with the path
#: in the message, which is what to fix.
UNWRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT})

__all__ = ["GPOCLI", "default_loggers", "main", "run"]
# Lightning's CLI is imported when first used: ``gpo --help`` and the small commands start without Lightning (about
# 4 s of imports).
__getattr__, __dir__, _ = lazy_exports(
    "gpo.cli", {"GPOCLI": "gpo.cli.fit", "default_loggers": "gpo.train.loggers"}, globals()
)


def main(argv: list[str] | None = None) -> None:
    """Run a ``gpo`` command; ``argv`` defaults to the command line."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(overview())
        return
    if args[0] in ("-V", "--version"):
        print(f"gpo {metadata.version('gpo')}")
        return
    if args[0] in COMMANDS:
        COMMANDS[args[0]][0](args[1:])
        return
    if args[0] not in SUBCOMMANDS and not args[0].startswith("-"):
        guess = did_you_mean(args[0], [*SUBCOMMANDS, *COMMANDS])
        raise ValueError(f"unknown command {args[0]!r}" + (f"; {guess}" if guess else ""))
    from gpo.cli.fit import GPOCLI, RunConfig
    from gpo.train.data import PromptDataModule
    from gpo.train.module import GPOModule

    args = with_shipped_configs(args)
    GPOCLI(GPOModule, PromptDataModule, args=args, save_config_callback=RunConfig)


def overview() -> str:
    """``gpo --help``: every command with its line."""
    lines = {**SUBCOMMANDS, **{name: line for name, (_, line) in COMMANDS.items()}}
    width = max(map(len, lines)) + 2
    return "\n".join(
        [
            "usage: gpo COMMAND [options]",
            "",
            "Group-based policy optimisation (GRPO and its family) of language models, on PyTorch Lightning.",
            "",
            "commands:",
            *(f"  {name:<{width}}{line}" for name, line in lines.items()),
            "",
            "gpo COMMAND --help shows a command's options; docs/cli.md has more. gpo --version: the version.",
        ]
    )


def run(argv: list[str] | None = None) -> None:
    """The console entry point: ``main``, with configuration and input errors printed as a short message naming the
    setting and the fix (exit status 2) instead of a traceback. ``GPO_TRACEBACK=1`` shows the traceback.

    The working directory goes on the import path, last (so it shadows no installed package), as ``python -m`` would
    put it first: ``model.rewards: [my_rewards.fn]`` finds ``./my_rewards.py``."""
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    args = sys.argv[1:] if argv is None else argv
    command = " ".join(["gpo", *(args[:1] if args[:1] and args[0] in (*SUBCOMMANDS, *COMMANDS) else [])])
    warnings.formatwarning = gpo_warnings_in_words(command, PYTHON_WARNING_FORM)
    try:
        args = with_shipped_configs(args)
        main(args)
    except KeyboardInterrupt:  # outside a fit, which stops at Ctrl-C itself: while libraries import or a model loads
        print(f"\n{command}: stopped (Ctrl-C)", file=sys.stderr)
        sys.exit(130)  # 128 + SIGINT, what shells report
    except Exception as error:
        if not is_user_error(error) or os.environ.get("GPO_TRACEBACK"):
            raise
        files = config_files(args)
        text = with_owner(explain(str(error), files, known_groups(), command_line_keys(args)), error)
        where = raised_in_user_code(error)
        text = f"{text} (raised at {where})" if where is not None else text
        if isinstance(error, FileNotFoundError):  # a missing model or data file: the config's set-up step not run?
            text = "\n".join([text, *setup_steps(files)])
        lists = "the settings" if command != "gpo" else "the commands"  # no command, or an unknown one
        print(f"{command}: error: {text}\n(GPO_TRACEBACK=1 shows the traceback; {command} --help lists {lists})",
              file=sys.stderr)  # fmt: skip
        sys.exit(2)


def gpo_warnings_in_words(command: str, python_form: Callable[..., str]) -> Callable[..., str]:
    """A ``warnings.formatwarning`` that prints gpo's own warnings as ``gpo fit: warning: MESSAGE`` (each says what
    to do; the file and code line Python prints with it are gpo's insides) and others in ``python_form``."""
    own = [Path(folder).resolve() for folder in (*gpo.__path__, *find_spec("gpo.callbacks").submodule_search_locations)]

    def format_warning(message, category, filename, lineno, line=None) -> str:
        if any(Path(filename).resolve().is_relative_to(folder) for folder in own):
            return f"{command}: warning: {message}\n"
        return python_form(message, category, filename, lineno, line)

    return format_warning


def is_user_error(error: Exception) -> bool:
    """Whether ``error`` reports a configuration or input problem (``USER_ERRORS``, a checkpoint that cannot be used,
    a trainer setting Lightning refuses, a task app, judge or server that is down or refuses: its message names the
    address and the fix; a run whose batches are all skipped; or a folder that cannot be written, named by its
    path), which ``run`` prints as a short message."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException  # only once something has failed

    from gpo.envs.http import ServiceError
    from gpo.train.checkpointing import CheckpointError
    from gpo.train.module import RunStalled

    unwritable = isinstance(error, OSError) and error.errno in UNWRITABLE and error.filename is not None
    known = (*USER_ERRORS, CheckpointError, MisconfigurationException, ServiceError, RunStalled)
    return unwritable or isinstance(error, known)


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
