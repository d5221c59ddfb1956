"""MXFP4 weights (OCP Microscaling, as compressed-tensors' ``mxfp4-pack-quantized`` stores them).

A matrix ``W [out, in]`` is cut into groups of 32 consecutive elements along ``in``. Each group shares
one power-of-two scale, stored as an E8M0 byte ``s`` (value ``2 ** (s - 127)``); each element is an
FP4 E2M1 code (1 sign bit, 2 exponent bits, 1 mantissa bit: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6).
Two codes share a byte, the even element in the low nibble. Tensors:

* ``weight_packed [out, in / 2]`` uint8;
* ``weight_scale [out, in / 32]`` uint8 (E8M0).

``dequantize`` is the load path (released routed experts); ``quantize`` writes the same format
(round to nearest, ties to even; the group's scale is ``2 ** (floor(log2(amax)) - 2)``, as the OCP
spec sets it, so the largest magnitude lands in [4, 8) and values past 6 saturate).
"""

from __future__ import annotations

import torch

GROUP = 32
E8M0_BIAS = 127
# the eight E2M1 magnitudes, indexed by the code's low three bits
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_EMAX_ELEM = 2  # the largest E2M1 exponent: 6 = 1.5 * 2**2


def _check(packed: torch.Tensor, scale: torch.Tensor) -> None:
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 tensors must be uint8, got weight_packed {packed.dtype} and weight_scale {scale.dtype}"
        )
    cols = packed.shape[-1] * 2
    if cols % GROUP or scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] != cols // GROUP:
        raise ValueError(
            f"MXFP4 shapes do not match: weight_packed {tuple(packed.shape)} holds {cols} columns, "
            f"so weight_scale must be {(*packed.shape[:-1], cols // GROUP)}, got {tuple(scale.shape)}"
        )


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``weight_packed [..., in/2]`` and ``weight_scale [..., in/32]`` -> ``W [..., in]`` in ``dtype``."""
    _check(packed, scale)
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)  # [..., in]; even element = low nibble
    table = torch.tensor(FP4_MAGNITUDES, dtype=torch.float32, device=packed.device)
    values = table[(codes & 0x7).long()]  # [..., in]
    values = torch.where((codes & 0x8).bool(), -values, values)
    exponent = scale.to(torch.int32) - E8M0_BIAS  # [..., in/32]
    factor = torch.exp2(exponent.to(torch.float32)).repeat_interleave(GROUP, dim=-1)  # [..., in]
    return (values * factor).to(dtype)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``W [..., in]`` (``in`` a multiple of 32) -> (``weight_packed`` uint8 ``[..., in/2]``,
    ``weight_scale`` uint8 ``[..., in/32]``)."""
    if weight.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 needs the last dimension to be a multiple of {GROUP}, got {tuple(weight.shape)}")
    w = weight.detach().to(torch.float32)
    groups = w.unflatten(-1, (-1, GROUP))  # [..., in/32, 32]
    amax = groups.abs().amax(dim=-1)  # [..., in/32]
    # floor(log2(amax)) exactly, from the float's exponent field (log2 rounds near powers of two)
    _, exp = torch.frexp(amax)
    shared = torch.where(
        amax > 0, exp.to(torch.int32) - 1 - _EMAX_ELEM, torch.full_like(exp, -E8M0_BIAS, dtype=torch.int32)
    )
    shared = shared.clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = groups / torch.exp2(shared.to(torch.float32)).unsqueeze(-1)  # [..., in/32, 32]
    magnitudes = torch.tensor(FP4_MAGNITUDES, dtype=torch.float32, device=w.device)
    mag = scaled.abs().clamp(max=FP4_MAGNITUDES[-1])
    # nearest magnitude; on a tie the even code (mantissa bit 0) wins
    dist = (mag.unsqueeze(-1) - magnitudes).abs()  # [..., in/32, 32, 8]
    best = dist.min(dim=-1, keepdim=True).values
    candidates = dist == best
    even = candidates & (torch.arange(8, device=w.device) % 2 == 0)
    code = torch.where(even.any(-1), even.int().argmax(-1), candidates.int().argmax(-1))  # [..., in/32, 32]
    code = code | ((scaled < 0) & (code > 0)).int() << 3
    code = code.flatten(-2).to(torch.uint8)  # [..., in]
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed, (shared + E8M0_BIAS).to(torch.uint8)
