"""Text prepared on first use: any inputs ``prepare.py`` takes, tokenised as asked, cached.

The default is the embedded natural-language corpus, ``stdlib:docs`` (the English documentation that
ships with Python: reference topics and docstrings, about 2.4 MB), with byte-level BPE trained on its
training split; ``data.inputs='[stdlib:code]'`` gives the code corpus, ``data.tokenizer=bytes`` bytes.
The prepared folder lives in the cache (``$K3_CACHE_DIR`` or ``~/.cache/k3-sandbox``) under a name
derived from the options, and is rebuilt only when the inputs or options change.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from components.data.base import DatasetConfig, NoTextTokenizer, prepared_tokenizer
from components.data.cache_folder import default_cache_dir
from components.data.text.documents import ReadOptions
from components.data.text.input_files import InputError, expand_input
from components.data.text.pipeline import PrepareOptions, prepare
from components.data.text.prepared import PreparedFolder, is_prepared
from components.data.text.stream import PreparedStream
from components.data.text.tokenizers import TextTokenizer, TokenizerError, spec_vocab_size
from components.registry import DATASETS, ConfigError


@dataclass
class TextConfig(DatasetConfig):
    name: str = "text"
    # what to prepare, as prepare.py takes it: files, folders, glob patterns, .jsonl / .parquet files,
    # stdlib:code, stdlib:docs
    inputs: list[str] = field(default_factory=lambda: ["stdlib:docs"])
    # bytes, bpe:<vocab size> (trained on the training split) or the path of a tokenizer.json
    tokenizer: str = "bpe:8192"
    # share of documents held out for validation (by a hash of each document's identity)
    val_fraction: float = 0.1
    # JSONL field / Parquet column holding the text
    text_field: str = "text"
    seq_len: int = 256
    batch_size: int = 16
    # evaluate on at most this many validation tokens (None: the whole validation split)
    val_tokens: Optional[int] = 262144
    # None: the tokenizer's vocabulary size; larger pads the embedding table
    vocab_size: Optional[int] = None
    # attention and recurrent state stop at document boundaries
    document_masking: bool = False
    # where the prepared folder goes (None: $K3_CACHE_DIR or ~/.cache/k3-sandbox)
    cache_dir: Optional[str] = None

    def text_tokenizer(self) -> TextTokenizer:
        folder = self.folder()
        if not is_prepared(folder):
            raise NoTextTokenizer(
                f"the run's data ({self.name}) is not prepared on this machine ({folder}); "
                "train or prepare it here first"
            )
        return prepared_tokenizer(folder)

    @classmethod
    def complete(cls, node: Any, key: str) -> None:
        if node.get("vocab_size") is None:
            try:
                node.vocab_size = spec_vocab_size(str(node.get("tokenizer")))
            except TokenizerError as err:
                raise ConfigError(f"{key}.tokenizer", str(err)) from None

    def validate(self, model: Any, key: str) -> None:
        if not self.inputs:
            raise ConfigError(
                f"{key}.inputs",
                "name at least one input (files, folders, glob patterns, .jsonl / .parquet, stdlib:code, stdlib:docs)",
            )
        for i, pattern in enumerate(self.inputs):
            try:
                expand_input(pattern)
            except InputError as err:
                raise ConfigError(f"{key}.inputs[{i}]", str(err)) from None
        try:
            needed = spec_vocab_size(self.tokenizer)
        except TokenizerError as err:
            raise ConfigError(f"{key}.tokenizer", str(err)) from None
        if self.vocab_size is None or self.vocab_size < needed:
            raise ConfigError(
                f"{key}.vocab_size",
                f"{self.vocab_size} is below the {needed} ids of tokenizer {self.tokenizer}; leave it unset",
            )
        if not 0 < self.val_fraction < 0.5:
            raise ConfigError(f"{key}.val_fraction", f"must be in (0, 0.5), got {self.val_fraction}")
        if self.seq_len < 2 or self.batch_size < 1:
            raise ConfigError(
                f"{key}.seq_len", f"seq_len must be >= 2 and batch_size >= 1, got {self.seq_len}, {self.batch_size}"
            )
        if self.val_tokens is not None and self.val_tokens < self.seq_len:
            raise ConfigError(f"{key}.val_tokens", f"must be at least seq_len={self.seq_len}, got {self.val_tokens}")

    def options(self, out: Path) -> PrepareOptions:
        return PrepareOptions(
            inputs=list(self.inputs),
            out=str(out),
            tokenizer=self.tokenizer,
            val_fraction=self.val_fraction,
            read=ReadOptions(text_field=self.text_field),
            overwrite=True,
            progress=False,
        )

    def folder(self) -> Path:
        """The cache folder for these options (its content follows the inputs: prepare() rebuilds it when they
        change)."""
        ident = json.dumps(
            [
                list(self.inputs),
                self.tokenizer,
                self.val_fraction,
                self.text_field,
                [str(Path(p).resolve()) if not p.startswith("stdlib:") else p for p in self.inputs],
            ]
        )
        name = "text-" + hashlib.sha256(ident.encode()).hexdigest()[:16]
        return (Path(self.cache_dir) if self.cache_dir else default_cache_dir()) / name


@DATASETS.register(
    "text",
    TextConfig,
    "Text prepared on first use (default: Python's own English documentation, byte-level BPE 8192); bits per byte.",
)
class TextCorpus(PreparedStream):
    """``prepare.py``'s pipeline run on first use into the cache, then read like ``data=memmap``."""

    def __init__(self, cfg: TextConfig, seed: int):
        out = cfg.folder()
        # prepare() holds the folder's lock: one preparer at a time (data-parallel ranks, parallel runs)
        prepare(cfg.options(out), log=lambda msg: None)
        super().__init__(
            PreparedFolder.open(out),
            cfg.seq_len,
            cfg.batch_size,
            cfg.val_tokens,
            seed,
            cfg.document_masking,
            cfg.vocab_size,
        )


@dataclass
class CodeConfig(TextConfig):
    name: str = "code"
    # this Python's standard-library sources (the byte corpus's files, data=corpus)
    inputs: list[str] = field(default_factory=lambda: ["stdlib:code"])
    # 2% of the files held out by path hash: the byte corpus's validation files
    val_fraction: float = 0.02


@DATASETS.register(
    "code",
    CodeConfig,
    "The default data: the standard-library sources (data=corpus's files) in byte-level BPE 8192, prepared on first "
    "use.",
)
class CodeCorpus(TextCorpus):
    """``data=text`` on ``stdlib:code``: the embedded corpus in byte-level BPE."""
