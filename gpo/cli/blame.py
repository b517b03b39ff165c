"""Whose error it is: the configured class that refused a value, or the line of the user's own file that raised."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

#: Classes whose refusals name their settings by their full key already, or that only run others.
NAMED_BY_KEY = ("GPOModule", "PromptDataModule", "GPOCLI")
#: A message that opens with a setting's full key (model.optim.lr=-1.0 ...) says whose it is already.
FULL_KEY = re.compile(r"(model|data|trainer)\.[\w.]+")


def refusing_class(error: BaseException) -> str | None:
    """The configured class whose constructor raised ``error`` at its root (the outermost ``__init__`` of a
    configured part, ``is_configured_part``, in the first exception of the chain), unless it is one whose messages name
    their full key already: a part's own check, e.g. ``dual_clip=0.5 must be > 1``, says which setting but not
    whose."""
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    owner, trace = None, error.__traceback__
    while trace is not None:
        instance = trace.tb_frame.f_locals.get("self") if trace.tb_frame.f_code.co_name == "__init__" else None
        if instance is not None and is_configured_part(type(instance)):
            owner = type(instance).__name__
            break  # the outermost: DAPO, not the ClipGate it builds
        trace = trace.tb_next
    return None if owner in NAMED_BY_KEY else owner


def is_configured_part(cls: type) -> bool:
    """Whether ``cls`` is gpo's or the user's own (a module under the working directory), not a library's."""
    if is_gpos_module(cls.__module__):
        return True
    source = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return source is not None and is_users_file(source)


def raised_in_user_code(error: BaseException) -> str | None:
    """Where the first error of ``error``'s chain was raised in the user's own code (a module outside gpo, from a
    file of theirs: ``is_users_file``), as ``parts.py:9 in Mine.__call__``: the deepest such frame, so a slip in a
    part or reward of one's own is found without a traceback. None when no frame of it is the user's."""
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    where, trace = None, error.__traceback__
    while trace is not None:
        frame, code = trace.tb_frame, trace.tb_frame.f_code
        if not is_gpos_module(frame.f_globals.get("__name__", "")) and is_users_file(code.co_filename):
            function = code.co_qualname if sys.version_info >= (3, 11) else code.co_name  # co_qualname: 3.11 on
            where = f"{os.path.relpath(code.co_filename)}:{trace.tb_lineno} in {function}"
        trace = trace.tb_next
    return where


def is_gpos_module(name: str) -> bool:
    """A module of gpo's own (its callbacks too, wherever an editable install keeps their files)."""
    return name == "gpo" or name.startswith("gpo.")


def is_users_file(filename: str) -> bool:
    """A Python file under the working directory that no installed package holds (a compiled module's frames name
    a bare ``.pyx`` file, which is not one)."""
    path = Path(filename).resolve()
    installed = "site-packages" in path.parts
    return path.suffix == ".py" and path.is_file() and path.is_relative_to(Path.cwd()) and not installed


def with_owner(text: str, error: BaseException) -> str:
    """``text``, the account of ``error``, opened by the class that refused the value (``refusing_class``) unless
    it names it or the setting's full key already: ``ClipGate: dual_clip=0.5 must be > 1``."""
    owner = refusing_class(error)
    return f"{owner}: {text}" if owner is not None and owner not in text and not FULL_KEY.match(text) else text
