"""The cache folder where datasets keep what they build on first use (token streams, prepared folders,
baselines), and the atomic write that keeps a crash from leaving a half-written file there."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    return Path(os.environ.get("K3_CACHE_DIR") or Path.home() / ".cache" / "k3-sandbox")


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
