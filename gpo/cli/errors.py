"""Configuration errors as a person reads them: the key, what is wrong with it, where it came from and what to do.

jsonargparse reports an unknown or invalid key with the parser's whole usage and every union member it tried; this
turns that into a few lines: the key, the setting's known neighbours (did you mean ...), the YAML file that holds
it, and, for settings that moved when gpo's configuration was reorganised, their new place.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import re
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from gpo.cli.moved import ELSEWHERE_KEYS, MOVED_KEYS, MOVED_PATHS, REPLACED_KEYS
from gpo.cli.shipped import file_holding, given_on_command_line
from gpo.suggest import did_you_mean

#: The settings at the top of ``gpo fit`` and ``gpo validate`` (the groups, and Lightning's and gpo's own flags).
TOP_LEVEL_KEYS = ("model", "data", "trainer", "seed_everything", "ckpt_path", "export", "config", "print_config")
JSONARGPARSE_MARKERS = (
    "Parser key", "does not accept option", "unrecognized arguments", "Does not validate against", "is not accepted",
)  # fmt: skip
_LIST_INDEX = re.compile(r"\.\d+(?=\.|$)")  # a list item's index in a dotted key: model.rewards.1.init_args.x
#: An unknown key: from a config file (in a group, or at the top level) or from the command line.
_UNKNOWN_OPTION = re.compile(
    r"(?:Group '([\w.]+)' )?does not accept option '([\w.]+)'|^Option '([\w.]+)' is not accepted|"
    r"unrecognized arguments: --([\w.]+)"
)
_PARSER_KEY = re.compile(r'Parser key "([\w.]+)"')
_NOT_ACCEPTED = re.compile(
    r"Problem with given class_path '([\w.]+)':\s*(?:Option '(\w+)' is not accepted|unrecognized arguments: --(\w+))"
)
# the same refusal for a class in a list of functions or callable classes (model.rewards)
_CALLABLE_NOT_ACCEPTED = re.compile(r"Option '(\w+)' is not accepted\. Got value: Namespace\(class_path='([\w.]+)'")
_NESTED = re.compile(r"NestedArg\(key='(\w+)'")
_CLASS = re.compile(r"<class '(?:[\w.]+\.)?(\w+)'>")
_CLASS_PATH = re.compile(r"<class '([\w.]+)'>")
_LITERAL = re.compile(r"typing\.Literal\[(.*?)\]")
_SUBTYPES = re.compile(r"Subtypes: \[(.*)\]$", re.MULTILINE)  # a union's member types
_EXPECTED = re.compile(r"Expected a (.*?)(?:\. Got value|$)", re.MULTILINE)
_IMPORT_PATH = re.compile(r"Expected a dot import path string: (\w+)")
_NOT_A_CLASS = re.compile(r"Expected a path but ([\w.]+) either not accessible or invalid")
_NOT_SUBCLASS = re.compile(r"Import path ([\w.]+) does not correspond to a subclass of")  # a class of another kind
_NO_SUCH_CLASS = re.compile(r"Problem with given class_path '([\w.]+)':\s*module '[\w.]+' has no attribute")
#: The ways jsonargparse names a class_path it did not take, its path first.
_UNTAKEN_CLASS = (_NOT_A_CLASS, _NOT_SUBCLASS, _NO_SUCH_CLASS)
_NO_ATTRIBUTE = re.compile(r"module '([\w.]+)' has no attribute '(\w+)'")
#: A function-typed setting (a reward) whose value is not one: jsonargparse's account, with the type's full text.
_NOT_CALLABLE = re.compile(r"Type .+? expects a function or a callable class: (.+)\. Got value: (.+)")
_IMPORT_PATH_TEXT = re.compile(r"[A-Za-z_][\w.]*")  # what a value naming a function or class looks like
#: The class a nested setting belongs to, and the setting: ``class_path 'gpo.algo.Custom': Parser key "advantage"``.
_OWNER = re.compile(r"Problem with given class_path '([\w.]+)':\s*Parser key \"(\w+)\"")
_ABSTRACT_TYPE = re.compile(r"Expected an instantiatable class, but ([\w.]+) is abstract")
#: How gpo's own checks start a message about a setting: ``model.group_size=1: ...``, ``data.path: ...``.
_OWN_SETTING = re.compile(r"((?:model|data|trainer)(?:\.\w+)+)(?:=('[^']*'|\"[^\"]*\"|[^\s:]+))?:")
_NO_GPU = "No supported gpu backend found"
_NO_GPU_FIX = "torch sees no GPU here: set --trainer.accelerator cpu, or auto (which takes what the machine has)."
_YAML_PROBLEM = "Problems parsing config"
_REQUIRED = re.compile(r"the following arguments are required: (.+)$", re.MULTILINE)  # settings without a default
_NO_VALUE = "Given value: None"  # a required setting that no config and no flag gives
_GOT_VALUE = re.compile(r"(?:Got|Given) value: (.*)$", re.MULTILINE)


def explain(
    message: str, config_files: Iterable[str] = (), known: Mapping[str, Any] | None = None, flags: Iterable[str] = ()
) -> str:
    """A short account of a parser error ``message``: the key, what is wrong, the file it came from and a hint.

    ``config_files`` are the ``--config`` files of the command (searched for the key, unless one of ``flags``, the
    settings given on the command line, sets it); ``known`` maps a group key (``model.optim``) to the class or
    dataclass whose parameters are its valid sub-keys. A message that is not
    jsonargparse's (gpo's own checks say what to do already) is returned as it is."""
    moved = [f"{old} moved: use {new}." for old, new in MOVED_PATHS.items() if old.lower() in message.lower()]
    if message.startswith(_YAML_PROBLEM):
        return _yaml_problem(message, config_files)
    if message.startswith(_NO_GPU):  # Lightning's words for trainer.accelerator: gpu on a machine without one
        return f"trainer.accelerator: {message} {_NO_GPU_FIX}"
    if not any(marker in message for marker in JSONARGPARSE_MARKERS):  # gpo's own check: it names key and fix
        own = _OWN_SETTING.match(message)
        value = own and own.group(2) and own.group(2).strip("'\"")
        source = own and _set_in(own.group(1), value, config_files, flags)
        return "\n".join([message, *([f"(set in {source})"] if source else []), *moved])
    key, problem, unknown = _key_and_problem(message)
    rejected_value = None if unknown else _GOT_VALUE.search(message)
    source = _set_in(key, rejected_value and rejected_value.group(1), config_files, flags) if key else None
    if key is not None and not unknown and message.rstrip().endswith(_NO_VALUE):
        lines = [_unset(key.replace(".init_args.", "."), source, config_files)]
    else:
        choices = _choices(message)
        if key is not None and choices and rejected_value:  # a value outside a fixed set: name the set
            shown, value = key.replace(".init_args.", "."), rejected_value.group(1).strip()
            problem = f"{shown}: {value} is not one of {', '.join(choices)}"
            problem += f"; {did_you_mean(value, choices)}" if did_you_mean(value, choices) else ""
        lines = [problem, *([f"(set in {source})"] if source is not None else [])]
    known = dict(known or {})
    if unknown:
        rejected = _rejected_option(message)
        if rejected:  # a class chosen by class_path: its own constructor says what it takes
            known[key.rpartition(".init_args.")[0]] = _import(rejected[0])
        lines.extend(_hints(key, known))
    if key is not None and key.startswith("model.algorithm"):
        lines.extend(_algorithm_hints(key, message))
    lines.extend(_class_hints(message, key, known))
    return "\n".join([*lines, *moved])


def _set_in(key: str, value: str | None, config_files: Iterable[str], flags: Iterable[str]) -> str | None:
    """The config file that sets ``key`` (to ``value``, if known), for the message; None when a flag of the command
    line sets it, or no file does."""
    return None if given_on_command_line(key, flags) else file_holding(key, config_files, value)


def _unset(key: str, source: str | None, config_files: Iterable[str]) -> str:
    """A required setting without a value: null in the config ``source``, or given nowhere."""
    if source is not None:
        return f"{key} is null in {source}: give it a value there or with --{key} VALUE"
    if not list(config_files):
        return f"{key} is not set: give a config (--config quickstart, or a YAML file) or --{key} VALUE"
    return f"{key} is not set: give it in a config or with --{key} VALUE"


def _key_and_problem(message: str) -> tuple[str | None, str, bool]:
    """The key the message is about, the problem in one line, and whether the key itself is unknown."""
    # nested accounts name each level's key: "model.engine", then inside its class "sampling"
    # (a union's members that hold the same class, one item or a list of them, give the same account twice: once)
    group = ".init_args.".join(dict.fromkeys(_PARSER_KEY.findall(message))) or None
    rejected = _rejected_option(message)
    if group and rejected:
        cls, option = rejected
        return f"{group}.init_args.{option}", f"{group} ({cls.rsplit('.', 1)[-1]}) has no setting {option!r}", True
    unknown = _UNKNOWN_OPTION.search(message)
    if unknown:
        owner, option, top_level, flag = unknown.groups()
        key = f"{owner}.{option}" if owner else option or top_level or flag
        if group and not key.startswith(group):  # refused by the group's own parser: model.rewards' "1.init_args.x"
            key = f"{group}.{key}"
        return key, f"unknown setting {key}", True
    nested = _NESTED.search(message)
    if group and nested and nested.group(1) not in _PARSER_KEY.findall(message):  # not a bad value of a known key
        return f"{group}.{nested.group(1)}", f"unknown setting {group}.{nested.group(1)}", True
    if group is None:
        return None, _first_reason(message), False
    shown = group.replace(".init_args.", ".")  # as it is written on the command line
    reason = _first_reason(message)
    return group, reason if reason.startswith(group) else f"{shown}: {reason}", False


def _rejected_option(message: str) -> tuple[str, str] | None:
    """The class chosen by ``class_path`` and the option its constructor refused, when that is the problem."""
    rejected = _NOT_ACCEPTED.search(message)
    if rejected:
        return rejected.group(1), rejected.group(2) or rejected.group(3)
    in_a_list = _CALLABLE_NOT_ACCEPTED.search(message)
    return (in_a_list.group(2), in_a_list.group(1)) if in_a_list else None


def _choices(message: str) -> list[str]:
    """The values a setting takes when they form a closed set (``Literal`` values, with ``true, false`` for a bool
    and ``null`` for None), in jsonargparse's order, each once; ``[]`` when it also takes an open type (an int, a
    string, a class). Read in the innermost ``Parser key`` block: a nested setting's own account, not its group's."""
    block = _innermost_block(message)
    subtypes = _SUBTYPES.search(block)
    listing = subtypes.group(1) if subtypes else " ".join(_EXPECTED.findall(block))
    classes = _CLASS.findall(listing)
    generics = re.sub(r"typing\.Literal\[.*?\]|<class '[\w.]+'>", "", listing)  # what is left: list[int], ...
    if any(name not in ("bool", "NoneType") for name in classes) or re.search(r"\w\[", generics):
        return []
    found = ["true", "false"] if "bool" in classes else []
    for listed in _LITERAL.findall(listing):
        found += [str(value) for value in ast.literal_eval(f"[{listed}]") if str(value) not in found]
    return [*found, "null"] if found and "NoneType" in classes else found


def _innermost_block(message: str) -> str:
    """The lines of the last ``Parser key "..."`` line of ``message`` and those indented under it."""
    lines = message.splitlines()
    starts = [index for index, line in enumerate(lines) if 'Parser key "' in line]
    if not starts:
        return message
    head = lines[starts[-1]]
    indent = len(head) - len(head.lstrip())
    block = [head]
    for line in lines[starts[-1] + 1 :]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        block.append(line)
    return "\n".join(block)


def _first_reason(message: str) -> str:
    """The most specific line of jsonargparse's account (the innermost problem, not the union's preamble)."""
    noise = ("Does not validate against any of the Union subtypes", "Subtypes:", "Errors:", "Given value",
             'Parser key "', "Expected a <class 'NoneType'>", "Problem with given class_path")  # fmt: skip
    reasons = [
        line.strip(" -") for line in message.splitlines() if line.strip() and not line.strip(" -").startswith(noise)
    ]
    # jsonargparse first tries a value as a config file's path: that account goes last when there are others
    reasons.sort(key=lambda reason: reason.startswith("Expected a path but"))
    reason = _CLASS.sub(r"\1", (reasons or [message.strip()])[0])
    not_callable = _NOT_CALLABLE.fullmatch(reason)
    return _unresolved_callable(*not_callable.groups()) if not_callable else reason


def _unresolved_callable(reason: str, value: str) -> str:
    """A function or callable class (a reward) that ``value`` does not name: the path and why, with the closest name
    in its module when the module lacks it (not jsonargparse's ``Type collections.abc.Callable[...]`` text)."""
    missing = _NO_ATTRIBUTE.search(reason)
    if missing:
        guess = _closest_in_module(*missing.groups(), callable)
    else:  # a dotted name whose package is nowhere; not settings given without their class (a Namespace(...))
        guess = _missing_module(value.rpartition(".")[0]) if _IMPORT_PATH_TEXT.fullmatch(value) else ""
    return f"{value}: {reason}" + (f"; {guess}" if guess else "")


def _yaml_problem(message: str, config_files: Iterable[str]) -> str:
    """A config file that is not valid YAML: the file, the line and column, and what the YAML parser expected
    (jsonargparse's message names no file)."""
    for name in config_files:
        try:
            yaml.safe_load(Path(name).read_text())
        except OSError:
            continue
        except yaml.MarkedYAMLError as err:
            parts = [_at(err.context, err.context_mark), _at(err.problem, err.problem_mark)]
            return f"{name} is not valid YAML: {': '.join(part for part in parts if part)}."
        except yaml.reader.ReaderError as err:  # a control character: no line and column, a position
            shown = f"#x{err.character:04x}" if isinstance(err.character, int) else repr(err.character)
            return f"{name} is not valid YAML: character {shown} at position {err.position + 1}: {err.reason}."
        except yaml.YAMLError as err:
            return f"{name} is not valid YAML: {' '.join(str(err).split())}."
    return message


def _required_parameters(cls: type) -> set[str]:
    """The parameters of ``cls`` without a default."""
    return {name for name, p in inspect.signature(cls).parameters.items() if p.default is inspect.Parameter.empty}


def _at(text: str | None, mark: yaml.Mark | None) -> str:
    """``text at line L, column C`` (1-based); nothing when the YAML parser gave no text."""
    return f"{text} at line {mark.line + 1}, column {mark.column + 1}" if text and mark is not None else text or ""


def _algorithm_hints(key: str, message: str) -> list[str]:
    """``model.algorithm`` (or a part of it, ``key``) given as a name with settings of its own (a name takes none),
    or a class that does not exist: the class to write instead; a class without a setting it has no default for: the
    flag to give (and for a preset, its shipped config, which sets one)."""
    from gpo.algo.presets import ALGORITHMS, PRESETS
    from gpo.algo.presets.base import SLOTS

    required = _REQUIRED.search(message)
    if required:
        names = [name.strip() for name in required.group(1).split(",")]
        flags = " ".join(f"--{key.replace('.init_args.', '.')}.{name} VALUE" for name in names)
        unnamed = [cls for cls in PRESETS if cls not in ALGORITHMS.values()]  # presets taken by class, not by name
        asking = [cls for cls in unnamed if set(names) <= _required_parameters(cls)] or unnamed
        configs = ", ".join(f"--config {cls.__name__.lower()}" for cls in asking)
        shipped = f", or start from the preset's shipped config ({configs})"
        return [f"give {flags}{shipped if key == 'model.algorithm' else ''}."]
    named = _IMPORT_PATH.search(message)
    if named is None:
        return []
    name, nested = named.group(1), _NESTED.search(message)
    if name in ALGORITHMS and nested:
        setting, cls = nested.group(1), ALGORITHMS[name]
        if setting in SLOTS and setting not in inspect.signature(cls).parameters:  # a part: only Custom takes one
            return [
                f"{name} is a preset, whose parts follow its rules; to choose the {setting} yourself, compose the "
                f"parts: --model.algorithm Custom --model.algorithm.{setting} VALUE (the other parts default to "
                f"GRPO's; class_path: Custom in YAML)."
            ]
        return [
            f"{name} is a preset by name, with its defaults; to change a setting choose its class: "
            f"--model.algorithm {cls.__name__} --model.algorithm.{setting} VALUE (or class_path: {cls.__name__} in "
            "YAML)."
        ]
    guess = did_you_mean(name, [cls.__name__ for cls in PRESETS])
    return [guess] if guess else []


def _class_hints(message: str, key: str | None, known: Mapping[str, Any]) -> list[str]:
    """Why a ``class_path`` was not taken (for the setting ``key``): a misspelt class (the closest name in its
    module), an abstract class (the methods it lacks), one part given to a setting that takes a list of them, a class
    of another kind (the gpo part it is, and the setting beside ``key`` that takes it); or, when jsonargparse fell
    back to the setting's abstract type, a class_path block whose keys it did not read."""
    found = next(filter(None, (pattern.search(message) for pattern in _UNTAKEN_CLASS)), None)
    if found is None:
        abstract = _ABSTRACT_TYPE.search(message)
        return ["a class_path block takes class_path and init_args: check their spelling."] if abstract else []
    path = found.group(1)
    module_name, _, name = path.rpartition(".")
    if not module_name:  # a plain value where a class or settings belong: jsonargparse's own account says it
        return []
    cls = _import(path)
    if cls is None:
        guess = _closest_in_module(module_name, name, inspect.isclass) or _missing_module(module_name)
        return [guess] if guess else []
    if not inspect.isclass(cls):
        return [f"{path} is not a class."]
    if inspect.isabstract(cls):
        return [f"{cls.__name__} is abstract: it does not implement {', '.join(sorted(cls.__abstractmethods__))}."]
    if key is not None and _takes_a_list_of(cls, key, known):
        shown = key.replace(".init_args.", ".")
        return [f"{shown} takes a list of parts: --{shown}+={path} (once per part), or [{path}] in YAML."]
    if any(issubclass(cls, member) for member in _union_members(message)):
        return []  # the setting takes it: the union's other member refused it, and the error lies in its settings
    from gpo.algo.state import PartState  # every part's base, not a kind: imported on this error's path only

    kinds = [base.__name__ for base in cls.__mro__[1:] if base.__module__.startswith("gpo.") and base is not PartState]
    if not kinds:
        return []
    slot = _setting_taking(cls, key, message) if key is not None else None
    instead = f"; did you mean {slot}?" if slot is not None else "."
    return [f"{cls.__name__} is a gpo {kinds[-1]}, which this setting does not take{instead}"]


def _union_members(message: str) -> list[type]:
    """The classes of the union a setting's value was tried against (``Subtypes: [...]``), as far as they import."""
    listed = _SUBTYPES.search(message)
    paths = [path for path in _CLASS_PATH.findall(listed.group(1)) if "." in path] if listed else []  # not builtins
    members = (_import(path) for path in paths)
    return [member for member in members if inspect.isclass(member)]


def _takes_a_list_of(cls: type, key: str, known: Mapping[str, Any]) -> bool:
    """Whether the setting ``key`` of a ``known`` group is a list of parts of ``cls``'s kind (``model.masks``)."""
    group, _, name = key.replace(".init_args.", ".").rpartition(".")
    hint = _settings_types(known.get(group)).get(name)
    items = typing.get_args(hint) if typing.get_origin(hint) in (Sequence, list, tuple) else ()
    return len(items) == 1 and inspect.isclass(items[0]) and issubclass(cls, items[0])


def _setting_taking(cls: type, key: str, message: str) -> str | None:
    """The setting beside ``key`` whose type takes ``cls``, as written on the command line: ``model.algorithm.gate``
    for a gate given to ``Custom``'s ``advantage``. Read from the annotations of the constructor of the class that
    holds ``key`` (the innermost ``class_path`` of ``message``); None when no setting of that class takes it."""
    group, _, name = key.rpartition(".")
    owners = [path for path, setting in _OWNER.findall(message) if setting == name]
    owner = _import(owners[-1]) if owners else None
    taking = [
        setting
        for setting, hint in _settings_types(owner).items()
        if any(inspect.isclass(kind) and issubclass(cls, kind) for kind in typing.get_args(hint) or (hint,))
    ]
    return f"{group}.{taking[0]}".replace(".init_args.", ".") if taking else None


def _settings_types(owner: Any) -> dict[str, Any]:
    """The annotated types of class ``owner``'s constructor parameters; empty for no class, or for annotations that do
    not resolve (nothing to read them by)."""
    if not inspect.isclass(owner):
        return {}
    try:
        return typing.get_type_hints(owner.__init__)
    except (NameError, TypeError):
        return {}


def _closest_in_module(module_name: str, name: str, wanted: Callable[[Any], bool]) -> str:
    """``did you mean MODULE.NAME?`` for the member of module ``module_name`` most like ``name`` among those
    ``wanted`` accepts (classes, callables); ``""`` when the module cannot be imported or holds nothing close."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return ""
    return did_you_mean(name, [member for member, _ in inspect.getmembers(module, wanted)], f"{module_name}.{{}}")


def _hints(key: str, known: Mapping[str, Any]) -> list[str]:
    indexed = _LIST_INDEX.search(key)
    if indexed:  # model.rewards.1.init_args.penalty: the command line reaches no list item by its index
        items = key[: indexed.start()]
        return [
            f"{items} is a list, whose items the command line does not reach by index: --{items}+=CLASS "
            f"--{items}.SETTING VALUE sets a setting of the item just added; or write the list in a YAML config."
        ]
    for old, new in MOVED_KEYS.items():
        if key == old or key.startswith(old + "."):
            return [f"{old} moved: {new}."]
    written = key.replace(".init_args.", ".")  # as on the command line: model.evaluation.every_n_iters
    for foreign, instead in ELSEWHERE_KEYS.items():
        if written == foreign or written.startswith(foreign + "."):
            return [f"{foreign} is not a gpo setting; {instead} (docs/training.md maps other trainers' settings)."]
    for lightning, instead in REPLACED_KEYS.items():
        if key == lightning or key.startswith(lightning + "."):
            return [f"{instead}."]
    group, _, name = key.rpartition(".")
    if group.endswith(".init_args"):
        group = group.removesuffix(".init_args")
    if not group:  # a top-level setting: seed_everthing
        guess = did_you_mean(name, TOP_LEVEL_KEYS, "{}")
        return [guess or f"the top-level settings are {', '.join(TOP_LEVEL_KEYS)}."]
    owner = known.get(group)
    if owner is None and "." not in group:  # a misspelt top-level group: modle.group_size
        guess = did_you_mean(group, {k.split(".")[0] for k in known}, "{}." + name)
        return [guess] if guess else []
    choices = _parameters(owner) if owner is not None else []
    guess = did_you_mean(name, choices, group + ".{}")
    if guess:
        return [guess]
    return [f"{group} takes: {', '.join(choices)}."] if choices else []


def _missing_module(module_name: str) -> str:
    """Where the user's own modules are imported from, when the package of ``module_name`` is on no import path
    (run from another folder, say); ``""`` when it is found."""
    top = module_name.partition(".")[0]
    if not top or importlib.util.find_spec(top) is not None:
        return ""
    gpo = did_you_mean(top, ["gpo"], then=" Otherwise ")
    return (
        f"{gpo}there is no module {top} on the import path: your own modules are imported from the working directory "
        f"({os.getcwd()}) and PYTHONPATH; run from the folder that holds {top}.py (or {top}/), or add it to PYTHONPATH."
    )


def _import(path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _parameters(owner: Any) -> list[str]:
    """The keyword parameters of a class's constructor (a dataclass's fields included)."""
    try:
        parameters = inspect.signature(owner).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"]
