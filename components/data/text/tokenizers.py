"""Tokenizers for prepared text, named by a spec string.

* ``bytes``: the UTF-8 bytes themselves (ids 0..255) plus an end-of-document token (256): the
  vocabulary of the embedded byte corpus.
* ``bpe:<vocab size>``: byte-level BPE trained on the training split with Hugging Face ``tokenizers``
  (GPT-2 style pre-tokenisation; special tokens for document end and padding take ids 0 and 1).
* a path to an existing ``tokenizer.json`` (Hugging Face format); its end-of-document token is found
  among the usual names or named explicitly.

Every tokenizer tells how many UTF-8 bytes each id stands for (0 for special tokens), so a model's
summed token loss over any window can be turned into bits per byte, whatever the tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|padding|>"
# end-of-document names looked for in a tokenizer.json that names none explicitly
EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
MIN_BPE_VOCAB = 260  # 256 byte symbols + 2 special tokens + at least 2 merges
TOKENIZER_FILE = "tokenizer.json"


class TokenizerError(ValueError):
    """A tokenizer spec or file that cannot be used; the message names it."""


class TextTokenizer:
    """What preparation and evaluation need from a tokenizer."""

    kind: str  # "bytes", "bpe" or "file"
    spec: str
    vocab_size: int
    eod_id: int
    pad_id: Optional[int] = None

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def token_bytes(self) -> list[bytes]:
        """The UTF-8 bytes each id decodes to (``b""`` for special tokens), indexed by id."""
        raise NotImplementedError

    def fingerprint(self) -> str:
        """A hash that is equal for two tokenizers exactly when they tokenise alike."""
        raise NotImplementedError

    def save(self, folder: Path) -> Optional[str]:
        """Write the tokenizer's file into ``folder``; returns its name (None: nothing to write)."""
        return None

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "spec": self.spec,
            "hash": self.fingerprint(),
            "vocab_size": self.vocab_size,
            "eod_id": self.eod_id,
            "pad_id": self.pad_id,
        }


class ByteTokenizer(TextTokenizer):
    kind = "bytes"
    spec = "bytes"
    vocab_size = 257
    eod_id = 256

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_bytes(self) -> list[bytes]:
        return [bytes([i]) for i in range(256)] + [b""]

    def fingerprint(self) -> str:
        return hashlib.sha256(b"bytes/utf-8+eod256").hexdigest()[:16]


