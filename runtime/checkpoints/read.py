"""Reading checkpoints: a truncated or corrupt one is refused with a message naming it.

Loading uses ``weights_only=True`` (no arbitrary pickled code); every record of a checkpoint archive is
checked against its CRC-32 first (``torch.load`` does not check the tensor data's). Sharded checkpoints
(FSDP2: a folder with one file per rank) are checked for completeness against their own index before
use. No Lightning here: the analysis tools read checkpoints without importing it
(``runtime/checkpoints/write.py`` writes them).
"""

from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from typing import Any

import torch


class CorruptCheckpointError(RuntimeError):
    pass


def check_sharded_checkpoint(path: str) -> dict[str, Any]:
    """Verify a sharded checkpoint folder: its trainer state loads and every byte range its index
    names exists. Returns the trainer state (without weights). Raises CorruptCheckpointError."""
    from torch.distributed.checkpoint import FileSystemReader  # start-up time: DCP, sharded checkpoints only

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


def consolidated_checkpoint(path: str) -> dict[str, Any]:
    """A sharded checkpoint folder read whole into this one process, in the layout of a checkpoint file: the
    trainer state, ``state_dict`` (every weight as a plain tensor, global shapes) and ``optimizer_states``
    (each optimizer's state keyed by parameter name, as the sharded run saved it: ``Optimizer.load_state_dict``
    pairs saved and current parameters by their order in each param group, which the same composition
    repeats). Verified first (CorruptCheckpointError). The whole model and its optimizer state must fit in
    memory: what a one-process run of the same model needs anyway."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # start-up time: DCP, sharded only

    state = check_sharded_checkpoint(path)
    with tempfile.TemporaryDirectory() as scratch:
        whole = os.path.join(scratch, "whole.pt")
        dcp_to_torch_save(path, whole)
        content = torch.load(whole, map_location="cpu", weights_only=True)
    optimizers = sorted((k for k in content if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    return {
        **state,
        "state_dict": content["state_dict"],
        "optimizer_states": [content[k] for k in optimizers],
    }


# file versions (real path -> (device, inode, size, mtime)) whose every record matched its checksum in
# this process: a run that picks its checkpoint (verify_checkpoint) and then loads it reads its bytes for
# the check once. Checkpoints are written to a temporary name and renamed into place, so a checkpoint
# written anew is another inode and is checked again; a change in place within one tick of the file
# clock, at the same size, would not be seen (nothing here writes one)
_CHECKED: dict[str, tuple[int, int, int, int]] = {}


def _version(path: str) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def load_checkpoint_file(path: str, map_location: Any = "cpu", mmap: bool = False) -> dict[str, Any]:
    """A checkpoint's content, verified (a sharded folder: its trainer state, once every shard is
    checked). ``mmap``: tensors mapped from the file rather than read into memory (to look at shapes)."""
    if os.path.isdir(path):
        return check_sharded_checkpoint(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    key, version = os.path.realpath(path), _version(path)
    if _CHECKED.get(key) != version:
        _check_records(path)
    try:
        content = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as err:  # torch raises several types for a damaged zip archive
        raise CorruptCheckpointError(
            f"checkpoint {path} is unreadable (truncated or corrupt): {type(err).__name__}: {_first_line(err)}"
        ) from None
    _CHECKED[key] = version
    return content


def verify_checkpoint(path: str) -> None:
    """That a checkpoint reads completely, without keeping it: every record against its checksum and the
    archive loaded with its tensors mapped, not read (a sharded folder: its index and every shard's byte
    range; a file in torch's legacy, non-zip format, which cannot be mapped: read whole).
    CorruptCheckpointError / FileNotFoundError naming it; loading the same file version afterwards in this
    process skips the checksum pass (a sharded folder's cheap index check runs again)."""
    load_checkpoint_file(path, mmap=os.path.isfile(path) and zipfile.is_zipfile(path))


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
