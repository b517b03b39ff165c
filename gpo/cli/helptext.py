"""What ``gpo fit --help`` shows: gpo's own settings first, the most used of Lightning's trainer settings after them,
and how to reach the rest (``--help-all``, nested settings, algorithm names, shipped configs)."""

from __future__ import annotations

import argparse
import importlib
import inspect
import textwrap
from collections.abc import Sequence
from typing import Any

from jsonargparse import ArgumentParser, DefaultHelpFormatter

from gpo.cli.shipped import shipped_configs
from gpo.suggest import did_you_mean

#: The Trainer methods ``gpo`` runs, with their line in ``gpo --help`` (GPOModule has no test or predict step).
SUBCOMMANDS = {
    "fit": "train a policy, e.g. gpo fit --config quickstart",
    "validate": "evaluate a policy or a checkpoint (--ckpt_path) on the held-out prompts, without training",
}
#: The flag that shows Lightning's full help instead of the focused one.
FULL_HELP = "--help-all"
#: Lightning's trainer settings that the focused help keeps (the others are still accepted; --help-all lists them).
TRAINER_KEYS = (
    "trainer.max_steps",
    "trainer.accelerator",
    "trainer.devices",
    "trainer.strategy",
    "trainer.precision",
    "trainer.default_root_dir",
    "trainer.val_check_interval",
    "trainer.log_every_n_steps",
    "trainer.enable_progress_bar",
)
SETTINGS = (
    "Settings come from YAML files (--config) and flags (--model.group_size 8), later ones overriding earlier ones: "
    "gpo's are model.*, data.* and export, Lightning's trainer.*."
)
CONFIG_HELP = (
    "a YAML file, or the name of a config shipped with gpo (e.g. quickstart, dapo); give --config several times to "
    "combine files, later ones overriding earlier ones."
)
SEED_HELP = (
    "the run's seed, which sets the data order, the sampling and a LoRA adapter's initial weights (the same seed "
    "replays the run); true draws one at random (printed, and recorded in the run's config.yaml); false seeds nothing"
)
PRECISION_HELP = (
    "what gpo trains with: 32-true (the default), bf16-mixed (bfloat16 autocast) or 16-mixed (float16 autocast with "
    "loss scaling, on a GPU); Lightning's *-true half precisions are refused: for bfloat16 weights set model.dtype"
)
#: ``--ckpt_path`` of each subcommand, as gpo uses it (Lightning's text offers ``best``, ``hpc`` and ``registry``).
CKPT_PATH_HELP = {
    "fit": "continue a run: last (trainer.default_root_dir/checkpoints/last.ckpt; a run with none yet starts from "
    "the initial weights) or a .ckpt file",
    "validate": "evaluate a checkpoint: last (trainer.default_root_dir/checkpoints/last.ckpt) or a .ckpt file; "
    "none: the policy as model.policy loads it",
}


def description(line: str) -> str:
    """A subcommand's help text from its line in ``gpo --help``, with where its settings come from."""
    return textwrap.fill(f"{line[0].upper()}{line[1:]}. {SETTINGS}", 100)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultHelpFormatter):
    """jsonargparse's formatter (types and defaults), with the description and epilog printed as written."""


class RewardClassHelp(argparse.Action):
    """``--model.rewards.help CLASS``: a reward class's settings, as ``--model.kl.help KLPenalty`` shows a part's
    (jsonargparse gives a list of functions no such flag). ``CLASS``: a class of ``gpo.rewards`` by name, or an import
    path."""

    def __init__(self, option_strings: Sequence[str], dest: str, **_: Any) -> None:
        super().__init__(option_strings, dest, metavar="CLASS_PATH_OR_NAME", default=argparse.SUPPRESS,
                         help="Show the help for the given reward class and exit.")  # fmt: skip

    def __call__(self, parser: ArgumentParser, namespace: Any, value: Any, option_string: str | None = None) -> None:
        reward = reward_class(value, f"{option_string} {value}")
        subparser = ArgumentParser(
            prog=parser.prog,
            description=f"Help for {option_string}={reward.__module__}.{reward.__qualname__}",
            formatter_class=HelpFormatter,
            add_help=False,
        )
        key = self.dest.removesuffix(".help")
        subparser.add_class_arguments(reward, key)
        for action in subparser._actions:
            if action.dest == key:  # the nested config file's flag: the settings are the help's subject
                action.help = argparse.SUPPRESS
        subparser.print_help()
        parser.exit()


