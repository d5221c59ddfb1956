"""MHA / GQA / MQA against a plain per-head transcription of softmax attention with RoPE (docs/k3.md §3.1)."""

from __future__ import annotations

import math

import pytest
import torch

from components.mixers.attention import Attention, GQAConfig, MHAConfig, MQAConfig
from components.nn.build_context import BuildContext


def reference(m: Attention, x: torch.Tensor) -> torch.Tensor:
    B, T, d = x.shape
    H, Hkv, D = m.n_heads, m.n_kv_heads, m.head_dim
    q = (x @ m.q_proj.weight.T).view(B, T, H, D)
    k = (x @ m.k_proj.weight.T).view(B, T, Hkv, D)
    v = (x @ m.v_proj.weight.T).view(B, T, Hkv, D)
    if m.cfg.rope:
        # rotate-half pairing: (i, i + D/2) rotated by position * theta^(-2i/D)
        pos = torch.arange(T, dtype=torch.float64)
        freqs = m.cfg.rope_theta ** (-torch.arange(0, D // 2, dtype=torch.float64) * 2 / D)
        ang = pos[:, None] * freqs[None]  # [T, D/2]
        cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]

        def rot(z):
            a, b = z[..., : D // 2], z[..., D // 2 :]
            return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)

        q, k = rot(q), rot(k)
    out = torch.zeros(B, T, H, D, dtype=x.dtype)
    for h in range(H):
        j = h * Hkv // H  # the K/V head of query head h
        scores = torch.einsum("btd,bsd->bts", q[:, :, h], k[:, :, j]) / math.sqrt(D)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        out[:, :, h] = torch.einsum("bts,bsd->btd", scores.softmax(-1), v[:, :, j])
    return out.reshape(B, T, H * D) @ m.o_proj.weight.T


@pytest.mark.parametrize(
    "cfg",
    [
        MHAConfig(n_heads=4),
        GQAConfig(n_heads=4, n_kv_heads=2),
        MQAConfig(n_heads=4),
        GQAConfig(n_heads=6, n_kv_heads=3, rope=False),
    ],
)
def test_matches_reference(cfg):
    torch.manual_seed(0)
    m = Attention(cfg, BuildContext(48)).double()
    x = torch.randn(2, 13, 48, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(m(x), reference(m, x), rtol=1e-10, atol=1e-10)
