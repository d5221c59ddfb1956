"""analysis.export refuses a bad OUT, --max-shard-gb or override by name before anything loads: one line,
exit status 2, no traceback, nothing written; a full disk while exporting leaves nothing at OUT and says so."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from analysis.export import main
from components.model import Decoder
from tests.helpers import compose_root, run_python, save_run, tree_hash

PROG = "python -m analysis.export: error: "


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = compose_root("model=tiny", "data=corpus")
    torch.manual_seed(0)
    return save_run(root, Decoder(root.decoder_config()), tmp_path_factory.mktemp("export-args") / "run")


def _refused(capsys, tmp_path, argv, message, status=2):
    """The message names the thing, the exit status is ``status``, no traceback, nothing under
    ``tmp_path`` written or changed."""
    before = tree_hash(tmp_path)
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exit_:  # argparse's refusal of an option
        rc = exit_.code
    err = capsys.readouterr().err
    assert rc == status, err
    *usage, line = err.rstrip("\n").split("\n")  # argparse shows the usage above its one-line message
    assert line.startswith(PROG) and message in line and "Traceback" not in err, err
    assert all(u.startswith(("usage:", " ")) for u in usage), err
    assert tree_hash(tmp_path) == before
    return line


def test_an_out_below_a_regular_file_is_refused(run, tmp_path, capsys):
    (tmp_path / "notes").write_text("mine")
    err = _refused(capsys, tmp_path, [run, tmp_path / "notes" / "model"], "is a file, not a folder")
    assert "OUT" in err and str(tmp_path / "notes") in err


def test_an_out_that_holds_something_is_refused(run, tmp_path, capsys):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "notes.txt").write_text("mine")
    _refused(capsys, tmp_path, [run, tmp_path / "model"], f"OUT {tmp_path / 'model'} exists")
    (tmp_path / "file").write_text("mine")
    _refused(capsys, tmp_path, [run, tmp_path / "file"], f"OUT {tmp_path / 'file'} exists")


@pytest.mark.parametrize(
    "value, message",
    [
        ("nan", "must be a finite number, got nan"),
        ("inf", "must be a finite number, got inf"),
        ("0", "must be > 0, got 0"),
        ("-1", "must be > 0, got -1"),
        ("big", "'big' is not a number"),
    ],
)
def test_a_bad_shard_size_is_refused_naming_the_option(run, tmp_path, capsys, value, message):
    _refused(
        capsys, tmp_path, [run, tmp_path / "model", "--max-shard-gb", value], f"argument --max-shard-gb: {message}"
    )


def test_a_run_that_does_not_load_is_named(tmp_path, capsys):
    (tmp_path / "bad.ckpt").write_bytes(b"not a checkpoint")
    _refused(capsys, tmp_path, [tmp_path / "bad.ckpt", tmp_path / "model"], "bad.ckpt is unreadable")
    _refused(capsys, tmp_path, [tmp_path / "missing", tmp_path / "model"], "no such run folder")


def test_check_only_with_an_unknown_component_is_one_line_exit_2(tmp_path):
    before = tree_hash(tmp_path)
    proc = run_python("-m", "analysis.export", "--check-only", str(tmp_path), "mixer=mhaa", timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(PROG) and "mixer" in proc.stderr and "'mhaa'" in proc.stderr, proc.stderr
    assert "Did you mean 'mha'?" in proc.stderr and "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    assert tree_hash(tmp_path) == before


def test_check_only_names_a_folder_without_weights_with_exit_1(tmp_path, capsys):
    _refused(capsys, tmp_path, ["--check-only", tmp_path, "model=tiny"], "no model.safetensors", status=1)


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("where", ["weights", "config"])
def test_a_full_disk_leaves_nothing_at_out_and_says_so(run, tmp_path, capsys, monkeypatch, where):
    import safetensors.torch

    import components.hf.config_json as config_json

    if where == "weights":
        monkeypatch.setattr(safetensors.torch, "save_file", _no_space)
    else:  # after every weight file is written
        import components.hf.export_folder as export_folder

        monkeypatch.setattr(config_json, "write_config", _no_space)
        monkeypatch.setattr(export_folder, "write_config", _no_space)
    out = tmp_path / "model"
    err = _refused(capsys, tmp_path, [run, out], "No space left on device", status=1)
    assert f"writing {out} failed" in err and f"nothing was written at {out}" in err
    monkeypatch.undo()
    assert main([str(run), str(out)]) == 0  # once there is space, the same command exports
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging folder left beside it
