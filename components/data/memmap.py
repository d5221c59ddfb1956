"""Pre-tokenised token files (nanoGPT style): a flat array of uint16 or uint32 token ids per file."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from omegaconf import MISSING

from components.data.base import DatasetConfig, TokenStreamDataset
from components.registry import DATASETS, ConfigError

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


@dataclass
class MemmapConfig(DatasetConfig):
    name: str = "memmap"
    # training tokens
    path: str = MISSING
    # validation tokens; None: the last val_fraction of `path` is held out
    val_path: Optional[str] = None
    val_fraction: float = 0.05
    dtype: str = "uint16"
    # size of the token vocabulary (every id in the files must be below it)
    vocab_size: int = 50304
    seq_len: int = 256
    batch_size: int = 32
    val_tokens: Optional[int] = 1_000_000

    def validate(self, model: Any, key: str) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"{key}.dtype", f"'{self.dtype}' is not allowed; choose one of {', '.join(DTYPES)}")
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
                raise ConfigError(f"{key}.val_fraction", f"{self.path} holds {n} tokens: splitting off {self.val_fraction} for validation leaves a split shorter than seq_len + 2 = {self.seq_len + 2} (set {key}.val_path or a smaller seq_len)")
        if self.seq_len < 2 or self.batch_size < 1:
            raise ConfigError(f"{key}.seq_len", f"seq_len must be >= 2 and batch_size >= 1, got {self.seq_len}, {self.batch_size}")
        if self.vocab_size < 2:
            raise ConfigError(f"{key}.vocab_size", f"must be at least 2, got {self.vocab_size}")


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
        raise ConfigError(key, f"token file {path} has {size} bytes, not a multiple of {item} ({dtype}): truncated or wrong dtype")
    if size // item <= seq_len + 1:
        raise ConfigError(key, f"token file {path} holds {size // item} tokens, fewer than seq_len + 2 = {seq_len + 2}")


@DATASETS.register("memmap", MemmapConfig)
class MemmapTokens(TokenStreamDataset):
    """Your own pre-tokenised uint16/uint32 token files."""

    def __init__(self, cfg: MemmapConfig, seed: int):
        self.cfg = cfg
        self.seed = seed
        self.vocab_size = cfg.vocab_size
        self.seq_len = cfg.seq_len
        self.batch_size = cfg.batch_size
        tokens = np.memmap(cfg.path, dtype=DTYPES[cfg.dtype], mode="r")
        if cfg.val_path is not None:
            self.train, self.val = tokens, np.memmap(cfg.val_path, dtype=DTYPES[cfg.dtype], mode="r")
        else:
            cut = int(len(tokens) * (1 - cfg.val_fraction))
            self.train, self.val = tokens[:cut], tokens[cut:]
        for split, arr in (("train", self.train), ("validation", self.val)):
            if len(arr) <= cfg.seq_len + 1:
                raise ValueError(f"{split} split of {cfg.path} holds {len(arr)} tokens, fewer than seq_len + 2")
        n_val = (len(self.val) - 1) // cfg.seq_len
        self.num_val_windows = min(n_val, cfg.val_tokens // cfg.seq_len) if cfg.val_tokens else n_val

    def check_tokens(self, rows: torch.Tensor) -> None:
        if int(rows.max()) >= self.vocab_size:
            raise ValueError(f"token id {int(rows.max())} in {self.cfg.path} is >= data.vocab_size={self.vocab_size}")

    def describe(self) -> str:
        return f"memmap {self.cfg.path}: {len(self.train):,} train / {len(self.val):,} val tokens"
