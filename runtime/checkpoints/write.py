"""Checkpoint I/O that never leaves a half-written file under a checkpoint's name.

A checkpoint is written to a temporary file in the same folder, flushed to disk, then renamed over the
target (atomic on POSIX), so a crash mid-write keeps the previous good checkpoint, and a full disk
(the write fails) does too: ``CheckpointWriteError`` names the checkpoint. Loading is
``runtime/checkpoints/read.py``'s (a truncated or corrupt file refused by name; a sharded run's
checkpoint folder read whole, so a one-process or DDP run resumes or branches from it).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from runtime.checkpoints.layout import is_sharded
from runtime.checkpoints.read import consolidated_checkpoint, load_checkpoint_file


class CheckpointWriteError(RuntimeError):
    """A checkpoint that could not be written (a full disk, a folder that cannot be written); the
    message names it and says that the checkpoints already written are as they were."""


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str, storage_options: Optional[Any] = None) -> None:
        path = str(path)
        tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self.write_file(checkpoint, tmp)
            os.replace(tmp, path)
        except OSError as err:  # a full disk: the temporary goes, the checkpoint under ``path`` stays
            kept = (
                f"the previous {os.path.basename(path)} is intact, as is every checkpoint written before"
                if os.path.exists(path)
                else "nothing was written under that name and every checkpoint written before is intact"
            )
            raise CheckpointWriteError(
                f"could not write checkpoint {path} ({err.strerror or err}); {kept} (free space, then resume with "
                "ckpt_path=last)"
            ) from None
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def write_file(self, checkpoint: dict[str, Any], path: str) -> None:
        """Write ``checkpoint`` to ``path`` and flush it to disk; OSError when the file cannot be written
        (torch.save reports a failing write as a RuntimeError: the write's own error is raised instead)."""
        with open(path, "wb") as f:
            writer = _WriteErrors(f)
            try:
                torch.save(checkpoint, writer)
            except RuntimeError:
                if writer.error is not None:
                    raise writer.error from None
                raise
            f.flush()
            os.fsync(f.fileno())

    def load_checkpoint(
        self,
        path: str,
        map_location: Optional[Callable] = lambda storage, loc: storage,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        if is_sharded(str(path)):  # a sharded run's checkpoint, resumed or branched from by this one
            return consolidated_checkpoint(str(path))
        return load_checkpoint_file(str(path), map_location)


class _WriteErrors:
    """A binary file's ``write`` that keeps the OSError a failing write raised."""

    def __init__(self, f: Any):
        self.f = f
        self.error: Optional[OSError] = None

    def write(self, data: Any) -> int:
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.f.flush()