#: The rollout engines gpo ships, by import path (the vLLM ones are not among ``gpo.rollout``'s names: importing them
#: imports vLLM's client code, seconds that a help request should not pay).
ENGINES = (
    "gpo.rollout.HFEngine",
    "gpo.rollout.MultiTurnEngine",
    "gpo.rollout.vllm.VLLMEngine",
    "gpo.rollout.vllm_server.VLLMServerEngine",
)


#: The settings whose type is an abstract base, with the module whose classes they take and that base's name there;
#: gpo.algo's classes are given by name, the others by import path.
ABSTRACT_SETTINGS = {
    "model.mixer": ("gpo.algo", "RewardMixer"),
    "model.algorithm": ("gpo.algo", "Algorithm"),
    "model.token_weights": ("gpo.algo", "TokenWeight"),
    "model.masks": ("gpo.algo", "TokenMask"),
    "model.teacher": ("gpo.models.teacher", "Teacher"),
    "data.path": ("gpo.tasks", "GeneratedTask"),
    "data.val_path": ("gpo.tasks", "GeneratedTask"),
}
#: Nested settings whose ``.help`` shows nothing a person sets (a loaded model or tokenizer object): not offered.
NO_NESTED_HELP = ("--model.policy.help", "--model.tokenizer.help")


def setting_classes(setting: str) -> list[str]:
    """The classes gpo ships for ``setting`` (``model.engine`` or one of ``ABSTRACT_SETTINGS``), as a config names
    them."""
    if setting == "model.engine":
        return list(ENGINES)
    module_name, base_name = ABSTRACT_SETTINGS[setting]
    module = importlib.import_module(module_name)
    base = getattr(module, base_name)
    if module_name == "gpo.algo":
        return [name for name in module.__all__ if _concrete_subclass(getattr(module, name), base)]
    defined = [m for m in vars(module).values() if _concrete_subclass(m, base) and m.__module__ == module_name]
    return [f"{module_name}.{cls.__name__}" for cls in defined]


def _concrete_subclass(member: object, base: type) -> bool:
    return inspect.isclass(member) and issubclass(member, base) and not inspect.isabstract(member)


def check_class_help(args: Sequence[str]) -> None:
    """``--model.engine.help`` (or another setting whose type is an abstract base) given no class: print the classes
    there are and exit, for jsonargparse would show the help of the abstract base, which has no settings."""
    for index, arg in enumerate(args):
        setting = arg.removeprefix("--").removesuffix(".help")
        given = index + 1 < len(args) and not args[index + 1].startswith("-")
        if arg == f"--{setting}.help" and (setting == "model.engine" or setting in ABSTRACT_SETTINGS) and not given:
            classes = setting_classes(setting)
            print(f"The {setting} classes gpo ships: {', '.join(classes)} (a class of one's own by its import path)."
                  f"\n{arg} takes one of them, as in gpo fit {arg} {classes[0].rpartition('.')[2]}")  # fmt: skip
            raise SystemExit(0)


def reward_class(value: str, label: str) -> type:
    """The reward class ``value`` names (a ``gpo.rewards`` name or an import path); a ValueError starting with
    ``label`` when it names none."""
    import gpo.rewards

    module_name, _, name = (value if "." in value else f"gpo.rewards.{value}").rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as err:
        shipped = sorted(name for name in gpo.rewards.__all__ if _is_reward(getattr(gpo.rewards, name)))
        guess = did_you_mean(value, shipped, then=" ")
        raise ValueError(f"{label}: {err}; {guess}gpo.rewards has the classes {', '.join(shipped)}, and a class of "
                         "one's own is given by its import path (my_rewards.MyReward).") from None  # fmt: skip
    if not inspect.isclass(found):
        raise ValueError(f"{label}: {value} is a function, which takes no settings; its docstring: "
                         f"python -c 'help(\"{module_name}.{name}\")'.")  # fmt: skip
    return found


