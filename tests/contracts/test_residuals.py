"""Every registered residual scheme (found through the registry): the contract, causality, cached
decoding equal to a full pass, and training (every scheme parameter receives a gradient)."""

from __future__ import annotations

import math

import pytest

from components.registry import RESIDUALS
from components.residual.base import ResidualScheme
from tests.helpers import assert_cached_decoding_matches, assert_causal, assert_shape, tiny_model, train_steps

NAMES = RESIDUALS.names()


@pytest.mark.parametrize("name", NAMES)
def test_follows_the_residual_contract(name):
    model = tiny_model(f"residual={name}", "model.n_layers=3")
    assert isinstance(model.residual, ResidualScheme)
    reads = model.residual.sources_per_read()
    assert reads is None or len(reads) == 2 * 3 + 1  # every sublayer, then the final read
    assert_shape(model)


@pytest.mark.parametrize("name", NAMES)
def test_is_causal_and_decodes_from_the_cache(name):
    model = tiny_model(f"residual={name}", "model.n_layers=3")
    assert_causal(model)
    assert_cached_decoding_matches(model, prefill=5, steps=3)


@pytest.mark.parametrize("name", NAMES)
def test_trains(name):
    _, losses, _ = train_steps(f"residual={name}", "model.n_layers=3")
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
