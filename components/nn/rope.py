"""Rotary position embedding (rotate-half pairing: dimension i is paired with i + d/2)."""

from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[T, dim]`` for integer positions ``[T]``, computed in fp32."""
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim)  # [dim/2]
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, dim/2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, dim]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, H, T, dim]`` by position; tables ``[T, dim]``. Math in fp32."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    half = x32.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos.to(x32.dtype) + rotated * sin.to(x32.dtype)).to(x.dtype)
