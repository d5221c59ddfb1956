"""Every registered FFN (found through the registry): the contract, shapes, causality (no token mixing),
cached decoding, parameter accounting and training."""

from __future__ import annotations

import math

import pytest

from components.ffn.base import FFN
from components.registry import FFNS
from tests.helpers import assert_cached_decoding_matches, assert_causal, assert_shape, tiny_model, train_steps

NAMES = FFNS.names()


@pytest.mark.parametrize("name", NAMES)
def test_follows_the_ffn_contract(name):
    model = tiny_model(f"ffn={name}")
    ffn = model.layers[0].ffn
    assert isinstance(ffn, FFN)
    assert 0 < ffn.active_params() <= ffn.num_params()
    assert ffn.num_params() - ffn.active_params() == ffn.unchosen_expert_params()
    assert (ffn.routed_experts() is None) == (ffn.router() is None)
    assert_shape(model)


@pytest.mark.parametrize("name", NAMES)
def test_is_causal_and_decodes_from_the_cache(name):
    model = tiny_model(f"ffn={name}")
    assert_causal(model)
    routed = model.layers[0].ffn.router() is not None  # router scores are fp32 whatever the model dtype
    assert_cached_decoding_matches(model, prefill=5, steps=3, tol=1e-6 if routed else 1e-9)


@pytest.mark.parametrize("name", NAMES)
def test_trains(name):
    _, losses, _ = train_steps(f"ffn={name}")
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
