"""Checkpoint reading (runtime/checkpoints/read.py): a run that picks its checkpoint and then loads it
checks the file's bytes once, and a checkpoint written anew or damaged since is checked again."""

from __future__ import annotations

import os

import pytest
import torch

import runtime.checkpoints.read as read
from runtime.checkpoints.layout import newest_readable, resume_point


@pytest.fixture
def run_dir(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for step in (2, 4):
        torch.save(
            {"global_step": step, "state_dict": {"model.w": torch.full((64, 64), float(step))}},
            folder / f"step={step}.ckpt",
        )
    return tmp_path


@pytest.fixture
def checks(monkeypatch):
    checked = []
    original = read._check_records

    def counting(path):
        checked.append(os.path.basename(path))
        original(path)

    monkeypatch.setattr(read, "_check_records", counting)
    monkeypatch.setattr(read, "_CHECKED", {})
    return checked


def test_picked_then_loaded_checks_the_bytes_once(run_dir, checks):
    path = resume_point("last", str(run_dir), log=lambda message: None)
    assert os.path.basename(path) == "step=4.ckpt"
    content = read.load_checkpoint_file(path)  # what the trainer's checkpoint reader does next
    assert content["global_step"] == 4 and content["state_dict"]["model.w"][0, 0] == 4
    assert checks == ["step=4.ckpt"]


def test_a_checkpoint_written_anew_or_damaged_after_its_check_is_checked_again(run_dir, checks):
    path = newest_readable(str(run_dir))
    replacement = run_dir / "checkpoints" / "new.tmp"
    torch.save({"global_step": 5, "state_dict": {"model.w": torch.zeros(64, 64)}}, replacement)
    os.replace(replacement, path)  # an atomic rewrite, as checkpoints are written: another file version
    assert read.load_checkpoint_file(path)["global_step"] == 5
    assert checks == ["step=4.ckpt", "step=4.ckpt"]

    # damaged in place after its check: a later read refuses it
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    # a damage a moment later (the file clock's tick is a few ms: this test writes faster than that)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10_000_000))
    with pytest.raises(read.CorruptCheckpointError, match="step=4.ckpt"):
        read.load_checkpoint_file(path)
    # and the run falls back to the older one
    refused = []
    assert os.path.basename(newest_readable(str(run_dir), on_refused=refused.append)) == "step=2.ckpt"
    assert len(refused) == 1 and "does not match its checksum" in refused[0]


def test_a_legacy_format_checkpoint_is_verified_by_reading_it_and_a_relative_path_shares_the_check(
    tmp_path, checks, monkeypatch
):
    legacy = tmp_path / "old.ckpt"
    torch.save({"global_step": 1}, legacy, _use_new_zipfile_serialization=False)
    read.verify_checkpoint(str(legacy))  # not a zip archive: it cannot be mapped, so it is read
    assert read.load_checkpoint_file(str(legacy))["global_step"] == 1

    monkeypatch.chdir(tmp_path)
    torch.save({"global_step": 2}, tmp_path / "new.ckpt")
    read.verify_checkpoint("new.ckpt")
    read.load_checkpoint_file(str(tmp_path / "new.ckpt"))
    assert checks.count("new.ckpt") == 1  # one file version, named two ways: one checksum pass
