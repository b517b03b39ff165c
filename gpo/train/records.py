"""Prompt rows read from a local file (JSONL, JSON, Parquet, CSV) or a saved ``datasets`` folder, with errors that
name the file, the line and the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpo.suggest import closest_file

_FILE_TYPES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_TEXT_FILES = (".jsonl", ".json", ".csv")


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a local JSONL/JSON/Parquet/CSV file, or of a folder saved with ``datasets``' ``save_to_disk``."""
    import datasets  # imported here: loading takes a second and only data setup needs it
    import pyarrow

    path = Path(path)
    if not path.exists():
        guess = closest_file(path, then=" Otherwise ")
        raise FileNotFoundError(
            f"data path {str(path)!r} does not exist; {guess}give a .jsonl/.json/.parquet/.csv file."
        )
    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise ValueError(f"{path} holds splits {list(loaded)}; save the one to train on as 'train'.")
            loaded = loaded["train"]
        return loaded.to_list()
    kind = _FILE_TYPES.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"{path}: unknown file type {path.suffix!r}; use one of {', '.join(_FILE_TYPES)}.")
    if path.stat().st_size == 0:
        return []
    if path.suffix.lower() in _TEXT_FILES:
        require_utf8(path)
    try:
        return datasets.load_dataset(kind, data_files=str(path), split="train").to_list()
    except (datasets.exceptions.DatasetGenerationError, pyarrow.ArrowException) as err:
        raise ValueError(f"{path} could not be read: {_unreadable_reason(path, err)}") from None


def _unreadable_reason(path: Path, error: BaseException) -> str:
    """Why ``datasets`` could not read ``path``, in one line: for a JSONL file, its first line that is not one JSON
    value (found by reading the file again, only once loading has failed); otherwise the innermost error's text
    (``datasets`` wraps the parser's error in a generic one)."""
    if path.suffix.lower() == ".jsonl":
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                try:
                    if line.strip():
                        json.loads(line)
                except json.JSONDecodeError as err:
                    return (
                        f"line {number}, column {err.colno} is not valid JSON: {err.msg}; each line holds one object."
                    )
    while error.__cause__ is not None:
        error = error.__cause__
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def require_utf8(path: Path) -> None:
    """Refuse a text file that is not UTF-8, naming its first line that is not (``datasets`` would raise a bare
    ``UnicodeDecodeError``, or a generation error hiding one). A line is decoded alone: no UTF-8 sequence holds a
    newline byte."""
    with path.open("rb") as lines:
        for number, line in enumerate(lines, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{path} line {number} is not UTF-8 (byte 0x{line[err.start]:02x} at byte {err.start + 1} of "
                    "the line); prompts files must be UTF-8: save it with that encoding."
                ) from None
