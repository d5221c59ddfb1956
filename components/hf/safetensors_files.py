"""Hugging Face checkpoint folders: ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors``
with ``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": {key: file}}``).

Headers are read without touching tensor data (the first 8 bytes give the JSON header's length), so a
full-size checkpoint's keys, shapes and dtypes can be checked in seconds.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Iterator, NamedTuple

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
    """``{key: (dtype, shape)}`` of one safetensors file, from its header alone."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                raise CheckpointError(f"{path}: not a safetensors file (header length {n} bytes)")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: unreadable safetensors header ({err})") from None
    out = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if entry.get("dtype") not in DTYPES:
            raise CheckpointError(
                f"{path}: tensor {key} has dtype {entry.get('dtype')!r}; readable: {', '.join(DTYPES)}"
            )
        out[key] = (DTYPES[entry["dtype"]], tuple(entry["shape"]))
    return out


def weight_map(folder: str) -> dict[str, str]:
    """``{key: shard file}`` of a checkpoint folder (its index, or the keys of its single file)."""
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                data = json.load(f)
            return dict(data["weight_map"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(
                f"{index}: not a safetensors index ({err!r}); expected a 'weight_map' object"
            ) from None
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
    from safetensors import safe_open

    wmap = weight_map(folder)
    wanted = list(wmap) if keys is None else keys
    by_file: dict[str, list[str]] = {}
    for key in wanted:
        by_file.setdefault(wmap[key], []).append(key)
    for file, file_keys in by_file.items():
        with safe_open(os.path.join(folder, file), framework="pt") as f:
            for key in file_keys:
                yield key, f.get_tensor(key)


def write_checkpoint(
    tensors: dict[str, torch.Tensor], folder: str, max_shard_bytes: int, metadata: dict[str, str] | None = None
) -> list[str]:
    """Write ``tensors`` into ``folder`` (which must exist and be empty): one ``model.safetensors`` up to
    ``max_shard_bytes``, else shards of at most that size (a larger tensor gets a shard of its own) and
    the index. Returns the files written."""
    from safetensors.torch import save_file

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
        save_file(shard, path, metadata=meta)
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
