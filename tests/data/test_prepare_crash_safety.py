"""prepare.py killed (SIGKILL) right before any one of its writes leaves either the previous folder
byte-identical, the complete new one, or nothing; the next run clears what the killed one left beside
the folder. A full disk leaves the previous folder as it was and says so."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import prepare as prepare_cli
from components.data.text.prepared import META, is_prepared
from tests.data.text_fixtures import write_text_folder
from tests.helpers import run_killed_at_write, tree_hash

OLD = ["--val-fraction", "0.3", "--quiet"]
NEW = ["--val-fraction", "0.25", "--overwrite", "--quiet"]  # other options: the folder is replaced


def _content(folder: Path) -> tuple[str, str]:
    """(hash of everything but meta.json, the preparation's hash): meta.json also records the seconds taken."""
    h = tree_hash(folder)
    meta = json.loads((folder / META).read_text())
    (folder / META).rename(folder.parent / "meta.aside")
    try:
        return tree_hash(folder), meta["prepare_hash"]
    finally:
        (folder.parent / "meta.aside").rename(folder / META)
        assert tree_hash(folder) == h


@pytest.fixture(scope="module")
def previous(tmp_path_factory):
    """The inputs, a folder prepared from them with OLD options, and the folder NEW options give."""
    root = tmp_path_factory.mktemp("prepare-kill")
    src = write_text_folder(root / "src", n_files=8)
    assert prepare_cli.main([str(src), "--out", str(root / "old" / "out"), *OLD]) == 0
    assert prepare_cli.main([str(src), "--out", str(root / "new" / "out"), *NEW]) == 0
    return src, root / "old" / "out", _content(root / "new" / "out")


def _leftovers(work: Path) -> list[str]:
    return sorted(p.name for p in work.iterdir() if p.name != "out")


def test_an_overwrite_killed_at_any_write_leaves_the_previous_folder_or_the_new_one(previous, tmp_path):
    src, old, new = previous
    old_hash = tree_hash(old)
    argv = [src, "--out", tmp_path / "count" / "out", *NEW]
    shutil.copytree(old, tmp_path / "count" / "out")
    proc, writes = run_killed_at_write("prepare.py", argv, tmp_path / "count", 0)
    assert proc.returncode == 0 and writes > 10, proc.stderr
    seen = set()
    for n in range(1, writes + 1):  # right before each write: the lock, the staging folder, every file, the swap
        work = tmp_path / f"kill-{n}"
        shutil.copytree(old, work / "out")
        proc, _ = run_killed_at_write("prepare.py", [src, "--out", work / "out", *NEW], work, n)
        assert proc.returncode == -9, (n, proc.stderr[-2000:])
        if tree_hash(work / "out") == old_hash:
            seen.add("previous")
        else:  # never a half folder: the new one, complete
            assert is_prepared(work / "out") and _content(work / "out") == new, n
            seen.add("new")
        assert all(name.startswith(".out.") for name in _leftovers(work)), (n, _leftovers(work))
    assert seen == {"previous", "new"}  # the kills span the swap
    proc, _ = run_killed_at_write("prepare.py", [src, "--out", work / "out", *NEW], work, 0)
    assert proc.returncode == 0 and _content(work / "out") == new
    rerun = tmp_path / f"kill-{writes // 2}"  # killed before the swap: the rerun replaces the folder
    proc, _ = run_killed_at_write("prepare.py", [src, "--out", rerun / "out", *NEW], rerun, 0)
    assert proc.returncode == 0 and _content(rerun / "out") == new
    assert _leftovers(rerun) == []  # the killed run's staging folder and lock are gone


def test_a_first_preparation_killed_leaves_nothing_or_the_complete_folder(previous, tmp_path):
    src, _, _ = previous
    argv = ["--val-fraction", "0.3", "--quiet"]
    proc, writes = run_killed_at_write("prepare.py", [src, "--out", tmp_path / "count" / "out", *argv], tmp_path, 0)
    assert proc.returncode == 0, proc.stderr
    for n in sorted({2, 4, writes // 2, writes - 1}):
        work = tmp_path / f"kill-{n}"
        proc, _ = run_killed_at_write("prepare.py", [src, "--out", work / "out", *argv], work, n)
        assert proc.returncode == -9, (n, proc.stderr[-2000:])
        assert not (work / "out").exists() or is_prepared(work / "out"), n
        assert all(name.startswith(".out.") for name in _leftovers(work)), (n, _leftovers(work))
        proc, _ = run_killed_at_write("prepare.py", [src, "--out", work / "out", *argv], work, 0)
        assert proc.returncode == 0 and is_prepared(work / "out") and _leftovers(work) == [], n


def test_a_full_disk_leaves_the_previous_folder_and_says_so(previous, tmp_path, capsys, monkeypatch):
    src, old, _ = previous
    out = tmp_path / "out"
    shutil.copytree(old, out)
    before = tree_hash(tmp_path)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(args[0]))

    monkeypatch.setattr(np, "save", no_space)  # after the token files, before the document offsets
    rc = prepare_cli.main([str(src), "--out", str(out), *NEW])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith(f"prepare.py: error: writing {out} failed (No space left on device: "), err
    assert err.rstrip().endswith(f"{out} is as it was"), err
    assert tree_hash(tmp_path) == before  # the previous folder byte-identical, nothing beside it
