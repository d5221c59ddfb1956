"""MXFP4 experts: a synthetic packed tensor dequantises to the values an independent element-by-element
decoding gives; quantising then dequantising is exact on representable values and within half a step
elsewhere; an exported model with MXFP4 experts loads back with those experts dequantised."""

from __future__ import annotations

import torch

from components.hf import mxfp4
from components.hf.weights_folder import export_weights, import_weights
from components.model import Decoder
from tests.helpers import compose_root


def _decode_one(code: int, exponent_byte: int) -> float:
    """E2M1 by its definition: sign, 2-bit exponent (bias 1; 0 is subnormal), 1-bit mantissa; times 2^(s-127)."""
    sign = -1.0 if code & 0b1000 else 1.0
    e, m = (code >> 1) & 0b11, code & 0b1
    magnitude = (m * 0.5) if e == 0 else (1.0 + m * 0.5) * 2.0 ** (e - 1)
    return sign * magnitude * 2.0 ** (exponent_byte - 127)


def test_dequantize_matches_elementwise_decoding():
    g = torch.Generator().manual_seed(0)
    out, cols = 3, 64
    packed = torch.randint(0, 256, (out, cols // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(120, 135, (out, cols // 32), generator=g, dtype=torch.uint8)
    expected = torch.empty(out, cols)
    for r in range(out):
        for c in range(cols):
            byte = int(packed[r, c // 2])
            code = byte & 0xF if c % 2 == 0 else byte >> 4  # even column: low nibble
            expected[r, c] = _decode_one(code, int(scale[r, c // 32]))
    assert torch.equal(mxfp4.dequantize(packed, scale), expected)


def test_quantize_round_trip():
    g = torch.Generator().manual_seed(1)
    # representable: E2M1 values times a power of two per group
    codes = torch.randint(0, 16, (4, 64), generator=g)
    values = torch.tensor([_decode_one(int(c), 127) for c in codes.flatten()]).view(4, 64)
    values[:, ::32] = 6.0  # each group's largest magnitude sets its scale
    w = values * 2.0 ** torch.randint(-4, 5, (4, 2), generator=g).repeat_interleave(32, dim=1)
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(w)), w)
    x = torch.randn(8, 96, generator=g)
    deq = mxfp4.dequantize(*mxfp4.quantize(x))
    step = 2.0 ** (torch.frexp(x.unflatten(-1, (-1, 32)).abs().amax(-1))[1] - 1 - 2).repeat_interleave(
        32, dim=1
    )  # group scale
    # half the widest E2M1 gap (4 -> 6) below 6, and saturation of the group's largest values (scaled into [4, 8)) at 6
    err = (deq - x).abs()
    assert (err <= 2 * step + 1e-7).all()
    inside = x.abs() <= 6 * step
    assert (err[inside] <= step[inside] + 1e-7).all()


def test_exported_mxfp4_experts_load_dequantised(tmp_path):
    root = compose_root(
        "ffn=stable_latent_moe",
        "model.d_model=64",
        "model.n_layers=2",
        "ffn.num_experts=4",
        "ffn.top_k=2",
        "ffn.expert_hidden_dim=32",
        "ffn.latent_dim=32",
        "data=corpus",
    )
    torch.manual_seed(0)
    model = Decoder(root.decoder_config())
    export_weights(model, str(tmp_path), mxfp4_experts=True)
    from components.hf.safetensors_files import read_header

    header = read_header(str(tmp_path / "model.safetensors"))
    assert header["model.layers.1.block_sparse_moe.experts.2.w2.weight_packed"] == (torch.uint8, (32, 16))
    assert header["model.layers.1.block_sparse_moe.experts.2.w2.weight_scale"] == (torch.uint8, (32, 1))
    assert "model.layers.1.block_sparse_moe.experts.2.w2.weight" not in header
    torch.manual_seed(1)
    target = Decoder(root.decoder_config())
    import_weights(str(tmp_path), target)
    ex, got = model.layers[1].ffn.experts, target.layers[1].ffn.experts
    assert torch.equal(got.w2, torch.stack([mxfp4.dequantize(*mxfp4.quantize(ex.w2[e])) for e in range(4)]))
    assert torch.equal(target.layers[1].ffn.gate.weight, model.layers[1].ffn.gate.weight)  # everything else exact
