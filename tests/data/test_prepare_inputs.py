"""prepare.py on awkward inputs: text that spells a special token, link loops, paths that look like
patterns, deep JSON, the output folder inside an input, compressed files, inputs that hold nothing,
odd digits, lone surrogates, and two preparations of one folder at once."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

import prepare as prepare_cli
from components.data.text.output_lock import OutputLock, lock_path
from components.data.text.prepared import PreparedFolder
from tests.data.text_fixtures import paragraph, write_jsonl, write_text_folder
from tests.helpers import REPO, tree_hash


def _cli(capsys, *argv):
    rc = prepare_cli.main([*map(str, argv), "--quiet"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _texts(folder: Path) -> list[str]:
    """Every document of a prepared folder, decoded, train then validation."""
    f = PreparedFolder.open(folder)
    texts = []
    for split in ("train", "val"):
        tokens, offsets = f.tokens(split), f.document_offsets(split)
        for a, b in zip(offsets[:-1], offsets[1:]):
            ids = tokens[a:b].tolist()
            assert ids[-1] == f.eod_id and f.eod_id not in ids[:-1]  # one document end, at the end
            texts.append(f.tokenizer.decode(ids[:-1]))
    return texts


def _refused(capsys, tmp_path, argv, message):
    """One message naming the thing, exit 2, no traceback, nothing written, inputs untouched."""
    before = tree_hash(tmp_path)
    rc, _, err = _cli(capsys, *argv)
    assert rc == 2, err
    assert err.startswith("prepare.py: error: ") and message in err and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert tree_hash(tmp_path) == before
    return err


@pytest.mark.parametrize("tokenizer", ["bpe:300", "bytes"])
def test_text_that_spells_a_special_token_stays_text(tmp_path, capsys, tokenizer):
    src = write_text_folder(tmp_path / "src", n_files=12)
    special = "a chat log: <|endoftext|> then <|padding|> and <|endoftext|><|endoftext|> again\n"
    (src / "special.txt").write_text(special)
    rc, _, err = _cli(capsys, src, "--out", tmp_path / "out", "--tokenizer", tokenizer, "--val-fraction", "0.3")
    assert rc == 0, err
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["token_bytes_exact"] is True
    texts = _texts(tmp_path / "out")
    assert special in texts and len(texts) == 13


def test_a_link_loop_is_followed_once_and_named(tmp_path, capsys):
    src = write_text_folder(tmp_path / "src", n_files=12)
    os.symlink("..", src / "part0" / "loop")  # part0/loop -> src
    os.symlink(src / "part1", src / "again")  # a second way into part1
    for form, argv in (("pattern", [f"{src}/**/*.txt"]), ("folder", [src])):
        out = tmp_path / f"out-{form}"
        rc, stdout, err = _cli(capsys, *argv, "--out", out, "--val-fraction", "0.3")
        assert rc == 0, err
        meta = json.loads((out / "meta.json").read_text())
        assert sum(s["documents"] for s in meta["splits"].values()) == 12  # no file read twice
        assert "part0/loop: a directory link back to a folder already read" in stdout
        assert sorted(_texts(out)) == sorted(p.read_text() for p in src.glob("part*/*.txt"))


def test_an_existing_path_is_never_a_pattern(tmp_path, capsys):
    (tmp_path / "notes[1].txt").write_text("the bracketed one\n" * 50)
    (tmp_path / "notes1.txt").write_text("the other one\n" * 50)
    for i in range(6):
        (tmp_path / f"more{i}.txt").write_text(paragraph(random.Random(i), 100))
    rc, _, err = _cli(
        capsys, tmp_path / "notes[1].txt", *sorted(tmp_path.glob("more*.txt")), "--out", tmp_path / "out",
        "--val-fraction", "0.3",
    )  # fmt: skip
    assert rc == 0, err
    texts = _texts(tmp_path / "out")
    assert "the bracketed one\n" * 50 in texts and "the other one\n" * 50 not in texts


def test_json_nested_too_deeply_is_named(tmp_path, capsys):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"text": "fine"}\n' + '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    _refused(capsys, tmp_path, [path, "--out", tmp_path / "out"], "deep.jsonl:2: the JSON is nested too deeply")


def test_the_output_folder_inside_an_input_is_not_an_input(tmp_path, capsys):
    src = write_text_folder(tmp_path / "src", n_files=8)
    argv = [src, "--out", src / "prepared", "--val-fraction", "0.3"]
    rc, _, err = _cli(capsys, *argv)
    assert rc == 0, err
    first = tree_hash(src / "prepared")
    rc, stdout, err = _cli(capsys, *argv)  # the same command again: the folder itself is not an input
    assert rc == 0 and "reusing it" in stdout, err
    assert tree_hash(src / "prepared") == first
    assert not [p for p in src.iterdir() if p.name.startswith(".")]  # no lock or temporary left beside it
    _refused(capsys, tmp_path, [src / "prepared", "--out", src / "prepared"], "it is the output folder")


def test_compressed_inputs_are_read(tmp_path, capsys):
    plain = write_jsonl(tmp_path / "plain.jsonl", n=30)
    data = plain.read_bytes()
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl.gz").write_bytes(gzip.compress(data))
    (src / "b.jsonl.bz2").write_bytes(bz2.compress(data))
    (src / "c.jsonl.xz").write_bytes(lzma.compress(data))
    (src / "d.txt.gz").write_bytes(gzip.compress("a gzipped text file\n".encode() * 40))
    rc, _, err = _cli(capsys, src, "--out", tmp_path / "out", "--val-fraction", "0.3")
    assert rc == 0, err
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert sum(s["documents"] for s in meta["splits"].values()) == 3 * 30 + 1
    assert meta["read"]["binary_files_skipped"] == 0
    texts = _texts(tmp_path / "out")
    records = [json.loads(line)["text"] for line in data.decode().splitlines()]
    assert sorted(texts) == sorted(records * 3 + ["a gzipped text file\n" * 40])


def test_a_corrupt_compressed_file_is_named(tmp_path, capsys):
    write_text_folder(tmp_path / "src", n_files=6)
    (tmp_path / "src" / "broken.txt.gz").write_bytes(gzip.compress(paragraph(random.Random(0), 400).encode())[:-12])
    _refused(capsys, tmp_path, [tmp_path / "src", "--out", tmp_path / "out"], "broken.txt.gz: not a readable .gz file")


def test_zstd_is_read_or_refused_by_name(tmp_path, capsys):
    (tmp_path / "a.txt.zst").write_bytes(b"(not really zstd)")
    try:
        import zstandard  # noqa: F401
    except ImportError:
        _refused(capsys, tmp_path, [tmp_path / "a.txt.zst", "--out", tmp_path / "out"], "a.txt.zst: reading .zst")
    else:
        _refused(capsys, tmp_path, [tmp_path / "a.txt.zst", "--out", tmp_path / "out"], "a.txt.zst: not a readable")


def test_nothing_to_prepare_names_each_input_and_why(tmp_path, capsys):
    empties = tmp_path / "empties"
    empties.mkdir()
    for i in range(3):
        (empties / f"e{i}.txt").write_text("")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (blobs / "x.bin").write_bytes(b"\0\1\2" * 100)
    err = _refused(capsys, tmp_path, [empties, blobs, "--out", tmp_path / "out"], "nothing to prepare")
    assert f"input '{empties}': no documents (3 file(s), 3 empty document(s))" in err
    assert f"input '{blobs}': no documents (1 file(s), 1 binary file(s) skipped" in err
    assert "--val-fraction" not in err


def test_a_vocabulary_size_in_other_digits_is_refused(tmp_path, capsys):
    src = write_text_folder(tmp_path / "src", n_files=4)
    for spec in ("bpe:²", "bpe:٣٠٠", "bpe:3e3"):
        _refused(
            capsys, tmp_path, [src, "--tokenizer", spec, "--out", tmp_path / "out"], f"tokenizer '{spec}': the vocab"
        )


def test_a_lone_surrogate_is_one_replacement(tmp_path, capsys):
    path = write_jsonl(tmp_path / "docs.jsonl", n=20)
    with open(path, "a") as f:
        f.write('{"text": "before \\ud800 after, and a pair \\ud83d\\ude00 kept"}\n')
    rc, _, err = _cli(capsys, path, "--out", tmp_path / "out", "--val-fraction", "0.3")
    assert rc == 0, err
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["read"]["replaced_characters"] == 1
    assert "before \ufffd after, and a pair \U0001f600 kept" in _texts(tmp_path / "out")


def _start_prepare(*argv) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "prepare.py", *map(str, argv), "--quiet"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},  # its lines arrive as it prints them
    )


def test_a_second_preparation_of_one_folder_waits_then_reuses_or_refuses(tmp_path):
    a = write_text_folder(tmp_path / "a", n_files=8, seed=1)
    b = write_text_folder(tmp_path / "b", n_files=8, seed=2)
    out = tmp_path / "out"
    with OutputLock(out):  # a preparation of ``out`` is under way
        same = _start_prepare(a, "--out", out, "--val-fraction", "0.3")
        said = ""
        while "waiting for it" not in said:  # it says so once it finds the folder's lock held
            said = same.stdout.readline()
            assert said, "the second preparation ended without waiting for the first"
        time.sleep(1.0)
        assert same.poll() is None and not out.exists()  # it waits instead of writing beside the holder
    stdout, stderr = same.communicate(timeout=300)
    assert same.returncode == 0, stderr
    first = tree_hash(out)
    # two at once on one folder, different inputs: one prepares, the other is refused, nothing collides
    procs = [_start_prepare(src, "--out", tmp_path / "both", "--val-fraction", "0.3") for src in (a, b)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert sorted(rc for rc, _ in results) == [0, 2], results
    assert "holds data prepared from other inputs" in next(err for rc, err in results if rc == 2)
    assert "Traceback" not in "".join(err for _, err in results)
    assert tree_hash(out) == first
    assert not lock_path(out).exists() and not lock_path(tmp_path / "both").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