def _is_reward(member: object) -> bool:
    """A reward class one can give: a concrete class whose instances are called (not an error or an abstract base)."""
    return (
        inspect.isclass(member)
        and inspect.isfunction(member.__call__)
        and not inspect.isabstract(member)
        and not issubclass(member, BaseException)
    )


def describe_config(parser: ArgumentParser) -> None:
    """``--config`` takes a shipped config's name too (``gpo.cli.shipped``): say so in its help."""
    for action in parser._actions:
        if "--config" in action.option_strings:
            action.help = CONFIG_HELP


def describe_seed(parser: ArgumentParser) -> None:
    """``--seed_everything`` as gpo takes it (``gpo.cli.fit.GPOCLI``): Lightning's text promises a random seed for
    true, which its ``seed_everything`` turns into 0."""
    for action in parser._actions:
        if "--seed_everything" in action.option_strings:
            action.help = SEED_HELP


def focus(parser: ArgumentParser, subcommand: str) -> None:
    """Make ``parser``'s help gpo's: Lightning's trainer settings other than ``TRAINER_KEYS`` left out of it (they
    stay valid settings), as are ``NO_NESTED_HELP``, ``--trainer.precision`` and ``--ckpt_path`` described as gpo
    uses them, and the trainer group moved after gpo's groups, with ``epilog`` below."""
    for action in parser._actions:
        trainer_flag = any(flag == "--trainer" or flag.startswith("--trainer.") for flag in action.option_strings)
        if (trainer_flag and action.dest not in TRAINER_KEYS) or set(action.option_strings) & set(NO_NESTED_HELP):
            action.help = argparse.SUPPRESS
        if action.dest == "trainer.precision":
            action.help = PRECISION_HELP
        if action.dest == "ckpt_path":
            action.help = CKPT_PATH_HELP[subcommand]
            action.container.title, action.container.description = "Checkpoint", None
    trainer = parser.groups["trainer"]
    trainer.title = f"Lightning's Trainer, its most used settings ({FULL_HELP} lists all of them)"
    trainer.description = None
    parser._action_groups.remove(trainer)
    parser._action_groups.append(trainer)
    parser.usage = "%(prog)s [--config FILE|NAME]... [--model.KEY VALUE] [--data.KEY VALUE] [--trainer.KEY VALUE] ..."
    parser.epilog = epilog(parser)


def epilog(parser: ArgumentParser) -> str:
    """Where the settings the focused help cannot show are: nested groups, algorithms, shipped configs, the rest."""
    from gpo.algo import presets

    nested = [flag for action in parser._actions for flag in action.option_strings if _nested_help(flag)]
    names = ", ".join(presets.ALGORITHMS)
    classes = [presets.Custom, *presets.PRESETS]
    return "\n".join(
        [
            "Algorithms (model.algorithm):",
            _wrap(f"by name, with the preset's defaults: {names}."),
            _wrap(f"by class, to change its settings: {', '.join(cls.__name__ for cls in classes)}."),
            _wrap(
                "A class's settings: gpo fit --model.algorithm.help DAPO; set one: --model.algorithm=DAPO "
                "--model.algorithm.clip_high=0.28."
            ),
            "",
            "Nested settings (a group's fields, or a class's settings with its name):",
            _wrap(", ".join(nested) + "."),
            "",
            "Shipped configs (--config NAME):",
            _wrap(", ".join(shipped_configs()) + "."),
            "",
            "More:",
            _wrap(
                f"Lightning's other Trainer settings: gpo fit {FULL_HELP}. trainer.max_steps counts optimiser steps "
                "(model.optim.number_of_minibatches x ppo_epochs per rollout); the step column of metrics.csv "
                "counts rollouts. See docs/cli.md."
            ),
        ]
    )


def _nested_help(flag: str) -> bool:
    """A ``--model.X.help`` / ``--data.X.help`` flag: the help of a nested group or class (not the trainer's, nor
    ``NO_NESTED_HELP``)."""
    return flag.endswith(".help") and flag.startswith(("--model.", "--data.")) and flag not in NO_NESTED_HELP


def _wrap(text: str, width: int = 100) -> str:
    return textwrap.fill(text, width, initial_indent="  ", subsequent_indent="  ")
