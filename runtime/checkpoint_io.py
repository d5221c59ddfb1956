"""Checkpoint I/O that never leaves a half-written file under a checkpoint's name.

A checkpoint is written to a temporary file in the same folder, flushed to disk, then renamed over the
target (atomic on POSIX), so a crash mid-write keeps the previous good checkpoint. Loading uses
``weights_only=True`` (no arbitrary pickled code) and refuses a truncated or corrupt file with a clear
message. Sharded checkpoints (FSDP2: a folder with one file per rank) are checked for completeness
against their own index before use.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO


class CorruptCheckpointError(RuntimeError):
    pass


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
            f"checkpoint {path} is unreadable (truncated or corrupt): {type(err).__name__}: {_first_line(err)}"
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
    _check_records(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # torch raises several types for a damaged zip archive
        raise CorruptCheckpointError(
            f"checkpoint {path} is unreadable (truncated or corrupt): {type(err).__name__}: {_first_line(err)}"
        ) from None


def _check_records(path: str) -> None:
    """Every record of a checkpoint archive against its CRC-32 (torch.load does not check the tensor
    data's): CorruptCheckpointError naming the file and the first record whose bytes changed. A file that
    is no zip archive (cut short before its directory) is left to torch.load to refuse."""
    if not zipfile.is_zipfile(path):
        return
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
        raise CorruptCheckpointError(
            f"checkpoint {path} is unreadable (truncated or corrupt): {type(err).__name__}: {_first_line(err)}"
        ) from None
    if bad is not None:
        raise CorruptCheckpointError(
            f"checkpoint {path} is unreadable (truncated or corrupt): its record {bad} does not match its checksum"
        )


def _first_line(err: Exception) -> str:
    """The gist of a loading error on one line (torch's own messages run to paragraphs)."""
    if isinstance(err, pickle.UnpicklingError):
        return "not a checkpoint of tensors and plain data (torch.load with weights_only=True cannot read it)"
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return lines[0] if lines else "no detail"
