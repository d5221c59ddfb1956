"""Saved RNG states restore every generator's stream exactly, and survive weights_only loading."""

from __future__ import annotations

import io
import random

import numpy as np
import torch

from runtime import rng_state


def _draw() -> tuple:
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)], random.gauss(0, 1)


def test_restore_replays_torch_numpy_and_python_streams():
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    _draw()
    random.gauss(0, 1)  # leaves a cached Gaussian in Python's state
    saved = rng_state.capture()
    expected = _draw()
    _draw()  # move every stream on
    buffer = io.BytesIO()
    torch.save({"rng_states": [saved]}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["rng_states"]  # no pickled code needed
    assert rng_state.restore_for_rank(loaded, 0)
    assert _draw() == expected


def test_a_different_world_size_restores_nothing():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    assert not rng_state.restore_for_rank([rng_state.capture(), rng_state.capture()], 0)
    assert torch.equal(torch.get_rng_state(), before)
