"""A prepared token folder: what ``prepare.py`` writes and the datasets read.

    meta.json         tokenizer (kind, spec, hash, vocabulary, special ids), dtype, per split the
                      document, token and UTF-8 byte counts, the inputs and options it came from
    tokenizer.json    the tokenizer (absent for ``bytes``)
    train.bin         the training documents' tokens, each document followed by the end-of-document token
    val.bin           the same for validation (uint16 or uint32, by vocabulary size)
    train.docs.npy    int64 offsets: document i is tokens [docs[i], docs[i+1]) (its end token included)
    val.docs.npy

``meta.json`` is written last, and the folder appears under its name only when complete, so a folder
with a ``meta.json`` is a finished one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from components.data.text.tokenizers import TextTokenizer, TokenizerError, load_prepared_tokenizer

FORMAT = "k3-sandbox/prepared-text"
VERSION = 1
META = "meta.json"
SPLITS = ("train", "val")
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def bytes_per_token(split: dict) -> float:
    """UTF-8 bytes per text token of a split's ``meta.json`` counts (end-of-document tokens excluded)."""
    return split["bytes"] / max(split["tokens"] - split["documents"], 1)


class PreparedFolderError(ValueError):
    """A folder that is not a usable prepared folder; the message names it and what is wrong."""


def is_prepared(path: str | Path) -> bool:
    return (Path(path) / META).is_file()


def read_meta(folder: str | Path) -> dict:
    path = Path(folder) / META
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise PreparedFolderError(f"{path}: not a readable meta.json ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise PreparedFolderError(
            f"{path}: not a prepared-text meta.json (format should be '{FORMAT}'); make the folder with prepare.py"
        )
    if meta.get("version") != VERSION:
        raise PreparedFolderError(
            f"{path}: format version {meta.get('version')} is not the supported {VERSION}; prepare the folder again"
        )
    return meta


@dataclass
class PreparedFolder:
    """A checked prepared folder: its meta, tokenizer, and token memmaps."""

    path: Path
    meta: dict
    tokenizer: TextTokenizer

    @classmethod
    def open(cls, folder: str | Path) -> "PreparedFolder":
        path = Path(folder)
        meta = read_meta(path)
        try:
            tokenizer = load_prepared_tokenizer(path, meta["tokenizer"])
        except TokenizerError as err:
            raise PreparedFolderError(str(err)) from None
        dtype = DTYPES[meta["dtype"]]
        for split in SPLITS:
            tokens = path / f"{split}.bin"
            expected = meta["splits"][split]["tokens"] * np.dtype(dtype).itemsize
            if not tokens.is_file() or tokens.stat().st_size != expected:
                found = tokens.stat().st_size if tokens.is_file() else "no file"
                raise PreparedFolderError(
                    f"{tokens}: expected {expected} bytes ({meta['splits'][split]['tokens']} {meta['dtype']} tokens, "
                    f"per meta.json), found {found}"
                )
        return cls(path, meta, tokenizer)

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def dtype(self) -> str:
        return self.meta["dtype"]

    @property
    def eod_id(self) -> int:
        return int(self.meta["tokenizer"]["eod_id"])

    @property
    def tokenizer_hash(self) -> str:
        return self.meta["tokenizer"]["hash"]

    def tokens(self, split: str) -> np.ndarray:
        return np.memmap(self.path / f"{split}.bin", dtype=DTYPES[self.dtype], mode="r")

    def document_offsets(self, split: str) -> np.ndarray:
        return np.load(self.path / f"{split}.docs.npy")

    def describe(self) -> str:
        s = self.meta["splits"]
        return (
            f"{self.path} ({self.meta['tokenizer']['spec']}, vocab {self.vocab_size:,}): "
            f"{s['train']['tokens']:,} train / {s['val']['tokens']:,} val tokens, "
            f"{bytes_per_token(s['val']):.2f} bytes per token"
        )
