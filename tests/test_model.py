"""Decoder assembly: embeddings, init scales and parameter accounting (every component's shapes,
causality and cached decoding: tests/contracts/)."""

from __future__ import annotations

from components.model import Decoder
from tests.helpers import build_model, compose_root


def test_tied_and_untied_embeddings():
    tied = build_model("model=tiny", "model.tie_embeddings=true")
    untied = build_model("model=tiny", "model.tie_embeddings=false")
    assert tied.lm_head.weight is tied.embed.weight
    assert untied.lm_head.weight is not untied.embed.weight
    vocab, d = untied.embed.weight.shape
    assert untied.num_params() - tied.num_params() == vocab * d


def test_init_std_and_residual_scaling():
    root = compose_root("model=tiny", "model.d_model=256", "model.init_std=0.05", "model.n_layers=8")
    model = Decoder(root.decoder_config())
    assert abs(model.embed.weight.std().item() - 0.05) < 0.005
    out_std = model.layers[0].mixer.o_proj.weight.std().item()
    assert abs(out_std - 0.05 / 4) < 0.003  # 0.05 / sqrt(2 * 8)


def test_parameter_accounting_dense():
    model = build_model("model=tiny", "model.tie_embeddings=false")
    total = sum(p.numel() for p in model.parameters())
    assert model.num_params() == total
    assert model.active_params() == total - model.embed.weight.numel()
    assert model.flops_per_token(64) > 6 * model.active_params()
