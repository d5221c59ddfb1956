"""prepare.py: inputs, tokenizers, the folder it writes, reuse, atomicity, and every bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import prepare as prepare_cli
from components.data.text.documents import ReadOptions, ReadStats, read_documents, split_of
from components.data.text.input_files import expand_input
from components.data.text.pipeline import PrepareError, PrepareOptions, prepare
from components.data.text.prepared import PreparedFolder
from components.data.text.tokenizers import load_tokenizer_file
from tests.data.text_fixtures import write_jsonl, write_text_folder
from tests.helpers import REPO


def _prepare(inputs, out, tokenizer="bytes", **kw):
    read = ReadOptions(**{k: kw.pop(k) for k in list(kw) if k in ("format", "text_field", "id_field", "binary")})
    kw.setdefault("val_fraction", 0.3)  # small inputs: a large enough validation split
    return prepare(
        PrepareOptions(
            inputs=[str(i) for i in inputs], out=str(out), tokenizer=tokenizer, read=read, progress=False, **kw
        ),
        log=lambda m: None,
    )


def _documents(folder: PreparedFolder, split: str) -> list[np.ndarray]:
    tokens = np.asarray(folder.tokens(split))
    offsets = folder.document_offsets(split)
    return [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


@pytest.fixture(scope="module", params=["stdlib:docs", "stdlib:code"])
def stdlib_bpe(request, tmp_path_factory):
    """An embedded corpus in byte-level BPE 8192: the natural-language one prepared here, the code one (the
    default data) from the shared cache, as train.py prepares it."""
    if request.param == "stdlib:docs":
        out = tmp_path_factory.mktemp("prep") / "docs-bpe8k"
        _prepare(["stdlib:docs"], out, "bpe:8192", val_fraction=0.1)
        return request.param, 0.1, PreparedFolder.open(out)
    from components.data.cached_text import CodeConfig, CodeCorpus

    cfg = CodeConfig(seq_len=64, batch_size=2, val_tokens=1024)
    CodeCorpus(cfg, seed=0)  # prepares it (under the cache's lock) unless already there
    return request.param, cfg.val_fraction, PreparedFolder.open(cfg.folder())


def test_bpe_round_trips_every_validation_document_byte_exactly(stdlib_bpe):
    source, val_fraction, folder = stdlib_bpe
    tok = folder.tokenizer
    val_texts = [
        d.text
        for d in read_documents([expand_input(source)], ReadOptions(), ReadStats())
        if split_of(d.identity, val_fraction) == "val"
    ]
    encoded = _documents(folder, "val")
    assert len(val_texts) == len(encoded) == folder.meta["splits"]["val"]["documents"] > 20
    table = tok.token_bytes()
    for text, ids in zip(val_texts, encoded):
        assert ids[-1] == folder.eod_id and folder.eod_id not in ids[:-1]
        assert tok.decode(ids[:-1].tolist()) == text
        assert b"".join(table[i] for i in ids[:-1].tolist()) == text.encode("utf-8")
    m = folder.meta
    assert m["vocab_size"] == 8192 and m["dtype"] == "uint16" and m["token_bytes_exact"]
    assert m["splits"]["val"]["bytes"] == sum(len(t.encode()) for t in val_texts)
    bytes_per_token = m["splits"]["train"]["bytes"] / (
        m["splits"]["train"]["tokens"] - m["splits"]["train"]["documents"]
    )
    assert 3.0 < bytes_per_token < 5.0  # text and code with an 8k BPE


def test_folder_layout_and_meta(tmp_path):
    src = write_text_folder(tmp_path / "src")
    result = _prepare([src], tmp_path / "out", "bpe:400", val_fraction=0.2)
    folder = PreparedFolder.open(result.folder)
    m = folder.meta
    assert {p.name for p in result.folder.iterdir()} == {
        "meta.json",
        "tokenizer.json",
        "train.bin",
        "val.bin",
        "train.docs.npy",
        "val.docs.npy",
    }
    assert (
        m["tokenizer"]["kind"] == "bpe"
        and m["tokenizer"]["spec"] == "bpe:400"
        and m["tokenizer"]["eod_id"] == 0
        and m["tokenizer"]["pad_id"] == 1
    )
    assert m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == 60
    for split in ("train", "val"):
        docs = _documents(folder, split)
        assert all(d[-1] == 0 for d in docs)  # each document ends with the end-of-document token
        assert sum(len(d) for d in docs) == m["splits"][split]["tokens"]
    total = sum(p.stat().st_size for p in src.rglob("*.txt"))
    assert m["splits"]["train"]["bytes"] + m["splits"]["val"]["bytes"] == total


def test_split_follows_document_identity_when_files_are_added(tmp_path):
    src = write_text_folder(tmp_path / "src", n_files=40)
    a = PreparedFolder.open(_prepare([src], tmp_path / "a", val_fraction=0.25).folder)
    write_text_folder(tmp_path / "src2", n_files=80)  # the same 40 files plus 40 more (same seed: same first files)
    b = PreparedFolder.open(_prepare([tmp_path / "src2"], tmp_path / "b", val_fraction=0.25).folder)
    val_a = {bytes(d) for d in (x.astype(np.uint8) for x in _documents(a, "val"))}
    val_b = {bytes(d) for d in (x.astype(np.uint8) for x in _documents(b, "val"))}
    assert val_a and val_a <= val_b  # no validation document of the smaller set moved to training


def test_same_inputs_and_options_reuse_the_folder(tmp_path):
    src = write_text_folder(tmp_path / "src", n_files=10)
    first = _prepare([src], tmp_path / "out")
    stamp = (first.folder / "train.bin").stat().st_mtime_ns
    again = _prepare([src], tmp_path / "out")
    assert again.reused and (first.folder / "train.bin").stat().st_mtime_ns == stamp
    (src / "part0" / "doc000.txt").write_text("changed content\n")
    with pytest.raises(PrepareError, match="prepared from other inputs or options.*--overwrite"):
        _prepare([src], tmp_path / "out")
    assert (first.folder / "train.bin").stat().st_mtime_ns == stamp  # untouched
    assert not _prepare([src], tmp_path / "out", overwrite=True).reused


def test_a_crash_leaves_no_folder_and_keeps_an_existing_one(tmp_path, monkeypatch):
    src = write_text_folder(tmp_path / "src", n_files=10)
    import components.data.text.pipeline as pipeline

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "_write_json", boom)  # dies after the tokens, before meta.json
    with pytest.raises(KeyboardInterrupt):
        _prepare([src], tmp_path / "new")
    assert not (tmp_path / "new").exists() and not list(tmp_path.glob(".new.tmp-*"))
    monkeypatch.undo()
    existing = _prepare([src], tmp_path / "old").folder
    before = {p.name: p.read_bytes() for p in existing.iterdir()}
    monkeypatch.setattr(pipeline, "_write_json", boom)
    with pytest.raises(KeyboardInterrupt):
        _prepare([src], existing, "bpe:300", overwrite=True)
    assert {p.name: p.read_bytes() for p in existing.iterdir()} == before


def test_jsonl_and_parquet_inputs(tmp_path):
    jl = write_jsonl(tmp_path / "a.jsonl", n=30)
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in jl.read_text().splitlines()]
    pq.write_table(
        pa.table({"body": [r["text"] for r in rows], "key": [r["id"] for r in rows]}), tmp_path / "b.parquet"
    )
    from_jsonl = PreparedFolder.open(_prepare([jl], tmp_path / "j", id_field="id", val_fraction=0.3).folder)
    from_parquet = PreparedFolder.open(
        _prepare([tmp_path / "b.parquet"], tmp_path / "p", text_field="body", id_field="key", val_fraction=0.3).folder
    )
    # same texts, same identities: the same split and the same tokens
    for split in ("train", "val"):
        assert np.array_equal(np.asarray(from_jsonl.tokens(split)), np.asarray(from_parquet.tokens(split)))
    assert from_jsonl.meta["splits"]["train"]["documents"] + from_jsonl.meta["splits"]["val"]["documents"] == 30


def test_an_existing_tokenizer_file_gives_the_same_tokens_and_hash(tmp_path):
    src = write_text_folder(tmp_path / "src", n_files=20)
    a = PreparedFolder.open(_prepare([src], tmp_path / "a", "bpe:350").folder)
    b = PreparedFolder.open(_prepare([src], tmp_path / "b", str(a.path / "tokenizer.json")).folder)
    assert b.tokenizer_hash == a.tokenizer_hash and b.meta["tokenizer"]["kind"] == "file"
    assert np.array_equal(np.asarray(a.tokens("train")), np.asarray(b.tokens("train")))


def test_large_vocabulary_uses_uint32_and_a_non_byte_level_tokenizer_is_marked_inexact(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {
        "<|endoftext|>": 0,
        "[UNK]": 1,
        **{
            w: i + 2
            for i, w in enumerate(
                sorted(
                    set(
                        " ".join(
                            open(write_text_folder(tmp_path / "src", n_files=5) / "part0" / "doc000.txt").read().split()
                        ).split()
                    )
                )
            )
        },
    }
    vocab.update({f"w{i}": len(vocab) + i for i in range(70_000)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "word.json"))
    assert load_tokenizer_file(tmp_path / "word.json").vocab_size > 65536
    folder = PreparedFolder.open(
        _prepare([tmp_path / "src"], tmp_path / "out", str(tmp_path / "word.json"), val_fraction=0.3).folder
    )
    assert folder.dtype == "uint32" and folder.tokens("train").dtype == np.uint32
    assert not folder.meta["token_bytes_exact"]  # whitespace is not a token here


# -- bad input: one message naming the file, exit status 2, nothing written -----------------------------
def _cli(capsys, *argv):
    rc = prepare_cli.main([*map(str, argv), "--quiet"])
    return rc, capsys.readouterr().err


def _bad_inputs(tmp_path):
    good = write_text_folder(tmp_path / "good", n_files=6)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "empty_dir").mkdir()
    mixed = write_text_folder(tmp_path / "mixed", n_files=6)
    (mixed / "blob.bin").write_bytes(b"\x7fELF\x00\x01\x02" * 100)
    write_jsonl(tmp_path / "fields.jsonl", n=5, field="content")
    (tmp_path / "broken.json").write_text("{not a tokenizer")
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "fine"}\n{"text": "ok", \n')
    return {
        "missing path": ([tmp_path / "nope"], [], "no such file or folder"),
        "empty file": ([tmp_path / "empty.txt"], [], "the file is empty"),
        "empty folder": ([tmp_path / "empty_dir"], [], "the folder holds no files"),
        "glob matching nothing": ([tmp_path / "*.md"], [], "matches no files"),
        "binary file refused": ([mixed], ["--binary", "error"], "blob.bin: a binary file"),
        "JSONL line without the text field": ([tmp_path / "fields.jsonl"], [], "fields.jsonl:1: no field 'text'"),
        "JSONL line that is not JSON": ([bad_json], [], "bad.jsonl:2: not a JSON line"),
        "tokenizer file that does not load": (
            [good],
            ["--tokenizer", tmp_path / "broken.json"],
            "broken.json does not load",
        ),
        "tokenizer that is neither": ([good], ["--tokenizer", "bpe:12"], "vocabulary size must be"),
        "vocabulary too large for the dtype": (
            [good],
            ["--tokenizer", "bpe:70000", "--dtype", "uint16"],
            "70,000 ids does not fit",
        ),
        "unknown embedded source": (["stdlib:nope"], [], "unknown embedded source"),
    }


BAD_CASES = [
    "missing path",
    "empty file",
    "empty folder",
    "glob matching nothing",
    "binary file refused",
    "JSONL line without the text field",
    "JSONL line that is not JSON",
    "tokenizer file that does not load",
    "tokenizer that is neither",
    "vocabulary too large for the dtype",
    "unknown embedded source",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_is_refused_with_one_message_and_nothing_written(tmp_path, capsys, case):
    inputs, options, message = _bad_inputs(tmp_path)[case]
    out = tmp_path / "out"
    rc, err = _cli(capsys, *inputs, *options, "--out", out)
    assert rc == 2
    assert err.startswith("prepare.py: error: ") and message in err and err.count("\n") == 1, err
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_binary_files_are_skipped_and_undecodable_bytes_replaced_and_counted(tmp_path, capsys):
    src = write_text_folder(tmp_path / "src", n_files=8)
    (src / "blob.bin").write_bytes(b"\x00\x01binary" * 50)
    (src / "latin1.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e\n".encode("latin-1") * 3)
    rc, _ = _cli(capsys, src, "--out", tmp_path / "out", "--val-fraction", "0.3")
    assert rc == 0
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["read"]["binary_files_skipped"] == 1 and meta["skipped_binary_files"][0].endswith("blob.bin")
    assert meta["read"]["replaced_characters"] == 12
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == 9


def test_output_folder_holding_something_else_is_refused(tmp_path, capsys):
    src = write_text_folder(tmp_path / "src", n_files=4)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    rc, err = _cli(capsys, src, "--out", tmp_path / "out", "--overwrite")
    assert rc == 2 and "is not a prepared folder" in err
    assert os.listdir(tmp_path / "out") == ["notes.txt"]


def test_command_line_help_and_exit_status():
    proc = subprocess.run(
        [sys.executable, "prepare.py", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and "--tokenizer" in proc.stdout and "stdlib:docs" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "prepare.py", "does/not/exist", "--out", "x", "--quiet"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "no such file or folder" in proc.stderr
