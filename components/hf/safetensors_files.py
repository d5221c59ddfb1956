"""Hugging Face checkpoint folders: ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors``
with ``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": {key: file}}``).

Headers are read without touching tensor data (the first 8 bytes give the JSON header's length), so a
full-size checkpoint's keys, shapes and dtypes can be checked in seconds.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Iterator, NamedTuple

import safetensors
import safetensors.torch  # save_file looked up when called: a test fills the disk through it
import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint folder or file that cannot be read as safetensors; the message names it."""


class TensorInfo(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: str  # the shard file holding it, relative to the folder


def read_header(path: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """``{key: (dtype, shape)}`` of one safetensors file, from its header alone; the header is checked
    against itself and the file's size (every entry an object with a known dtype, a shape and data
    offsets that fit its size, the data exactly filling the rest of the file), so a truncated or
    corrupt file is named here, before any tensor is read."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                raise CheckpointError(f"{path}: not a safetensors file (header length {n} bytes)")
            header_bytes = f.read(n)
            file_size = os.fstat(f.fileno()).st_size
        if len(header_bytes) != n:
            raise CheckpointError(f"{path}: truncated in its header ({len(header_bytes)} of {n} bytes)")
        header = json.loads(header_bytes)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: unreadable safetensors header ({err})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is a {type(header).__name__}, not an object")
    out = {}
    data_end = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        out[key] = _header_entry(path, key, entry)
        data_end = max(data_end, entry["data_offsets"][1])
    if 8 + n + data_end != file_size:
        raise CheckpointError(
            f"{path}: the header describes {data_end:,} bytes of tensor data, the file holds "
            f"{file_size - 8 - n:,} (truncated or corrupt: export it again)"
        )
    return out


def _header_entry(path: str, key: str, entry: object) -> tuple[torch.dtype, tuple[int, ...]]:
    if not isinstance(entry, dict):
        raise CheckpointError(f"{path}: header entry {key} is a {type(entry).__name__}, not an object")
    if entry.get("dtype") not in DTYPES:
        raise CheckpointError(f"{path}: tensor {key} has dtype {entry.get('dtype')!r}; readable: {', '.join(DTYPES)}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise CheckpointError(f"{path}: tensor {key} has shape {shape!r}; expected a list of sizes")
    if (
        not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets))
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise CheckpointError(f"{path}: tensor {key} has data_offsets {offsets!r}; expected [begin, end]")
    dtype = DTYPES[entry["dtype"]]
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if offsets[1] - offsets[0] != size:
        raise CheckpointError(
            f"{path}: tensor {key} of shape {tuple(shape)} {entry['dtype']} needs {size:,} bytes, its offsets "
            f"span {offsets[1] - offsets[0]:,}"
        )
    return dtype, tuple(shape)


def weight_map(folder: str) -> dict[str, str]:
    """``{key: shard file}`` of a checkpoint folder (its index, or the keys of its single file)."""
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                data = json.load(f)
            wmap = dict(data["weight_map"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(
                f"{index}: not a safetensors index ({err!r}); expected a 'weight_map' object"
            ) from None
        bad = next((k for k, v in wmap.items() if not isinstance(v, str)), None)
        if bad is not None:
            raise CheckpointError(f"{index}: weight_map[{bad!r}] is {wmap[bad]!r}, not the name of a shard file")
        return wmap
    single = os.path.join(folder, SINGLE)
    if os.path.isfile(single):
        return {key: SINGLE for key in read_header(single)}
    raise CheckpointError(f"{folder}: no {SINGLE} or {INDEX}")


def tensor_infos(folder: str) -> dict[str, TensorInfo]:
    """Every tensor of a checkpoint folder with its dtype, shape and shard, from headers only."""
    wmap = weight_map(folder)
    headers: dict[str, dict] = {}
    out = {}
    for key, file in wmap.items():
        if file not in headers:
            path = os.path.join(folder, file)
            if not os.path.isfile(path):
                raise CheckpointError(f"{folder}: the index names {file} (for {key}), which is missing")
            headers[file] = read_header(path)
        if key not in headers[file]:
            raise CheckpointError(
                f"{os.path.join(folder, file)}: the index puts {key} here, but the file does not hold it"
            )
        dtype, shape = headers[file][key]
        out[key] = TensorInfo(dtype, shape, file)
    return out


def iter_tensors(folder: str, keys: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` of a checkpoint folder, shard by shard (all keys, or those asked for)."""
    wmap = weight_map(folder)
    wanted = list(wmap) if keys is None else keys
    by_file: dict[str, list[str]] = {}
    for key in wanted:
        by_file.setdefault(wmap[key], []).append(key)
    for file, file_keys in by_file.items():
        with safetensors.safe_open(os.path.join(folder, file), framework="pt") as f:
            for key in file_keys:
                yield key, f.get_tensor(key)


def write_checkpoint(
    tensors: dict[str, torch.Tensor], folder: str, max_shard_bytes: int, metadata: dict[str, str] | None = None
) -> list[str]:
    """Write ``tensors`` into ``folder`` (which must exist and be empty): one ``model.safetensors`` up to
    ``max_shard_bytes``, else shards of at most that size (a larger tensor gets a shard of its own) and
    the index. Returns the files written."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t.contiguous()
        size += nbytes
    meta = {"format": "pt", **(metadata or {})}
    umask = os.umask(0)
    os.umask(umask)

    def save(shard: dict[str, torch.Tensor], name: str) -> None:
        path = os.path.join(folder, name)
        safetensors.torch.save_file(shard, path, metadata=meta)
        os.chmod(path, 0o666 & ~umask)  # safetensors creates owner-only files; a model folder is for sharing

    if len(shards) == 1:
        save(shards[0], SINGLE)
        return [SINGLE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    wmap = {}
    for name, shard in zip(names, shards):
        save(shard, name)
        wmap.update({key: name for key in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(folder, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, f, indent=2)
    return [*names, INDEX]
