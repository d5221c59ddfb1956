"""Every registered load balancer (found through the registry), on a routed FFN: the contract, and a few
training steps wired as the runtime wires them (loss term per micro-batch, update per optimizer step)."""

from __future__ import annotations

import math

import pytest

from components.balancers.base import Balancer
from components.registry import BALANCERS
from tests.helpers import train_steps

NAMES = BALANCERS.names()


@pytest.mark.parametrize("name", NAMES)
def test_trains_a_routed_model_and_reports_balance(name):
    model, losses, metrics = train_steps(f"balancer={name}", "ffn=moe", "ffn.num_experts=4")
    assert isinstance(BALANCERS.build(BALANCERS.get(name).config_cls()), Balancer)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    # every routed layer's MaxVio is reported after each step
    assert {f"maxvio/layer_{i}" for i in range(len(model.layers))} <= set(metrics), metrics
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", NAMES)
def test_leaves_a_dense_model_untouched(name):
    _, losses, metrics = train_steps(f"balancer={name}", "ffn=dense")
    assert all(math.isfinite(x) for x in losses)
    assert not any(k.startswith("maxvio/") for k in metrics)
