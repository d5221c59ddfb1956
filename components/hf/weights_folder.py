"""A composed decoder's weights as a Hugging Face checkpoint folder, and back.

``export_weights`` writes every parameter under its checkpoint name (``key_map``), routed experts as
per-expert tensors (optionally MXFP4-packed); ``import_weights`` loads a folder in that layout (either
prefix; MXFP4 experts dequantised) into a model, refusing a missing, unknown or misshapen tensor by
name; ``check_weights`` does the same comparison from the files' headers alone, without reading data.
"""

from __future__ import annotations

import os
import re
from typing import Callable, Optional

import torch

from components.distributed import require_whole_model
from components.hf import mxfp4
from components.hf.key_map import TEXT_PREFIX, checkpoint_mappings, checkpoint_prefix, to_checkpoint
from components.hf.safetensors_files import INDEX, SINGLE, iter_tensors, tensor_infos, write_checkpoint
from components.model import Decoder

_EXPERT_WEIGHT = re.compile(r"^(.+\.block_sparse_moe\.experts\.\d+\.w[123])\.weight$")
PACKED, SCALE = "weight_packed", "weight_scale"


class WeightsMismatch(ValueError):
    """A checkpoint whose tensors do not fit the model; the message names the first offending tensor."""


def export_weights(
    model: Decoder,
    folder: str,
    prefix: str = TEXT_PREFIX,
    max_shard_bytes: int = 5 << 30,
    dtype: Optional[torch.dtype] = None,
    mxfp4_experts: bool = False,
    shape_of: Optional[Callable[[str, tuple[int, ...]], tuple[int, ...]]] = None,
) -> list[str]:
    """Write ``model``'s weights into the empty folder ``folder``; returns the files written. ``dtype``
    casts floating tensors (the selection bias stays fp32); ``mxfp4_experts`` packs routed experts;
    ``shape_of(key, shape)`` gives a tensor the view a target class stores it in (same numbers). A model
    split over ranks is refused by name (``require_whole_model``)."""
    require_whole_model(model, "export")
    out = {}
    for key, t in to_checkpoint(model, prefix).items():
        if shape_of is not None:
            t = t.reshape(shape_of(key, tuple(t.shape)))
        m = _EXPERT_WEIGHT.match(key)
        if mxfp4_experts and m:
            packed, scale = mxfp4.quantize(t)
            out[f"{m.group(1)}.{PACKED}"], out[f"{m.group(1)}.{SCALE}"] = packed, scale
            continue
        if dtype is not None and t.is_floating_point() and not key.endswith("e_score_correction_bias"):
            t = t.to(dtype)
        out[key] = t
    return write_checkpoint(out, folder, max_shard_bytes)


def _expected(model: Decoder, prefix: str) -> dict[str, tuple[str, torch.Size]]:
    """``{checkpoint key: (sandbox key, shape)}`` the model needs."""
    state = model.state_dict()
    out = {}
    for key, mapping in checkpoint_mappings(model, prefix).items():
        shapes = [t.shape for t in mapping.to_checkpoint(torch.empty(state[key].shape, device="meta"))]
        out.update({k: (key, s) for k, s in zip(mapping.keys, shapes)})
    return out


