"""The configs shipped with gpo (``gpo.configs``, the repository's configs/ folder) and how ``--config`` finds them:
a value that names no file where ``gpo`` runs, and is a bare name (``quickstart``, ``dapo.yaml``), is the shipped
config of that name."""

from __future__ import annotations

import re
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING

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
    import yaml
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
