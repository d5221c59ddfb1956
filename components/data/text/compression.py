"""Compressed input files: ``.gz``, ``.bz2`` and ``.xz``/``.lzma`` through the standard library, ``.zst``
through the ``zstandard`` package where it is installed (refused by name where it is not)."""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import lzma
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Optional

STDLIB_OPENERS: dict[str, Callable[[Path], BinaryIO]] = {
    ".gz": lambda p: gzip.open(p, "rb"),
    ".bz2": lambda p: bz2.open(p, "rb"),
    ".xz": lambda p: lzma.open(p, "rb"),
    ".lzma": lambda p: lzma.open(p, "rb"),
}
COMPRESSED_SUFFIXES = (*STDLIB_OPENERS, ".zst")
# what each decompressor raises on a corrupt or truncated stream
_STREAM_ERRORS = (OSError, EOFError, lzma.LZMAError, ValueError)


class CompressionError(ValueError):
    """A compressed input that cannot be read; the message names the file."""


def compression_of(path: Path) -> Optional[str]:
    """The compression suffix of ``path`` (``.gz`` ...), or None for an uncompressed file."""
    return path.suffix if path.suffix in COMPRESSED_SUFFIXES else None


def inner_suffix(path: Path) -> str:
    """The suffix that says a file's format: ``a.jsonl.gz`` -> ``.jsonl``."""
    return Path(path.stem).suffix if compression_of(path) else path.suffix


def _open_zstd(path: Path) -> BinaryIO:
    try:
        import zstandard  # optional: not a dependency, only .zst inputs need it
    except ImportError:
        raise CompressionError(
            f"{path}: reading .zst files needs the zstandard package, which is not installed (pip install zstandard); "
            "or decompress it first"
        ) from None
    return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)


def open_input(path: Path) -> BinaryIO:
    """``path`` opened for reading its (decompressed) bytes."""
    suffix = compression_of(path)
    if suffix is None:
        return open(path, "rb")
    if suffix == ".zst":
        return io.BufferedReader(_open_zstd(path))  # line iteration needs a buffered stream
    return STDLIB_OPENERS[suffix](path)


@contextlib.contextmanager
def _named_errors(path: Path) -> Iterator[None]:
    """A corrupt or truncated compressed stream as a CompressionError naming ``path``."""
    try:
        yield
    except CompressionError:
        raise
    except _STREAM_ERRORS as err:
        if compression_of(path) is None:
            raise
        raise CompressionError(f"{path}: not a readable {compression_of(path)} file ({err})") from None


def read_input_bytes(path: Path) -> bytes:
    """All (decompressed) bytes of ``path``; CompressionError naming it if the stream is corrupt."""
    with _named_errors(path), open_input(path) as f:
        return f.read()


def iter_input_lines(path: Path) -> Iterator[bytes]:
    """The (decompressed) lines of ``path`` as bytes; CompressionError naming it if the stream is corrupt."""
    with _named_errors(path), open_input(path) as f:
        yield from f
