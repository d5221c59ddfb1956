"""The MFU ceiling's matmul probe stays small where matmuls are slow (bf16 on a CPU without native bf16)."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from runtime.callbacks.throughput import measure_peak_flops


def _probe_flops(**kwargs) -> tuple[float, int]:
    with FlopCounterMode(display=False) as counter:
        peak = measure_peak_flops(torch.device("cpu"), torch.float32, **kwargs)
    return peak, counter.get_total_flops()


def test_a_slow_first_product_ends_the_search_at_the_smallest_size():
    # a zero budget makes every product "slow enough": the probe must not grow past 256
    peak, flops = _probe_flops(budget_s=0.0)
    assert peak > 0
    assert flops == 2 * 256**3 * 3  # warm-up, the timed single product, one repeat


def test_the_size_never_exceeds_max_size():
    peak, flops = _probe_flops(max_size=512, budget_s=1e9)
    one = 2 * 512**3
    assert peak > 0
    # 256 (two products) then 512: warm-up, single, and at most 20 repeats
    assert flops <= 2 * 2 * 256**3 + 22 * one
    assert flops >= 2 * 2 * 256**3 + 3 * one
