"""components/atomic_folder.py: a staged folder goes into place in one step (a rename, or an exchange
with the folder it replaces), never over a folder another writer filled; where the file system cannot
exchange, a previous folder set aside by a writer that died is put back."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import components.atomic_folder as atomic_folder
from components.atomic_folder import SET_ASIDE, clear_stale, put_in_place, siblings, staging_path


def _folder(path, text: str):
    path.mkdir()
    (path / "data.txt").write_text(text)
    return path


def test_a_staged_folder_goes_into_place_and_replaces_only_when_asked(tmp_path):
    out = tmp_path / "out"
    put_in_place(_folder(staging_path(out), "first"), out)
    assert (out / "data.txt").read_text() == "first" and siblings(out) == []
    with pytest.raises(OSError):  # a folder that holds something is not replaced unless asked
        put_in_place(_folder(staging_path(out), "second"), out)
    assert (out / "data.txt").read_text() == "first"
    put_in_place(staging_path(out), out, replace=True)
    assert (out / "data.txt").read_text() == "second" and siblings(out) == []
    (tmp_path / "empty").mkdir()  # an empty folder is taken over
    put_in_place(_folder(staging_path(tmp_path / "empty"), "third"), tmp_path / "empty")
    assert (tmp_path / "empty" / "data.txt").read_text() == "third"


def test_without_an_exchange_the_previous_folder_is_set_aside_then_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic_folder, "_exchange", lambda a, b: False)
    out = _folder(tmp_path / "out", "old")
    put_in_place(_folder(staging_path(out), "new"), out, replace=True)
    assert (out / "data.txt").read_text() == "new" and siblings(out) == []


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_what_dead_writers_left_is_cleared_and_a_set_aside_folder_put_back(tmp_path):
    out = tmp_path / "out"
    pid = _dead_pid()
    _folder(tmp_path / f".out.{SET_ASIDE}-{pid}", "previous")  # died between its two renames
    _folder(tmp_path / f".out.tmp-{pid}", "complete but never put in place")
    live = _folder(staging_path(out), "this process's own")
    (tmp_path / ".out.lock").write_text("")
    clear_stale(out)
    assert (out / "data.txt").read_text() == "previous"
    assert sorted(p.name for p in siblings(out)) == sorted([live.name, ".out.lock"])  # live writers kept
    assert os.path.isdir(live)
