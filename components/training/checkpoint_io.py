"""Checkpoint I/O that never leaves a half-written file under a checkpoint's name.

A checkpoint is written to a temporary file in the same folder, flushed to disk, then renamed over the
target (atomic on POSIX), so a crash mid-write keeps the previous good checkpoint. Loading uses
``weights_only=True`` (no arbitrary pickled code) and refuses a truncated or corrupt file with a clear
message.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO


class CorruptCheckpointError(RuntimeError):
    pass


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str, storage_options: Optional[Any] = None) -> None:
        path = str(path)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def load_checkpoint(self, path: str, map_location: Optional[Callable] = lambda storage, loc: storage, weights_only: Optional[bool] = None) -> dict[str, Any]:
        return load_checkpoint_file(str(path), map_location)


def load_checkpoint_file(path: str, map_location: Any = "cpu") -> dict[str, Any]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # torch raises several types for a damaged zip archive
        raise CorruptCheckpointError(f"checkpoint {path} is unreadable (truncated or corrupt): {type(err).__name__}: {err}") from None
