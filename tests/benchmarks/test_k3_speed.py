"""benchmarks/k3_speed.py's fixed reference row: its short convolution computes what the trainer's does,
and the swap that installs it is undone after the row runs."""

from __future__ import annotations

import pytest
import torch

import components.mixers.kda as kda
from benchmarks.k3_speed import as_before, strided_taps_conv
from components.nn.segments import Segments


@pytest.mark.parametrize("case", ["zero prefix", "prefix", "documents"])
def test_the_baseline_convolution_equals_the_trainers(case):
    gen = torch.Generator().manual_seed(0)
    B, T, P, W = 2, 9, 6, 4
    x = torch.randn(B, T, P, generator=gen, dtype=torch.float64)
    w = torch.randn(P, 1, W, generator=gen, dtype=torch.float64)
    prefix = torch.randn(B, W - 1, P, generator=gen, dtype=torch.float64) if case == "prefix" else None
    xp = torch.cat([prefix if prefix is not None else x.new_zeros(B, W - 1, P), x], dim=1)
    segments = Segments(torch.tensor([[0] * 4 + [1] * 5, [0] * 7 + [1] * 2])) if case == "documents" else None
    want = kda.shifted_depthwise_conv(x, w, xp if prefix is not None else None, segments)
    got = strided_taps_conv(x, w, xp if prefix is not None else None, segments)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_as_before_swaps_the_convolution_only_while_it_runs():
    current = kda.shifted_depthwise_conv
    with as_before():
        assert kda.shifted_depthwise_conv is strided_taps_conv
    assert kda.shifted_depthwise_conv is current
    with pytest.raises(RuntimeError), as_before():
        raise RuntimeError("a failing step")
    assert kda.shifted_depthwise_conv is current
