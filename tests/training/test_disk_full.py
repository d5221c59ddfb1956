"""A full disk while a checkpoint is written: the temporary goes, every checkpoint written before stays
byte-identical, and the run stops with one message naming the checkpoint (exit status 4, no traceback)."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import runtime.checkpoints.write as checkpoint_io
from runtime.checkpoints.read import load_checkpoint_file
from runtime.checkpoints.write import AtomicCheckpointIO, CheckpointWriteError
from tests.helpers import only_run_dir, run_train


class _FillingUp:
    """A file that takes ``room`` bytes, then fails every write with ENOSPC, as a full disk does."""

    def __init__(self, path, mode, room: int):
        self.f = open(path, mode)
        self.room = room

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_a_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "checkpoints" / "last.ckpt"
    io.save_checkpoint({"step": 1, "w": torch.ones(4)}, str(path))
    before = path.read_bytes()
    monkeypatch.setattr(checkpoint_io, "open", lambda p, mode: _FillingUp(p, mode, room=2000), raising=False)
    with pytest.raises(CheckpointWriteError) as err:
        io.save_checkpoint({"step": 2, "w": torch.zeros(100_000)}, str(path))  # torch.save's write fails
    assert str(err.value).startswith(f"could not write checkpoint {path} (No space left on device)")
    assert "the previous last.ckpt is intact" in str(err.value)
    assert path.read_bytes() == before and os.listdir(path.parent) == ["last.ckpt"]  # no temporary left
    monkeypatch.undo()
    with pytest.raises(CheckpointWriteError, match=r"step=2.ckpt \(No space.*; nothing was written under that name"):
        monkeypatch.setattr(checkpoint_io, "open", lambda p, mode: _FillingUp(p, mode, room=0), raising=False)
        io.save_checkpoint({"step": 2}, str(path.with_name("step=2.ckpt")))
    assert os.listdir(path.parent) == ["last.ckpt"]


def test_a_run_whose_disk_fills_up_stops_with_one_message_and_its_checkpoints_intact(tmp_path):
    # train.py in a process of its own: the exit status and the console are the contract here
    result = run_train(
        "model=tiny",
        "data=corpus",
        "data.seq_len=32",
        "data.batch_size=4",
        "data.val_tokens=256",
        "trainer.max_steps=4",
        "trainer.checkpoint_every_n_steps=2",
        "trainer.val_check_interval=100",
        "trainer.enable_progress_bar=false",
        "trainer.compile=false",
        "trainer.max_time_minutes=null",
        "logger=csv",
        # writes: step=2.ckpt, last.ckpt, then step=4.ckpt finds the disk full
        "+callbacks.full={_target_:runtime.callbacks.fault_injection.DiskFull,at_write:3}",
        f"output_root={tmp_path}",
    )
    assert result.returncode == 4, result.stderr[-3000:]
    ckpts = only_run_dir(tmp_path) / "checkpoints"
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: could not write checkpoint {ckpts / 'step=4.ckpt'} (No space left on device); nothing was written "
        "under that name and every checkpoint written before is intact (free space, then resume with ckpt_path=last)"
    ], result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert sorted(os.listdir(ckpts)) == ["last.ckpt", "step=2.ckpt"]  # no temporary, no half checkpoint
    assert load_checkpoint_file(str(ckpts / "last.ckpt"))["global_step"] == 2
