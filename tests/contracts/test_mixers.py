"""Every registered mixer (found through the registry, so a new one is covered without editing this
file): the contract, shapes, causality, cached decoding equal to a full pass, and training."""

from __future__ import annotations

import math

import pytest

from components.mixers.base import Mixer
from components.registry import MIXERS
from tests.helpers import assert_cached_decoding_matches, assert_causal, assert_shape, tiny_model, train_steps

NAMES = MIXERS.names()


@pytest.mark.parametrize("name", NAMES)
def test_follows_the_mixer_contract(name):
    model = tiny_model(f"mixer={name}")
    mixer = model.layers[0].mixer
    assert isinstance(mixer, Mixer)
    assert mixer.flops_per_token(64) >= 0 and mixer.cache_numbers_per_token() >= 0
    assert mixer.state_numbers() >= mixer.recurrent_state_numbers() >= 0
    assert_shape(model)


@pytest.mark.parametrize("name", NAMES)
def test_is_causal(name):
    import torch

    model = tiny_model(f"mixer={name}")
    assert_causal(model)
    mixer = model.layers[0].mixer  # the mixer alone, on raw hidden states
    x = torch.randn(2, 24, model.d_model, dtype=torch.float64)
    x2 = x.clone()
    x2[:, 10:] = torch.randn_like(x2[:, 10:])
    torch.testing.assert_close(mixer(x2)[:, :10], mixer(x)[:, :10], rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("prefill,steps", [(5, 4), (1, 6), (8, 0)])
def test_cached_decoding_equals_full_pass(name, prefill, steps):
    assert_cached_decoding_matches(tiny_model(f"mixer={name}"), prefill, steps)


@pytest.mark.parametrize("name", NAMES)
def test_trains(name):
    _, losses, _ = train_steps(f"mixer={name}")
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
