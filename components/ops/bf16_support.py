"""Whether a device multiplies bf16 operands in hardware.

CUDA GPUs this project targets do (tensor cores). A CPU does where it has AMX tiles or AVX-512 BF16; a CPU
with AVX2 only has no bf16 matrix kernel, and PyTorch's fallback converts element by element: a 1,024-square
bf16 product ran at about 1 GFLOP/s on such a 2-core machine against fp32's 110. Code that picks bf16 for
speed (mixed precision, Muon's Newton-Schulz iteration) asks here first.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 operands in hardware (AMX tiles or AVX-512 BF16)."""
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 products on ``device`` run in hardware (any non-CPU device is taken to)."""
    return device.type != "cpu" or cpu_has_native_bf16()
