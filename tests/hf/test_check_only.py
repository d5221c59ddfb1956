"""``analysis.export --check-only`` on a synthetic index of the full K3 shapes (header-only shards, as the
release stores them: bf16 weights, MXFP4 routed experts) passes in well under a minute; one wrong shape
or one unknown key fails, naming it."""

from __future__ import annotations

import json
import math
import struct
import time

import pytest
import torch

from analysis.export import main as export_main
from components.hf.key_map import MULTIMODAL_PREFIX
from components.hf.weights_folder import _EXPERT_WEIGHT, PACKED, SCALE, _expected
from components.model import Decoder
from runtime.compose import compose_root

SHARDS = 4


_BYTES = {"U8": 1, "BF16": 2, "F32": 4}


def _write_header_only(path, entries: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors header describing ``entries``, the data a sparse hole of the right size (the check
    reads headers and file sizes, never tensor data, so full-size shards take no disk)."""
    header, offset = {}, 0
    for key, (dtype, shape) in entries.items():
        size = math.prod(shape) * _BYTES[dtype]
        header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)


def _k3_full_entries() -> dict[str, tuple[str, list[int]]]:
    root = compose_root(["experiment=k3_full"])
    with torch.device("meta"):
        model = Decoder(root.decoder_config())
    entries = {}
    for key, (_, shape) in _expected(model, MULTIMODAL_PREFIX).items():
        m = _EXPERT_WEIGHT.match(key)
        if m:
            out, inp = shape
            entries[f"{m.group(1)}.{PACKED}"] = ("U8", [out, inp // 2])
            entries[f"{m.group(1)}.{SCALE}"] = ("U8", [out, inp // 32])
        else:
            entries[key] = ("F32" if key.endswith("e_score_correction_bias") else "BF16", list(shape))
    return entries


def _write_index(folder, entries) -> None:
    keys = list(entries)
    weight_map = {}
    for s in range(SHARDS):
        name = f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"
        part = {k: entries[k] for k in keys[s::SHARDS]}
        _write_header_only(folder / name, part)
        weight_map.update({k: name for k in part})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )


@pytest.fixture(scope="module")
def k3_full_entries():
    return _k3_full_entries()


@pytest.mark.slow
def test_full_k3_index_passes_quickly(k3_full_entries, tmp_path, capsys):
    _write_index(tmp_path, k3_full_entries)
    t0 = time.perf_counter()
    assert export_main(["--check-only", str(tmp_path)]) == 0
    assert time.perf_counter() - t0 < 60
    assert "every key, shape and dtype matches" in capsys.readouterr().out


@pytest.mark.slow  # ~11 s: a second full-size check (the passing one runs by default)
def test_one_wrong_shape_is_named(k3_full_entries, tmp_path, capsys):
    key = MULTIMODAL_PREFIX + "layers.11.self_attn.kv_b_proj.weight"  # layer 12 (1-based) is MLA
    entries = dict(k3_full_entries)
    dtype, shape = entries[key]
    entries[key] = (dtype, [shape[0] + 1, shape[1]])
    _write_index(tmp_path, entries)
    assert export_main(["--check-only", str(tmp_path)]) == 1
    assert key in capsys.readouterr().err


@pytest.mark.slow  # ~11 s, as above
def test_one_unknown_key_is_named(k3_full_entries, tmp_path, capsys):
    key = MULTIMODAL_PREFIX + "layers.5.self_attn.stray.weight"
    _write_index(tmp_path, {**k3_full_entries, key: ("BF16", [4])})
    assert export_main(["--check-only", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert key in err and "not a parameter of this model" in err