def _compare(
    expected: dict[str, tuple[str, torch.Size]], found: dict[str, tuple[torch.dtype, tuple[int, ...]]], where: str
) -> list[str]:
    """Every checkpoint key the model needs is found with its shape (an expert matrix may be MXFP4:
    ``weight_packed [out, in/2]`` + ``weight_scale [out, in/32]``, uint8); nothing else is there.
    Returns the keys to read, MXFP4 pairs as the packed key."""
    used, keys = set(), []
    for key, (owner, shape) in expected.items():
        base = key[: -len(".weight")]
        if key in found:
            dtype, got = found[key]
            if tuple(got) != tuple(shape) and not _other_view(key, tuple(got), tuple(shape)):
                raise WeightsMismatch(f"{where}: {key} has shape {list(got)}, the model ({owner}) needs {list(shape)}")
            if not dtype.is_floating_point:
                raise WeightsMismatch(f"{where}: {key} is {dtype}, the model ({owner}) needs a floating-point tensor")
            used.add(key)
            keys.append(key)
        elif _EXPERT_WEIGHT.match(key) and f"{base}.{PACKED}" in found:
            packed_key, scale_key = f"{base}.{PACKED}", f"{base}.{SCALE}"
            if scale_key not in found:
                raise WeightsMismatch(f"{where}: {packed_key} has no {scale_key} beside it")
            out_dim, in_dim = shape
            want = {packed_key: (out_dim, in_dim // 2), scale_key: (out_dim, in_dim // mxfp4.GROUP)}
            for k, s in want.items():
                dtype, got = found[k]
                if dtype != torch.uint8 or tuple(got) != s:
                    raise WeightsMismatch(
                        f"{where}: {k} is {dtype} {list(got)}; MXFP4 for {owner} [{out_dim}, {in_dim}] needs uint8 "
                        f"{list(s)}"
                    )
            used.update(want)
            keys.append(packed_key)
        else:
            raise WeightsMismatch(f"{where}: {key} is missing (the model's {owner})")
    unknown = sorted(set(found) - used)
    if unknown:
        more = f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""
        raise WeightsMismatch(f"{where}: {unknown[0]}{more} is not a parameter of this model")
    return keys


def _other_view(key: str, got: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """A tensor stored in the view of another class: KDA's ``A_log [H]`` as transformers' Kimi Linear
    keeps it, ``[1, 1, H, 1]``."""
    return key.endswith(".self_attn.A_log") and got == (1, 1, *shape, 1)


def check_weights(folder: str, model: Decoder) -> str:
    """Compare a checkpoint folder's keys, shapes and dtypes (headers only) with ``model`` (which may be
    on the meta device); returns the prefix the folder uses. Raises WeightsMismatch naming a tensor."""
    infos = tensor_infos(folder)
    prefix = checkpoint_prefix(list(infos))
    _compare(_expected(model, prefix), {k: (i.dtype, i.shape) for k, i in infos.items()}, folder)
    return prefix


def import_weights(folder: str, model: Decoder) -> None:
    """Load a checkpoint folder into ``model`` (strict: every parameter, nothing unknown, shapes equal)."""
    infos = tensor_infos(folder)
    prefix = checkpoint_prefix(list(infos))
    expected = _expected(model, prefix)
    _compare(expected, {k: (i.dtype, i.shape) for k, i in infos.items()}, folder)
    loaded: dict[str, torch.Tensor] = dict(iter_tensors(folder))
    state = {}
    for key, mapping in checkpoint_mappings(model, prefix).items():
        parts = []
        for k in mapping.keys:
            if k in loaded:
                parts.append(loaded[k])
            else:  # MXFP4 expert matrix
                base = k[: -len(".weight")]
                parts.append(mxfp4.dequantize(loaded[f"{base}.{PACKED}"], loaded[f"{base}.{SCALE}"]))
        state[key] = mapping.from_checkpoint(parts)
    if model.lm_head.weight is model.embed.weight:
        state["lm_head.weight"] = state["embed.weight"]
    target = model.state_dict()
    with torch.no_grad():
        for key, t in state.items():
            target[key].copy_(t.to(target[key].dtype).reshape(target[key].shape))  # shapes checked above


def is_checkpoint_folder(path: str) -> bool:
    """Whether ``path`` is a folder of exported weights (config.json beside safetensors)."""
    return (
        os.path.isdir(path)
        and os.path.isfile(os.path.join(path, "config.json"))
        and (os.path.isfile(os.path.join(path, SINGLE)) or os.path.isfile(os.path.join(path, INDEX)))
    )


__all__ = ["WeightsMismatch", "check_weights", "export_weights", "import_weights", "is_checkpoint_folder"]
