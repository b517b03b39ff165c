"""The configs shipped with gpo (``gpo.configs``, the repository's configs/ folder) and how ``--config`` finds them:
a value that names no file where ``gpo`` runs, and is a bare name (``quickstart``, ``dapo.yaml``), is the shipped
config of that name; which of a command's configs sets a key; and the set-up steps a config's header names, for a run
that misses their output."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from gpo.suggest import closest_file, did_you_mean

if TYPE_CHECKING:
    from gpo.algo.presets import Algorithm

#: A ``--config`` value that may name a shipped config: no folder part, not inline YAML or JSON.
_BARE_NAME = re.compile(r"[\w.-]+")
#: A ``--config`` value that is a file's path, not inline YAML or JSON.
_PATH = re.compile(r"[\w./~-]+")
_CONFIG_FLAGS = ("--config", "-c")


def shipped_configs() -> dict[str, Path]:
    """The shipped YAML configs by name (the file name without ``.yaml``), sorted."""
    folder = files("gpo.configs")
    found = {Path(entry.name).stem: Path(str(entry)) for entry in folder.iterdir() if entry.name.endswith(".yaml")}
    return dict(sorted(found.items()))


def config_path(value: str, argument: str = "--config") -> str:
    """The file a ``--config`` value names: ``value`` itself when it is a file here or inline YAML, else the shipped
    config of that name, with or without ``.yaml``; ``argument`` names the value in errors."""
    path = Path(value).expanduser()
    if path.is_file() or not _PATH.fullmatch(value):
        return value
    if not _BARE_NAME.fullmatch(value):  # a path with a folder part: never a shipped name
        if path.exists():  # a pipe (--config <(...)) or a folder: jsonargparse reads or refuses it
            return value
        raise _missing_file(path, argument)
    shipped = shipped_configs()
    name = value.removesuffix(".yaml").removesuffix(".yml")
    if name in shipped:
        return str(shipped[name])
    guess = did_you_mean(name, shipped, then=" Otherwise ")
    raise FileNotFoundError(
        f"{argument} {value}: no such file here, and gpo ships no config of that name; {guess}give a YAML file's path "
        f"or one of: {', '.join(shipped)}."
    )


def _missing_file(path: Path, argument: str) -> FileNotFoundError:
    """The error for a config path that names nothing, with the closest YAML file of its folder."""
    guess = closest_file(path, "*.y*ml", then=" ")
    where = "" if path.parent.is_dir() else f" (no folder {path.parent})"
    return FileNotFoundError(
        f"{argument} {path}: no such file{where}; {guess}a shipped config can also be given by name, e.g. "
        "quickstart (gpo fit --help lists them)."
    )


def with_shipped_configs(args: list[str]) -> list[str]:
    """``args`` with every ``--config``/``-c`` value that names a shipped config replaced by that config's path."""
    resolved = list(args)
    for index, arg in enumerate(args):
        if arg in _CONFIG_FLAGS and index + 1 < len(args):
            resolved[index + 1] = config_path(args[index + 1])
        elif arg.startswith("--config="):
            resolved[index] = "--config=" + config_path(arg.removeprefix("--config="))
    return resolved


def shipped_algorithm(name: str) -> Algorithm:
    """The algorithm the shipped config ``name`` selects (its ``model.algorithm``), built with the values it sets."""
    from jsonargparse import ArgumentParser

    from gpo.algo.presets import Algorithm

    spec = yaml.safe_load(shipped_configs()[name].read_text())["model"]["algorithm"]
    parser = ArgumentParser()
    parser.add_argument("--algorithm", type=Algorithm)
    return parser.instantiate(parser.parse_object({"algorithm": spec})).algorithm


def config_files(args: list[str]) -> list[str]:
    """The files named by ``--config``/``-c`` in ``args`` (after ``with_shipped_configs``)."""
    found = []
    for index, arg in enumerate(args):
        if arg in _CONFIG_FLAGS and index + 1 < len(args):
            found.append(args[index + 1])
        elif arg.startswith("--config="):
            found.append(arg.removeprefix("--config="))
    return found


def command_line_keys(args: list[str]) -> set[str]:
    """The settings ``args`` give as flags (``--data.path x``, ``--model.group_size=4``), as written: a message about
    one of them names no config file."""
    return {arg[2:].partition("=")[0] for arg in args if arg.startswith("--") and arg not in _CONFIG_FLAGS}


def given_on_command_line(key: str, flags: Iterable[str]) -> bool:
    """Whether ``key`` (``model.engine.init_args.sampling``), a setting under it or one holding it is among
    ``flags``."""
    written = key.replace(".init_args.", ".")
    flags = {flag.replace(".init_args.", ".") for flag in flags}
    return any(flag == written or flag.startswith(written + ".") or written.startswith(flag + ".") for flag in flags)


#: A config's set-up step, in its header comment: ``# Set up ...:  COMMAND``.
_SETUP = re.compile(r"\bSet up\b[^:]*:\s+(\S.*)")


def setup_steps(config_files: Iterable[str]) -> list[str]:
    """What the header comments of ``config_files`` say to run first (``# Set up ...:  COMMAND``), one line each, for
    the steps not run yet here: a model or data file that is missing usually means that step was not run. A step
    whose output folders (its arguments with a ``/``) all exist has been run: the path is mistyped instead."""
    steps = []
    for name in config_files:
        path = Path(name)
        if not path.is_file():
            continue
        header = itertools.takewhile(lambda line: line.startswith("#"), path.read_text().splitlines())
        found = [match.group(1).strip() for match in map(_SETUP.search, header) if match]
        steps.extend(
            f"{path.name} needs its set-up step run first: {command}" for command in found if not _ran(command)
        )
    return steps


def _ran(command: str) -> bool:
    """Whether every folder ``command`` names (its words with a ``/`` that are not options) exists here."""
    outputs = [word for word in command.split() if "/" in word and not word.startswith("-")]
    return bool(outputs) and all(Path(word).exists() for word in outputs)


#: What ``_lookup`` returns for a key a config does not set (None is a value a config may set).
_MISSING = object()


def file_holding(key: str, config_files: Iterable[str], value: str | None = None) -> str | None:
    """The last of ``config_files`` whose YAML sets ``key`` (or a key under it), for the message; with ``value``
    (the rejected value as jsonargparse prints it), only a file that sets it to that value (or, for a list such as
    ``model.rewards``, to a list holding it)."""
    found = None
    for name in config_files:
        try:
            tree = yaml.safe_load(Path(name).read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        for parts in (key.replace(".init_args.", ".").split("."), key.split(".")):
            held = _lookup(tree, parts)
            items = held if isinstance(held, list) else []  # jsonargparse names the one item of a list it refused
            if held is not _MISSING and (value is None or value in map(str, [held, *items])):
                found = name
    return found


def _lookup(tree: Any, parts: list[str]) -> Any:
    """The value ``tree`` holds at ``parts`` (through ``init_args`` where a class was chosen), or ``_MISSING``."""
    for index, part in enumerate(parts):
        if not isinstance(tree, dict):
            return _MISSING
        if part not in tree:
            init_args = tree.get("init_args")
            return _lookup(init_args, parts[index:]) if isinstance(init_args, dict) else _MISSING
        tree = tree[part]
    return tree