def _byte_level_decoding() -> dict[str, int]:
    """The inverse of byte-level BPE's byte-to-character alphabet (GPT-2's printable remapping)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class HFTokenizer(TextTokenizer):
    """A Hugging Face ``tokenizers.Tokenizer``: trained here (``bpe:N``) or loaded from a file."""

    def __init__(self, tokenizer, kind: str, spec: str, eod_token: Optional[str] = None):
        self.tok = tokenizer
        self.kind = kind
        self.spec = spec
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        names = (eod_token,) if eod_token else EOD_CANDIDATES
        found = [n for n in names if n in vocab]
        if not found:
            raise TokenizerError(
                f"tokenizer {spec}: no end-of-document token among {', '.join(names)}; name one with --eod-token"
            )
        self.eod_id = vocab[found[0]]
        self.pad_id = vocab.get(PAD_TOKEN)
        self._json = tokenizer.to_str()
        # text that spells a special token ("<|endoftext|>" in a document) is text, not a document end
        tokenizer.encode_special_tokens = True

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int64) for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def _byte_level(self) -> bool:
        decoder = json.loads(self._json).get("decoder") or {}
        return decoder.get("type") == "ByteLevel"

    def token_bytes(self) -> list[bytes]:
        special = {t.content for t in self.tok.get_added_tokens_decoder().values() if t.special}
        table = [b""] * self.vocab_size
        if self._byte_level():
            # each character of a byte-level token stands for one byte
            inverse = _byte_level_decoding()
            for piece, i in self.tok.get_vocab(with_added_tokens=True).items():
                if piece in special:
                    continue
                if all(c in inverse for c in piece):
                    table[i] = bytes(inverse[c] for c in piece)
                else:  # an added non-special token is stored as plain text
                    table[i] = piece.encode("utf-8")
            return table
        for i in range(self.vocab_size):
            piece = self.tok.id_to_token(i)
            if piece is not None and piece not in special:
                table[i] = self.tok.decode([i], skip_special_tokens=True).encode("utf-8")
        return table

    def fingerprint(self) -> str:
        return hashlib.sha256(self._json.encode("utf-8")).hexdigest()[:16]

    def save(self, folder: Path) -> Optional[str]:
        (folder / TOKENIZER_FILE).write_text(self._json, encoding="utf-8")
        return TOKENIZER_FILE


def parse_bpe_spec(spec: str) -> Optional[int]:
    """The vocabulary size of a ``bpe:N`` spec; None if ``spec`` is not one. Raises on a bad ``N``."""
    if not spec.startswith("bpe:"):
        return None
    size = spec[4:]
    if not (size.isascii() and size.isdigit()) or not MIN_BPE_VOCAB <= int(size) < 2**32:
        raise TokenizerError(
            f"tokenizer '{spec}': the vocabulary size must be a whole number from {MIN_BPE_VOCAB} to 2^32-1, e.g. "
            "bpe:8192"
        )
    return int(size)


def spec_vocab_size(spec: str, eod_token: Optional[str] = None) -> int:
    """The vocabulary size a spec will have (an upper bound for ``bpe:N`` on a small training split)."""
    if spec == "bytes":
        return ByteTokenizer.vocab_size
    n = parse_bpe_spec(spec)
    return n if n is not None else load_tokenizer_file(spec, eod_token).vocab_size


def load_tokenizer_file(
    path: str | os.PathLike, eod_token: Optional[str] = None, spec: Optional[str] = None
) -> HFTokenizer:
    """A ``tokenizer.json`` as a ``TextTokenizer``; TokenizerError naming the file if it does not load."""
    if not Path(path).is_file():
        raise TokenizerError(
            f"tokenizer '{path}' is neither 'bytes', 'bpe:<vocab size>' nor an existing tokenizer.json file"
        )
    return HFTokenizer(_read_tokenizer_json(path), "file", spec or str(path), eod_token)


def _read_tokenizer_json(path: str | os.PathLike):
    """The HF ``Tokenizer`` in a tokenizer.json; TokenizerError naming the file if it does not parse."""
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # the Rust side raises a plain Exception with its parser's message
        raise TokenizerError(
            f"tokenizer file {path} does not load as a Hugging Face tokenizer.json: {str(err).splitlines()[0]}"
        ) from None


def train_bpe(texts: Iterator[str], vocab_size: int, length: Optional[int] = None) -> HFTokenizer:
    """Byte-level BPE with ``vocab_size`` entries (fewer if the texts run out of merges), trained on
    ``texts``; the end-of-document and padding tokens take ids 0 and 1."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=length)
    return HFTokenizer(tok, "bpe", f"bpe:{vocab_size}")


def load_prepared_tokenizer(folder: Path, described: dict) -> TextTokenizer:
    """The tokenizer a prepared folder was made with, checked against its ``meta.json`` description."""
    if described["kind"] == "bytes":
        tok: TextTokenizer = ByteTokenizer()
    else:
        path = folder / TOKENIZER_FILE
        if not path.is_file():
            raise TokenizerError(
                f"{folder}: meta.json names a {described['kind']} tokenizer but {TOKENIZER_FILE} is missing"
            )
        raw = _read_tokenizer_json(path)
        # the end-of-document token is the one meta.json records, whatever the file's other specials
        tok = HFTokenizer(
            raw, described["kind"], described.get("spec", str(path)), raw.id_to_token(described["eod_id"])
        )
    if tok.fingerprint() != described["hash"]:
        raise TokenizerError(
            f"{folder}: the tokenizer there (hash {tok.fingerprint()}) is not the one meta.json says the tokens were "
            f"made with (hash {described['hash']}); prepare the folder again"
        )
    return tok


def dtype_for_vocab(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"
