"""Checkpoint writes are whole or absent: a kill or a full disk during a save leaves the previous file intact, and a
removed output folder is recreated."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import save_file

from gpo.callbacks import ResumeCheckpoint
from gpo.rewards import positional_match
from gpo.rollout import HFEngine, Sampling
from gpo.tasks import make_task, write_jsonl
from gpo.testing import save_tiny_model
from gpo.train.checkpointing import CheckpointError, atomic_torch_save, load_checkpoint_file
from gpo.train.data import PromptDataModule
from gpo.train.module import GPOModule

REPO = Path(__file__).resolve().parents[2]


def python(code: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_intact(tmp_path):
    path, marker = tmp_path / "last.ckpt", tmp_path / "pickling"
    atomic_torch_save({"step": 1, "w": torch.zeros(1000)}, path)
    writer = python(
        "import torch; from gpo.train.checkpointing import atomic_torch_save; from tests.reliability.faults import "
        f"SlowToPickle; atomic_torch_save({{'step': 2, 'w': torch.ones(1000), 'x': SlowToPickle({str(marker)!r})}}, "
        f"{str(path)!r})"
    )
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert writer.poll() is None, writer.stderr.read()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    old = load_checkpoint_file(path, weights_only=True)
    assert old["step"] == 1 and torch.equal(old["w"], torch.zeros(1000))
    assert [p.name for p in tmp_path.glob("*.ckpt")] == ["last.ckpt"]  # the stray temp file is not a checkpoint


def test_a_full_disk_fails_the_save_clearly_and_keeps_the_previous_file(tmp_path):
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"step": 1, "w": torch.zeros(10)}, path)
    # RLIMIT_FSIZE makes writes past 64 KiB fail with EFBIG, as a full disk fails them with ENOSPC
    writer = python(
        "import resource, signal, torch; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536)); "
        "from gpo.train.checkpointing import atomic_torch_save; "
        f"atomic_torch_save({{'step': 2, 'w': torch.ones(1_000_000)}}, {str(path)!r})"
    )
    _, err = writer.communicate(timeout=120)
    assert writer.returncode != 0
    assert "CheckpointError: could not write checkpoint" in err and "previous file at that path" in err
    assert load_checkpoint_file(path, weights_only=True)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # the partial temp file was removed


def test_a_truncated_file_is_refused_and_names_the_other_checkpoints(tmp_path):
    atomic_torch_save({"w": torch.ones(1000)}, tmp_path / "step8.ckpt")
    torch.save({"w": torch.ones(1000)}, tmp_path / "last.ckpt")
    data = (tmp_path / "last.ckpt").read_bytes()
    (tmp_path / "last.ckpt").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"last\.ckpt is damaged .*Use another checkpoint of .* \(step8\.ckpt\)"):
        load_checkpoint_file(tmp_path / "last.ckpt")


def test_a_checkpoint_with_a_flipped_byte_in_a_tensor_is_refused_not_loaded_as_it_is(tmp_path):
    """torch.load does not check the CRC-32 each record of the archive carries: the changed weights loaded silently and
    a resumed run trained on from them."""
    torch.save({"w": torch.ones(1000)}, tmp_path / "last.ckpt")
    data = bytearray((tmp_path / "last.ckpt").read_bytes())
    start = data.index(torch.ones(1000).numpy().tobytes())  # the tensor's bytes, stored uncompressed
    data[start + 100] ^= 0xFF
    (tmp_path / "last.ckpt").write_bytes(bytes(data))
    assert not torch.equal(torch.load(tmp_path / "last.ckpt", weights_only=True)["w"], torch.ones(1000))  # torch
    with pytest.raises(CheckpointError, match=r"last\.ckpt is damaged .*Bad CRC-32 for file '.*/data/0'"):
        load_checkpoint_file(tmp_path / "last.ckpt")


def test_a_checkpoint_written_without_crcs_loads(tmp_path):
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"w": torch.ones(1000)}, tmp_path / "last.ckpt")
    finally:
        torch.serialization.set_crc32_options(True)
    assert load_checkpoint_file(tmp_path / "last.ckpt")["w"].sum() == 1000


class RemoveFolder(L.Callback):
    def __init__(self, folder: Path, at_batch: int):
        self.folder, self.at_batch = folder, at_batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.at_batch:
            assert (self.folder / "last.ckpt").exists()
            for file in self.folder.iterdir():
                file.unlink()
            self.folder.rmdir()


def test_a_checkpoint_folder_removed_mid_run_is_recreated_at_the_next_save(tmp_path):
    model = save_tiny_model(tmp_path / "model", "llama")
    data = write_jsonl(make_task("sort_digits", 16), tmp_path / "train.jsonl")
    folder = tmp_path / "checkpoints"
    module = GPOModule(
        str(model), [positional_match], group_size=2, engine=HFEngine(sampling=Sampling(max_new_tokens=2))
    )
    trainer = L.Trainer(
        max_steps=3,
        logger=False,
        enable_progress_bar=False,
        callbacks=[ResumeCheckpoint(folder, every_n_train_steps=1), RemoveFolder(folder, at_batch=2)],
    )
    trainer.fit(module, PromptDataModule(str(data), tokenizer=str(model), prompts_per_step=2))
    assert load_checkpoint_file(folder / "last.ckpt", weights_only=True)["global_step"] == 3


def test_a_file_that_is_no_checkpoint_is_named_as_such_not_as_damaged_or_unsafe(tmp_path):
    (tmp_path / "notes.ckpt").write_text("garbage\n")
    with pytest.raises(CheckpointError, match=r"notes\.ckpt is not a checkpoint: torch\.save writes a zip archive"):
        load_checkpoint_file(tmp_path / "notes.ckpt", weights_only=True)
    # what torch.load reads is still read: a pickle from before torch 1.6's zip format
    torch.save({"global_step": 3}, tmp_path / "legacy.ckpt", _use_new_zipfile_serialization=False)
    assert load_checkpoint_file(tmp_path / "legacy.ckpt", weights_only=True) == {"global_step": 3}
    # safetensors, which torch.load reads as a dict of tensors: not a checkpoint either
    save_file({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a checkpoint"):
        load_checkpoint_file(tmp_path / "model.safetensors", weights_only=True)
    # a file cut off before its first bytes reached the disk is damaged, with the other checkpoints named
    for cut in (b"", b"PK"):
        (tmp_path / "last.ckpt").write_bytes(cut)
        with pytest.raises(CheckpointError, match=r"last\.ckpt is damaged .*\(legacy\.ckpt, notes\.ckpt\)"):
            load_checkpoint_file(tmp_path / "last.ckpt", weights_only=True)


def test_a_save_syncs_the_file_then_the_folder_entry_to_disk(tmp_path, monkeypatch):
    """Without both fsyncs a power cut after the rename can leave an empty or missing file at the path."""
    import stat

    synced = []

    def fsync(descriptor):
        synced.append("folder" if stat.S_ISDIR(os.fstat(descriptor).st_mode) else "file")

    monkeypatch.setattr(os, "fsync", fsync)
    atomic_torch_save({"step": 1}, tmp_path / "last.ckpt")
    assert synced == ["file", "folder"]


class Interrupted:
    def __reduce__(self):
        raise KeyboardInterrupt


def test_an_interrupt_during_a_save_removes_the_partial_file_and_stays_an_interrupt(tmp_path):
    atomic_torch_save({"step": 1}, tmp_path / "last.ckpt")
    with pytest.raises(KeyboardInterrupt):
        atomic_torch_save({"step": 2, "bad": Interrupted()}, tmp_path / "last.ckpt")
    assert [path.name for path in tmp_path.iterdir()] == ["last.ckpt"]
    assert load_checkpoint_file(tmp_path / "last.ckpt", weights_only=True) == {"step": 1}


def test_a_missing_checkpoint_and_one_that_cannot_be_read_are_not_called_damaged(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"checkpoint .*last\.ckpt does not exist\."):
        load_checkpoint_file(tmp_path / "last.ckpt")
    atomic_torch_save({"step": 1}, tmp_path / "last.ckpt")

    def denied(*args, **kwargs):
        raise PermissionError("permission denied")

    monkeypatch.setattr(torch, "load", denied)
    with pytest.raises(PermissionError, match="permission denied"):
        load_checkpoint_file(tmp_path / "last.ckpt")


def test_lightnings_checkpoint_io_writes_local_files_atomically_and_refuses_damaged_ones(tmp_path, monkeypatch):
    from gpo.train import checkpointing

    io = checkpointing.AtomicCheckpointIO()
    written = []
    monkeypatch.setattr(checkpointing, "atomic_torch_save", lambda obj, path: written.append(path))
    io.save_checkpoint({"step": 1}, tmp_path / "last.ckpt")
    assert written == [tmp_path / "last.ckpt"]
    (tmp_path / "last.ckpt").write_bytes(b"PK")
    with pytest.raises(CheckpointError, match=r"last\.ckpt is damaged"):
        io.load_checkpoint(tmp_path / "last.ckpt")


def test_storage_options_and_remote_paths_go_to_lightnings_writer(tmp_path, monkeypatch):
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from gpo.train import checkpointing

    handed = []
    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", lambda self, ckpt, path, _=None: handed.append(path))
    io = checkpointing.AtomicCheckpointIO()
    io.save_checkpoint({"step": 1}, tmp_path / "last.ckpt", storage_options={"acl": "private"})
    io.save_checkpoint({"step": 1}, "s3://bucket/last.ckpt")
    assert handed == [tmp_path / "last.ckpt", "s3://bucket/last.ckpt"] and not list(tmp_path.iterdir())


class Opaque:
    """An object torch.load(weights_only=True) will not build: loading it could run code."""


def test_a_checkpoint_holding_other_pickled_objects_is_refused_as_unsafe_not_as_damaged(tmp_path):
    torch.save({"step": 1, "extra": Opaque()}, tmp_path / "last.ckpt")
    with pytest.raises(CheckpointError, match=r"last\.ckpt holds pickled objects other than tensors and plain values"):
        load_checkpoint_file(tmp_path / "last.ckpt", weights_only=True)


def test_a_flipped_byte_past_the_first_16_mib_of_a_record_is_refused(tmp_path):
    """check_records reads a record in 16 MiB pieces; the CRC is compared only once its last byte is read."""
    weights = torch.ones(5_000_000)  # 20 MB: two pieces
    torch.save({"w": weights}, tmp_path / "last.ckpt")
    data = bytearray((tmp_path / "last.ckpt").read_bytes())
    start = data.index(weights[:1024].numpy().tobytes())
    data[start + (1 << 24) + 100] ^= 0xFF
    (tmp_path / "last.ckpt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"last\.ckpt is damaged .*Bad CRC-32 for file '.*/data/0'"):
        load_checkpoint_file(tmp_path / "last.ckpt")
