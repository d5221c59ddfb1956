"""Token files: a folder made by ``prepare.py``, or bare pre-tokenised files (nanoGPT style).

``data.path`` naming a prepared folder (one with ``meta.json``): the vocabulary size and dtype come from
``meta.json`` (a set ``data.vocab_size`` below it, or another dtype, is refused; a larger vocabulary pads
the embedding table), validation reports bits per byte for any tokenizer, with gzip and xz on the same
validation bytes, and ``data.document_masking`` can keep each token inside its document.

``data.path`` naming a file: a flat array of uint16 or uint32 token ids, validation the last
``val_fraction`` of it or ``val_path``, the vocabulary ``data.vocab_size`` (default 50304), loss only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from omegaconf import MISSING

from components.data.base import DatasetConfig, TokenStreamDataset, check_split_length, prepared_tokenizer
from components.data.text.prepared import DTYPES, PreparedFolder, PreparedFolderError, is_prepared
from components.data.text.stream import PreparedStream
from components.data.text.tokenizers import TextTokenizer
from components.registry import DATASETS, ConfigError

BARE_VOCAB_SIZE = 50304


@dataclass
class MemmapConfig(DatasetConfig):
    name: str = "memmap"
    # a prepared folder (prepare.py), or a file of training tokens
    path: str = MISSING
    # bare files only: validation tokens; None: the last val_fraction of `path` is held out
    val_path: Optional[str] = None
    val_fraction: float = 0.05
    # None: from meta.json (prepared folder) or uint16 (bare files)
    dtype: Optional[str] = None
    # None: from meta.json (prepared folder) or 50304 (bare files); every id in the files must be below it
    vocab_size: Optional[int] = None
    seq_len: int = 256
    batch_size: int = 32
    # evaluate on at most this many validation tokens (None: the whole validation split)
    val_tokens: Optional[int] = 1_000_000
    # attention and recurrent state stop at document boundaries (a prepared folder's end-of-document
    # token, or eod_id for bare files)
    document_masking: bool = False
    # bare files only: the end-of-document token id, for document_masking
    eod_id: Optional[int] = None

    def text_tokenizer(self) -> TextTokenizer:
        if not is_prepared(self.path):
            return super().text_tokenizer()  # bare token files: no tokenizer
        return prepared_tokenizer(self.path)

    @classmethod
    def complete(cls, node: Any, key: str) -> None:
        path = node.get("path")
        if not isinstance(path, str) or not is_prepared(path):
            if node.get("vocab_size") is None:
                node.vocab_size = BARE_VOCAB_SIZE
            if node.get("dtype") is None:
                node.dtype = "uint16"
            return
        folder = _open_folder(path, f"{key}.path")
        vocab = node.get("vocab_size")
        if vocab is None:
            node.vocab_size = folder.vocab_size
        elif vocab < folder.vocab_size:
            raise ConfigError(
                f"{key}.vocab_size",
                f"{vocab} is below the {folder.vocab_size} ids of the tokenizer {path} was prepared with "
                "(meta.json); leave it unset",
            )
        dtype = node.get("dtype")
        if dtype is None:
            node.dtype = folder.dtype
        elif dtype != folder.dtype:
            raise ConfigError(
                f"{key}.dtype",
                f"'{dtype}' contradicts {path}/meta.json, whose tokens are {folder.dtype}; leave it unset",
            )

    def validate(self, model: Any, key: str) -> None:
        if self.seq_len < 2 or self.batch_size < 1:
            raise ConfigError(
                f"{key}.seq_len", f"seq_len must be >= 2 and batch_size >= 1, got {self.seq_len}, {self.batch_size}"
            )
        if self.vocab_size is None or self.vocab_size < 2:
            raise ConfigError(f"{key}.vocab_size", f"must be at least 2, got {self.vocab_size}")
        if self.val_tokens is not None and self.val_tokens < self.seq_len:
            raise ConfigError(f"{key}.val_tokens", f"must be at least seq_len={self.seq_len}, got {self.val_tokens}")
        if is_prepared(self.path):
            folder = _open_folder(self.path, f"{key}.path")
            if self.val_path is not None:
                raise ConfigError(
                    f"{key}.val_path",
                    f"{self.path} is a prepared folder with its own validation split; leave val_path unset",
                )
            if self.eod_id is not None and self.eod_id != folder.eod_id:
                raise ConfigError(
                    f"{key}.eod_id",
                    f"{self.path} ends documents with token {folder.eod_id} (meta.json); leave eod_id unset",
                )
            for split in ("train", "val"):
                n = folder.meta["splits"][split]["tokens"]
                check_split_length(n, self.seq_len, f"{key}.seq_len", f"the {split} split of {self.path}")
            return
        if os.path.isdir(self.path):
            raise ConfigError(
                f"{key}.path",
                f"{self.path} is a folder without meta.json: give a folder made by prepare.py or a token file",
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"{key}.dtype", f"'{self.dtype}' is not allowed; choose one of {', '.join(DTYPES)}")
        if self.document_masking and self.eod_id is None:
            raise ConfigError(
                f"{key}.eod_id", "document_masking on bare token files needs the end-of-document token id (data.eod_id)"
            )
        for field_name in ("path", "val_path"):
            path = getattr(self, field_name)
            if path is not None:
                check_token_file(path, self.dtype, f"{key}.{field_name}", self.seq_len)
        if self.val_path is None:
            if not 0 < self.val_fraction < 1:
                raise ConfigError(f"{key}.val_fraction", f"must be in (0, 1), got {self.val_fraction}")
            n = os.path.getsize(self.path) // np.dtype(DTYPES[self.dtype]).itemsize
            n_val = n - int(n * (1 - self.val_fraction))
            if min(n_val, n - n_val) <= self.seq_len + 1:
                raise ConfigError(
                    f"{key}.val_fraction",
                    f"{self.path} holds {n} tokens: splitting off {self.val_fraction} for validation leaves a split "
                    f"shorter than seq_len + 2 = {self.seq_len + 2} (set {key}.val_path or a smaller seq_len)",
                )


def _open_folder(path: str, key: str) -> PreparedFolder:
    try:
        return PreparedFolder.open(path)
    except PreparedFolderError as err:
        raise ConfigError(key, str(err)) from None


def check_token_file(path: str, dtype: str, key: str, seq_len: int) -> None:
    """Refuse a missing, empty or truncated token file with a message naming the config key."""
    if not os.path.exists(path):
        raise ConfigError(key, f"token file not found: {path}")
    if not os.path.isfile(path):
        raise ConfigError(key, f"not a file: {path}")
    size = os.path.getsize(path)
    item = np.dtype(DTYPES[dtype]).itemsize
    if size == 0:
        raise ConfigError(key, f"token file is empty: {path}")
    if size % item:
        raise ConfigError(
            key, f"token file {path} has {size} bytes, not a multiple of {item} ({dtype}): truncated or wrong dtype"
        )
    check_split_length(size // item, seq_len, key, f"token file {path}")


class BareTokens(TokenStreamDataset):
    """Bare uint16/uint32 token files, scored by loss."""

    def __init__(self, cfg: MemmapConfig, seed: int):
        self.cfg = cfg
        self.seed = seed
        self.vocab_size = cfg.vocab_size
        self.seq_len = cfg.seq_len
        self.batch_size = cfg.batch_size
        self.eod_id = cfg.eod_id
        self.document_masking = cfg.document_masking
        tokens = np.memmap(cfg.path, dtype=DTYPES[cfg.dtype], mode="r")
        if cfg.val_path is not None:
            self.train, self.val = tokens, np.memmap(cfg.val_path, dtype=DTYPES[cfg.dtype], mode="r")
        else:
            cut = int(len(tokens) * (1 - cfg.val_fraction))
            self.train, self.val = tokens[:cut], tokens[cut:]
        for split, arr in (("train", self.train), ("validation", self.val)):
            check_split_length(len(arr), cfg.seq_len, "data.seq_len", f"the {split} split of {cfg.path}")
        n_val = (len(self.val) - 1) // cfg.seq_len
        self.num_val_windows = min(n_val, cfg.val_tokens // cfg.seq_len) if cfg.val_tokens else n_val

    def check_tokens(self, rows: torch.Tensor) -> None:
        if int(rows.max()) >= self.vocab_size:
            raise ValueError(f"token id {int(rows.max())} in {self.cfg.path} is >= data.vocab_size={self.vocab_size}")

    def describe(self) -> str:
        return f"memmap {self.cfg.path}: {len(self.train):,} train / {len(self.val):,} val tokens"


@DATASETS.register(
    "memmap",
    MemmapConfig,
    "Token files: a folder made by prepare.py (bits per byte for any tokenizer) or bare uint16/uint32 files.",
)
class MemmapTokens(TokenStreamDataset):
    """Builds the dataset ``data.path`` calls for: a ``PreparedStream`` or ``BareTokens``."""

    def __new__(cls, cfg: MemmapConfig, seed: int) -> TokenStreamDataset:  # type: ignore[misc]
        if is_prepared(cfg.path):
            return PreparedStream(
                PreparedFolder.open(cfg.path),
                cfg.seq_len,
                cfg.batch_size,
                cfg.val_tokens,
                seed,
                cfg.document_masking,
                cfg.vocab_size,
            )
        return BareTokens(cfg, seed)
