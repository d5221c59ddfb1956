"""MXFP4 exports carry compressed-tensors' ``quantization_config`` (``mxfp4-pack-quantized``, groups of 32,
E8M0 scales; the routed experts packed, shared experts and everything else left as they are), and
compressed-tensors' own decompression of every packed tensor equals the project's dequantisation
exactly; the folder still loads through AutoModelForCausalLM as load_run reads it."""

from __future__ import annotations

import json

import pytest
import torch

from components.hf import mxfp4
from components.hf.key_map import MULTIMODAL_PREFIX, TEXT_PREFIX
from components.hf.safetensors_files import iter_tensors, read_header
from runtime.load_run import load_run
from tests.hf.transformers_helpers import ids, tiny, write

pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.base import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402
from compressed_tensors.utils.match import match_name  # noqa: E402


@pytest.fixture(scope="module")
def k3():
    return tiny("experiment=k3_tiny")


@pytest.mark.parametrize("prefix", [TEXT_PREFIX, MULTIMODAL_PREFIX], ids=["text", "multimodal"])
def test_compressed_tensors_decompresses_the_experts_as_the_project_does(tmp_path, k3, prefix):
    root, model = k3
    write(tmp_path, root, model, prefix=prefix, mxfp4_experts=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    raw = cfg["quantization_config"]
    if prefix == MULTIMODAL_PREFIX:
        assert cfg["text_config"]["quantization_config"] == raw  # where the release keeps it too
    config = QuantizationConfig.model_validate(raw)
    assert config.quant_method == "compressed-tensors" and config.format == "mxfp4-pack-quantized"
    (scheme,) = config.config_groups.values()
    w = scheme.weights
    assert (w.num_bits, w.type, w.strategy, w.group_size, w.symmetric) == (4, "float", "group", 32, True)
    assert w.scale_dtype == torch.uint8 and scheme.input_activations is None

    header = read_header(str(tmp_path / "model.safetensors"))
    modules = {k.rsplit(".", 1)[0] for k in header if k.endswith((".weight", ".weight_packed"))}
    quantised = {
        m
        for m in modules
        if any(match_name(m, t) for t in scheme.targets) and not any(match_name(m, i) for i in config.ignore)
    }
    packed = {k[: -len(".weight_packed")] for k in header if k.endswith(".weight_packed")}
    assert quantised == packed and len(packed) == 4 * 8 * 3  # w1/w2/w3 of 8 experts: 3 MoE layers, 1 MTP depth
    assert any("shared_experts" in m for m in modules) and not any("shared_experts" in m for m in packed)

    tensors = dict(iter_tensors(str(tmp_path)))
    compressor = BaseCompressor.get_value_from_registry(config.format)
    for name in sorted(packed):
        p, s = tensors[f"{name}.weight_packed"], tensors[f"{name}.weight_scale"]
        theirs = compressor.decompress({"weight_packed": p, "weight_scale": s}, scheme)["weight"]
        assert torch.equal(theirs.float(), mxfp4.dequantize(p, s)), name


def test_an_mxfp4_export_loads_through_auto_model_as_load_run_reads_it(tmp_path, k3):
    transformers = pytest.importorskip("transformers")
    import components.hf.transformers_model  # noqa: F401  (registers the project's classes)

    root, model = k3
    write(tmp_path, root, model, mxfp4_experts=True)
    _, dequantised = load_run(str(tmp_path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    x = ids(length=16)
    with torch.no_grad():
        assert torch.equal(hf(x).logits, dequantised(x))
