"""Checkpoint I/O that never leaves a half-written file under a checkpoint's name.

A checkpoint is written to a temporary file in the same folder, flushed to disk, then renamed over the
target (atomic on POSIX), so a crash mid-write keeps the previous good checkpoint. Loading uses
``weights_only=True`` (no arbitrary pickled code) and refuses a truncated or corrupt file with a clear
message. Sharded checkpoints (FSDP2: a folder with one file per rank) are checked for completeness
against their own index before use.
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

    def load_checkpoint(
        self,
        path: str,
        map_location: Optional[Callable] = lambda storage, loc: storage,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        return load_checkpoint_file(str(path), map_location)


def check_sharded_checkpoint(path: str) -> dict[str, Any]:
    """Verify a sharded checkpoint folder: its trainer state loads and every byte range its index
    names exists. Returns the trainer state (without weights). Raises CorruptCheckpointError."""
    from torch.distributed.checkpoint import FileSystemReader

    meta_file = os.path.join(path, "meta.pt")
    if not os.path.isfile(meta_file) or not os.path.isfile(os.path.join(path, ".metadata")):
        raise CorruptCheckpointError(
            f"checkpoint {path} is incomplete: a sharded checkpoint folder needs meta.pt and .metadata"
        )
    try:
        state = torch.load(meta_file, map_location="cpu", weights_only=True)
        index = FileSystemReader(path).read_metadata()
    except Exception as err:
        raise CorruptCheckpointError(
            f"checkpoint {path} is unreadable (truncated or corrupt): {type(err).__name__}: {err}"
        ) from None
    needed: dict[str, int] = {}
    for info in (index.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = os.path.join(path, name)
        have = os.path.getsize(shard) if os.path.isfile(shard) else -1
        if have < size:
            what = "missing" if have < 0 else f"truncated ({have} of {size} bytes)"
            raise CorruptCheckpointError(f"checkpoint {path} is unreadable: shard {name} is {what}")
    return state


def load_checkpoint_file(path: str, map_location: Any = "cpu") -> dict[str, Any]:
    if os.path.isdir(path):
        return check_sharded_checkpoint(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # torch raises several types for a damaged zip archive
        raise CorruptCheckpointError(
            f"checkpoint {path} is unreadable (truncated or corrupt): {type(err).__name__}: {err}"
        ) from None
