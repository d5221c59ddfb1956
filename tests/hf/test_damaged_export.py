"""A damaged folder of exported weights is named before anything runs: a shard cut short with its header
intact, a header entry that is not an object, an index entry that is not a file name."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from components.hf.config_json import checkpoint_config, write_config
from components.hf.key_map import PREFIXES
from components.hf.safetensors_files import INDEX, SINGLE, CheckpointError, read_header, weight_map
from components.hf.weights_folder import export_weights
from components.model import Decoder
from components.registry import ConfigError
from runtime.config import to_container
from runtime.load_run import RunLoadError, load_run
from tests.helpers import compose_root

OVERRIDES = ("model=tiny", "mixer=kda")


@pytest.fixture
def exported(tmp_path):
    root = compose_root(*OVERRIDES)
    torch.manual_seed(0)
    model = Decoder(root.decoder_config())
    export_weights(model, str(tmp_path), PREFIXES["text"], 1 << 30, None, False)
    write_config(checkpoint_config(root, model, to_container(root)), str(tmp_path))
    return tmp_path


def test_a_shard_cut_short_is_named_by_every_reader(exported):
    path = exported / SINGLE
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"model.safetensors: the header describes .* bytes of tensor data"):
        read_header(str(path))
    with pytest.raises(RunLoadError, match="model.safetensors: the header describes"):
        load_run(str(exported))
    with pytest.raises(ConfigError, match="init_from: .*model.safetensors: the header describes"):
        compose_root(*OVERRIDES, f"init_from={exported}")


def _first_tensor(header: dict) -> str:
    return next(k for k in header if k != "__metadata__")


def _rewrite_header(path, edit) -> None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda h: h.update({_first_tensor(h): 3}), "is a int, not an object"),
        (lambda h: h[_first_tensor(h)].update(shape="big"), "expected a list of sizes"),
        (lambda h: h[_first_tensor(h)].update(data_offsets=[0]), "expected [begin, end]"),
    ],
    ids=["entry-not-an-object", "shape-not-a-list", "offsets-not-a-pair"],
)
def test_a_corrupt_header_entry_is_named(exported, edit, message):
    _rewrite_header(exported / SINGLE, edit)
    with pytest.raises(CheckpointError, match=r"model.safetensors: .*" + message.replace("[", r"\[")):
        read_header(str(exported / SINGLE))


def test_an_index_entry_that_is_not_a_file_name_is_named(exported):
    keys = list(read_header(str(exported / SINGLE)))
    (exported / INDEX).write_text(json.dumps({"weight_map": {keys[0]: 7, **{k: SINGLE for k in keys[1:]}}}))
    with pytest.raises(CheckpointError, match=rf"weight_map\['{keys[0]}'\] is 7, not the name of a shard file"):
        weight_map(str(exported))
