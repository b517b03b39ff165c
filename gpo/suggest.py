"""'Did you mean ...?' for a misspelt name or path, in the one form every gpo error message uses."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path


def did_you_mean(name: str, choices: Iterable[str], shown: str = "{}", then: str = "") -> str:
    """``"did you mean X?"`` with ``X`` the choice most like ``name`` (``difflib``'s similarity ratio, at least
    0.6) written through ``shown`` (``"model.{}"``), followed by ``then`` (what the message goes on with, such as
    ``" Otherwise "``); ``""`` when none is close."""
    found = difflib.get_close_matches(name, list(choices), n=1)
    return f"did you mean {shown.format(found[0])}?{then}" if found else ""


def closest_file(path: Path, pattern: str = "*", then: str = "") -> str:
    """``"did you mean FOLDER/NAME?"`` (followed by ``then``) for the file of ``path``'s folder (matching
    ``pattern``) most like it, or ``""`` when the folder cannot be read or holds nothing close."""
    try:
        siblings = [entry.name for entry in path.parent.glob(pattern)]
    except OSError:
        return ""
    return did_you_mean(path.name, siblings, str(path.parent / "{}"), then)
