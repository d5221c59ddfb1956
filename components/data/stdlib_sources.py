"""The running interpreter's standard-library ``.py`` sources: where they are, which files, what
identifies them, and the hash split into train and validation by relative path (so the split never
depends on the file list). The byte corpus (``data=corpus``) and ``stdlib:code`` inputs read them."""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from pathlib import Path


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path) -> list[str]:
    """Relative paths of the standard library's ``.py`` files, sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for f in filenames:
            if f.endswith(".py"):
                found.append(os.path.relpath(os.path.join(dirpath, f), root))
    return sorted(found)


def stdlib_fingerprint(root: Path, files: list[str]) -> list:
    """What identifies this Python's standard-library sources without reading them: the interpreter
    version, the folder, and every file's relative path and size."""
    return [sys.version, str(root), [(f, os.path.getsize(root / f)) for f in files]]


def is_validation(relpath: str, val_percent: float) -> bool:
    h = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:8], "big")
    return (h % 10_000) < val_percent * 100
