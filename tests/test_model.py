"""Decoder assembly: shapes, causality and cached decoding for every registered mixer."""

from __future__ import annotations

import pytest
import torch

from components.model import Decoder
from components.registry import MIXERS
from tests.helpers import compose_root

ALL_MIXERS = MIXERS.names()


def tiny_model(*overrides: str, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    model = Decoder(compose_root("model=tiny", *overrides)).double().eval()
    # random (not unit) norm gains so that a bug hidden by symmetric weights still shows
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("mixer", ALL_MIXERS)
def test_logits_shape(mixer):
    model = tiny_model(f"mixer={mixer}")
    ids = torch.randint(0, model.vocab_size, (3, 11))
    assert model(ids).shape == (3, 11, model.vocab_size)


@pytest.mark.parametrize("mixer", ALL_MIXERS)
def test_causality(mixer):
    """Changing token t+1 leaves every output up to t unchanged (model and mixer alone)."""
    model = tiny_model(f"mixer={mixer}")
    T = 24
    ids = torch.randint(0, model.vocab_size, (2, T))
    base = model(ids)
    for t in (0, 7, T - 2):
        changed = ids.clone()
        changed[:, t + 1 :] = torch.randint(0, model.vocab_size, (2, T - t - 1))
        out = model(changed)
        torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-10)
        assert not torch.allclose(out[:, t + 1 :], base[:, t + 1 :])
    mixer_module = model.layers[0].mixer
    x = torch.randn(2, T, model.d_model, dtype=torch.float64)
    y = mixer_module(x)
    x2 = x.clone()
    x2[:, 10:] = torch.randn_like(x2[:, 10:])
    torch.testing.assert_close(mixer_module(x2)[:, :10], y[:, :10], rtol=0, atol=1e-10)


@pytest.mark.parametrize("mixer", ALL_MIXERS)
@pytest.mark.parametrize("prefill,steps", [(5, 4), (1, 6), (8, 0)])
def test_prefill_then_decode_equals_full_pass(mixer, prefill, steps):
    model = tiny_model(f"mixer={mixer}")
    ids = torch.randint(0, model.vocab_size, (2, prefill + steps + 3))
    full = model(ids)
    cache = model.new_cache()
    outs = [model(ids[:, :prefill], cache=cache)]
    for t in range(prefill, prefill + steps):
        outs.append(model(ids[:, t : t + 1], cache=cache))
    outs.append(model(ids[:, prefill + steps :], cache=cache))  # a multi-token continuation
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-9, atol=1e-9)
    assert cache.seq_len == ids.shape[1]


def test_tied_and_untied_embeddings():
    tied = Decoder(compose_root("model=tiny", "model.tie_embeddings=true"))
    untied = Decoder(compose_root("model=tiny", "model.tie_embeddings=false"))
    assert tied.lm_head.weight is tied.embed.weight
    assert untied.lm_head.weight is not untied.embed.weight
    vocab, d = untied.embed.weight.shape
    assert untied.num_params() - tied.num_params() == vocab * d


def test_init_std_and_residual_scaling():
    root = compose_root("model=tiny", "model.d_model=256", "model.init_std=0.05", "model.n_layers=8")
    model = Decoder(root)
    assert abs(model.embed.weight.std().item() - 0.05) < 0.005
    out_std = model.layers[0].mixer.o_proj.weight.std().item()
    assert abs(out_std - 0.05 / 4) < 0.003  # 0.05 / sqrt(2 * 8)


def test_parameter_accounting_dense():
    model = Decoder(compose_root("model=tiny", "model.tie_embeddings=false"))
    total = sum(p.numel() for p in model.parameters())
    assert model.num_params() == total
    assert model.active_params() == total - model.embed.weight.numel()
    assert model.flops_per_token(64) > 6 * model.active_params()
