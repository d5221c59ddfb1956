"""The default corpus: the running interpreter's own standard-library ``.py`` sources, as bytes.

Needs no download and is the same on every machine with the same Python. Files are taken in sorted
order of their path relative to the standard-library folder (``site-packages`` excluded) and assigned
to train or validation by a hash of that path, so the split never depends on the file list. Tokens are
bytes (0..255) plus one separator (256) after each file. The token streams are cached as memmaps on
first use (written to a temporary name, then renamed, so a crash never leaves a half-written cache).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from components.data.base import DatasetConfig, TokenStreamDataset
from components.data.cache_folder import default_cache_dir, write_atomic
from components.data.compressor_baselines import compressed_bits_per_byte
from components.data.metrics import BITS_PER_BYTE, ByteAccounting
from components.data.stdlib_sources import is_validation, stdlib_fingerprint, stdlib_root, stdlib_sources
from components.data.text.tokenizers import ByteTokenizer, TextTokenizer
from components.registry import DATASETS, ConfigError

SEPARATOR = 256
NUM_BYTE_TOKENS = 256


@dataclass
class CorpusConfig(DatasetConfig):
    name: str = "corpus"
    seq_len: int = 256
    # global micro-batch (summed over data-parallel ranks); 16 rows of 256 bytes: at the default run's
    # 2.4M-token budget more, smaller steps learn more per token than fewer, larger ones, and 16 rows
    # still split evenly over the 16 ranks of trainer=slurm
    batch_size: int = 16
    # share of files (by path hash) held out for validation, in percent
    val_percent: float = 2.0
    # evaluate on at most this many validation tokens, for a bounded evaluation time (None: the whole
    # validation split)
    val_tokens: Optional[int] = 262144
    # 256 byte values + 1 separator; a larger value pads the embedding table
    vocab_size: int = 257
    # where the token cache goes (None: $K3_CACHE_DIR or ~/.cache/k3-sandbox)
    cache_dir: Optional[str] = None
    # attention and recurrent state stop at file boundaries (the separator starts each file)
    document_masking: bool = False

    def text_tokenizer(self) -> TextTokenizer:
        return ByteTokenizer()  # bytes plus the file separator 256

    def validate(self, model: Any, key: str) -> None:
        if self.seq_len < 2:
            raise ConfigError(f"{key}.seq_len", f"must be at least 2, got {self.seq_len}")
        if self.batch_size < 1:
            raise ConfigError(f"{key}.batch_size", f"must be positive, got {self.batch_size}")
        if not 0 < self.val_percent < 50:
            raise ConfigError(f"{key}.val_percent", f"must be in (0, 50), got {self.val_percent}")
        if self.vocab_size < NUM_BYTE_TOKENS + 1:
            raise ConfigError(f"{key}.vocab_size", f"byte tokens need at least 257 entries, got {self.vocab_size}")
        if self.val_tokens is not None and self.val_tokens < self.seq_len:
            raise ConfigError(f"{key}.val_tokens", f"must be at least seq_len={self.seq_len}, got {self.val_tokens}")


def build_corpus_cache(val_percent: float, cache_dir: Optional[str] = None) -> Path:
    """Tokenise the standard library into ``train.bin`` / ``val.bin`` (uint16); returns the folder."""
    root = stdlib_root()
    files = stdlib_sources(root)
    if not files:
        raise FileNotFoundError(f"no .py files found under the standard library folder {root}")
    version, folder_name, sizes = stdlib_fingerprint(root, files)
    fingerprint = hashlib.sha256(json.dumps([version, folder_name, val_percent, sizes]).encode()).hexdigest()[:16]
    folder = Path(cache_dir) if cache_dir else default_cache_dir()
    folder = folder / f"stdlib-corpus-{fingerprint}"
    if (folder / "meta.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    streams: dict[str, list[bytes]] = {"train": [], "val": []}
    counts = {"train": 0, "val": 0}
    sep = np.array([SEPARATOR], dtype=np.uint16).tobytes()
    for rel in files:
        data = (root / rel).read_bytes()
        split = "val" if is_validation(rel, val_percent) else "train"
        streams[split].append(np.frombuffer(data, dtype=np.uint8).astype(np.uint16).tobytes() + sep)
        counts[split] += 1
    for split, parts in streams.items():
        write_atomic(folder / f"{split}.bin", b"".join(parts))
    meta = {"python": sys.version, "files": counts, "val_percent": val_percent}
    write_atomic(folder / "meta.json", json.dumps(meta, indent=1).encode())  # written last: marks the cache complete
    return folder


@DATASETS.register("corpus", CorpusConfig)
class StdlibCorpus(TokenStreamDataset):
    """Python standard-library sources, byte-level (default corpus, no download)."""

    metrics = BITS_PER_BYTE

    def __init__(self, cfg: CorpusConfig, seed: int):
        self.cfg = cfg
        self.seed = seed
        self.vocab_size = cfg.vocab_size
        self.seq_len = cfg.seq_len
        self.batch_size = cfg.batch_size
        self.eod_id = SEPARATOR
        self.document_masking = cfg.document_masking
        # bits per byte over byte targets (the separator is predicted and trained on, but is not a byte)
        is_byte = torch.arange(cfg.vocab_size) < NUM_BYTE_TOKENS  # [vocab]
        self.byte_accounting = ByteAccounting(is_byte.double(), counted=is_byte)
        self.folder = build_corpus_cache(cfg.val_percent, cfg.cache_dir)
        self.train = np.memmap(self.folder / "train.bin", dtype=np.uint16, mode="r")
        self.val = np.memmap(self.folder / "val.bin", dtype=np.uint16, mode="r")
        n_val = (len(self.val) - 1) // cfg.seq_len
        if cfg.val_tokens is not None:
            n_val = min(n_val, cfg.val_tokens // cfg.seq_len)
        self.num_val_windows = n_val
        if len(self.train) <= cfg.seq_len + 1 or n_val < 1:
            raise ValueError(f"corpus in {self.folder} is too small for seq_len={cfg.seq_len}")

    def validation_bytes(self) -> bytes:
        """The bytes whose prediction validation scores: the targets of every validation window."""
        targets = np.asarray(self.val[1 : self.num_val_windows * self.seq_len + 1])
        return targets[targets < NUM_BYTE_TOKENS].astype(np.uint8).tobytes()

    def baselines(self) -> dict[str, float]:
        path = self.folder / f"baselines-T{self.seq_len}-n{self.num_val_windows}.json"
        if path.exists():
            return json.loads(path.read_text())
        result = compressed_bits_per_byte(self.validation_bytes())
        write_atomic(path, json.dumps(result).encode())
        return result

    def describe(self) -> str:
        return (
            f"stdlib corpus: {len(self.train):,} train / {len(self.val):,} val tokens, "
            f"{self.num_val_windows} validation windows of {self.seq_len}"
        )
