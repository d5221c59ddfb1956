"""Warmup-stable-decay: values at chosen steps for each decay shape, and a stable phase that does not
depend on the run's length (what lets one stable run branch into cooldowns of several lengths)."""

from __future__ import annotations

import math

import pytest

from components.optim.schedules.wsd import decay_start
from components.registry import ConfigError
from tests.helpers import compose_root, lr_multiplier


def wsd(step, total=100, warmup=10, shape="linear", fraction=0.2, floor=0.1):
    return lr_multiplier(step, warmup, total, "wsd", floor, decay_fraction=fraction, decay_shape=shape)


def test_wsd_values_at_chosen_steps():
    assert wsd(0) == pytest.approx(0.1) and wsd(9) == pytest.approx(1.0)  # warmup
    assert decay_start(100, 10, 0.2) == 80
    assert all(wsd(s) == 1.0 for s in range(10, 81))  # stable through the first decay step (progress 0)
    assert wsd(90) == pytest.approx(1 - 0.9 * 0.5)  # linear, halfway
    assert wsd(90, shape="cosine") == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert wsd(85, shape="sqrt") == pytest.approx(1 - 0.9 * math.sqrt(0.25))
    for shape in ("linear", "cosine", "sqrt"):
        assert wsd(100, shape=shape) == pytest.approx(0.1) and wsd(150, shape=shape) == pytest.approx(0.1)
        values = [wsd(s, shape=shape) for s in range(80, 101)]
        assert all(a >= b for a, b in zip(values, values[1:]))  # the decay never rises
    assert decay_start(20, 10, 0.9) == 10  # the decay never starts inside the warmup


def test_the_stable_phase_is_the_same_for_every_run_length():
    short, long = 60, 300
    start = decay_start(short, 10, 0.25)
    assert [wsd(s, total=short, fraction=0.25) for s in range(start + 1)] == [
        wsd(s, total=long, fraction=0.25) for s in range(start + 1)
    ]


def test_wsd_options_are_checked():
    root = compose_root("schedule=wsd", "schedule.decay_fraction=0.3", "schedule.decay_shape=sqrt")
    assert root.schedule.decay_fraction == 0.3
    with pytest.raises(ConfigError, match="schedule.decay_shape"):
        compose_root("schedule=wsd", "schedule.decay_shape=exp")
    with pytest.raises(ConfigError, match="schedule.decay_fraction"):
        compose_root("schedule=wsd", "schedule.decay_fraction=0")
    with pytest.raises(ConfigError, match="schedule.decay_fraction"):  # a key the cosine schedule does not have
        compose_root("schedule=cosine", "+schedule.decay_fraction=0.3")
