"""Compressors' bits per byte on a dataset's validation bytes: the reference numbers a run's bits per
byte is printed beside."""

from __future__ import annotations

import gzip
import lzma


def compressed_bits_per_byte(data: bytes) -> dict[str, float]:
    """Bits per byte of ``gzip -9`` and ``xz -9e`` on ``data`` (same formats as the command-line tools)."""
    n = max(len(data), 1)
    return {
        "gzip-9": 8 * len(gzip.compress(data, compresslevel=9, mtime=0)) / n,
        "xz-9e": 8 * len(lzma.compress(data, format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME)) / n,
    }
