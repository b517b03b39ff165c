"""Checkpoint files that are whole or absent: written to a temporary file beside the target, flushed to disk, then
renamed over it; read back with an error that says what to do when a file is damaged."""

from __future__ import annotations

import json
import os
import pickle
import socket
import time
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

#: The first bytes of what ``torch.save`` writes: a zip archive, or a pickle (protocol 2 or later) before torch 1.6.
TORCH_SAVE_MAGIC = (b"PK\x03\x04", b"\x80")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says which file and what to do."""


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """``torch.save(obj, path)`` that never leaves a partial file at ``path``.

    The bytes go to ``.<name>.tmp-<pid>`` in the same folder (so the rename cannot cross file systems), are
    fsynced, then ``os.replace`` swaps them in and the folder entry is fsynced. A crash, a kill or a full disk
    at any point leaves the previous ``path`` as it was; a failed write removes its temporary file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)  # the folder may have been removed under a running job
    temporary = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        with open(temporary, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        temporary.unlink(missing_ok=True)
        if isinstance(error, Exception):  # torch reports a failed write (full disk) as a RuntimeError
            raise CheckpointError(
                f"could not write checkpoint {path}: {error}. The previous file at that path, if any, is intact. "
                "Free disk space or point the checkpoint callback's dirpath elsewhere."
            ) from error
        raise
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def load_checkpoint_file(
    path: str | Path, map_location: Any = None, weights_only: bool | None = None
) -> dict[str, Any]:
    """``torch.load`` of a whole checkpoint, or a ``CheckpointError`` naming the file when it is truncated or
    corrupt (nothing is loaded into any model in that case)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist.")
    head = _first_bytes(path)
    if len(head) < len(TORCH_SAVE_MAGIC[0]):  # cut off before its first bytes reached the disk
        raise _damaged(path, EOFError(f"only {len(head)} bytes"))
    if not head.startswith(TORCH_SAVE_MAGIC):  # torch.load would read some other files (safetensors) as a dict
        raise CheckpointError(
            f"{path} is not a checkpoint: torch.save writes a zip archive (or, before torch 1.6, a pickle), and this "
            "file is neither. Give the .ckpt file a run wrote (<default_root_dir>/checkpoints/last.ckpt)."
        )
    try:
        if head.startswith(TORCH_SAVE_MAGIC[0]):
            check_records(path)
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except PermissionError:
        raise
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as error:
        if "Weights only load failed" in str(error):
            raise CheckpointError(
                f"checkpoint {path} holds pickled objects other than tensors and plain values, and was not loaded: "
                "gpo loads checkpoints with torch.load(weights_only=True), so no code stored in a file can run. "
                "Checkpoints written by gpo never need more; a file that does was made elsewhere or altered."
            ) from error
        raise _damaged(path, error) from error


def check_records(path: Path) -> None:
    """Read every record of the zip archive ``path`` against the CRC-32 stored with it, raising
    ``zipfile.BadZipFile`` at the first that differs: ``torch.load`` does not check them, and loads a tensor with a
    flipped byte as it finds it. Records written without a CRC (``torch.serialization.set_crc32_options(False)``
    stores 0) are not checked."""
    with zipfile.ZipFile(path) as archive:
        for record in archive.infolist():
            if record.CRC:
                with archive.open(record) as file:
                    while file.read(1 << 24):  # the CRC is compared when the last bytes are read
                        pass


def _damaged(path: Path, error: BaseException) -> CheckpointError:
    """The error for a checkpoint file cut off or corrupted, naming the other checkpoints of its folder."""
    others = sorted(p.name for p in path.parent.glob("*.ckpt") if p != path)
    hint = (
        f"Use another checkpoint of {path.parent} ({', '.join(others)})"
        if others
        else "No other checkpoint is beside it"
    )
    return CheckpointError(
        f"checkpoint {path} is damaged and was not loaded ({type(error).__name__}: {error}). {hint}; a run resumed "
        "from this one can also start over once the file is deleted."
    )


def _first_bytes(path: Path) -> bytes:
    """The first bytes of ``path``, as many as ``TORCH_SAVE_MAGIC``'s zip signature (fewer for a shorter file)."""
    with path.open("rb") as file:
        return file.read(len(TORCH_SAVE_MAGIC[0]))


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO with atomic local writes and a clear error on damaged files.

    Lightning's own writer stages the whole checkpoint in memory and moves a file from the system temp folder,
    which is a copy (not a rename) when that folder is on another file system; this one writes next to the
    target and renames. Remote paths (``s3://`` and the like) fall back to Lightning's writer.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(
        self, path: _PATH, map_location: Any = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if "://" in str(path):
            return super().load_checkpoint(path, map_location, weights_only)
        return load_checkpoint_file(path, map_location=map_location, weights_only=weights_only)


class RunLock:
    """One live run per checkpoint folder: ``<folder>/.run.lock`` names the run holding it (process id, host,
    start time), so a second run started on the same folder stops at once instead of overwriting the first one's
    checkpoints.

    A lock whose process is gone (same host, no such process id) is stale: the next run takes it over, and removes
    the partial ``.<name>.tmp-<pid>`` files a killed checkpoint write leaves behind. A lock from another host cannot
    be checked: the message says how to remove it.

    Args:
        folder: the checkpoint folder.
    """

    NAME = ".run.lock"

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / self.NAME

    def check(self) -> None:
        """Raise ``FileExistsError`` when another live run holds the folder; nothing is written."""
        owner = self.owner()
        if owner is None or (owner.get("host") == socket.gethostname() and owner.get("pid") == os.getpid()):
            return
        if owner.get("host") == socket.gethostname() and not _alive(owner.get("pid")):
            return  # stale: that process is gone
        where = f"process {owner.get('pid')} on {owner.get('host')}, started {owner.get('started')}"
        raise FileExistsError(
            f"another run ({where}) is writing checkpoints to {self.folder}. Start this run in another folder "
            "(--trainer.default_root_dir DIR), or wait for that one to end and continue it with --ckpt_path last. "
            f"If that run is gone (e.g. on a machine that crashed), delete {self.path}."
        )

    def acquire(self) -> None:
        """Write this process's claim and remove partial checkpoint files of earlier, dead writers."""
        self.folder.mkdir(parents=True, exist_ok=True)
        claim = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        partial = self.path.with_name(f"{self.NAME}.tmp-{os.getpid()}")
        partial.write_text(json.dumps(claim))
        os.replace(partial, self.path)
        for leftover in self.folder.glob(".*.tmp-*"):
            leftover.unlink(missing_ok=True)

    def release(self) -> None:
        """Remove the claim if it is this process's."""
        owner = self.owner()
        if owner is not None and owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
            self.path.unlink(missing_ok=True)

    def owner(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError):
            return None


def _alive(pid: int | None) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True
