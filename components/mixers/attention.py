"""Softmax attention with ``n_kv_heads`` key/value heads: MHA (= n_heads), GQA (between), MQA (= 1).

One implementation, three registry names so that ``mixer=mqa`` reads naturally; RoPE or NoPE; causal
attention (``attention_kernel``: SDPA, or bf16 products with an fp32 softmax on the CPU; components/ops/attention.py);
a K/V cache for incremental decoding. With document segments the
causal mask is also block-diagonal over documents (RoPE is relative: positions need not restart).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from components.config import ComponentConfig
from components.mixers.base import Mixer
from components.nn.build_context import BuildContext
from components.nn.matrix_layout import MatrixLayout
from components.nn.rope import apply_rope, rope_cos_sin
from components.nn.segments import Segments
from components.ops.attention import ATTENTION_KERNELS, causal_attention
from components.registry import MIXERS, ConfigError


def check_attention_kernel(kernel: str, key: str) -> None:
    """ConfigError naming ``{key}.attention_kernel`` unless ``kernel`` is one of ``ATTENTION_KERNELS``."""
    if kernel not in ATTENTION_KERNELS:
        allowed = ", ".join(ATTENTION_KERNELS)
        raise ConfigError(f"{key}.attention_kernel", f"'{kernel}' is not allowed; choose one of {allowed}")


@dataclass
class AttentionConfig(ComponentConfig):
    name: str = "gqa"
    n_heads: int = 4
    # None: n_heads for mha, 1 for mqa; required for gqa
    n_kv_heads: Optional[int] = None
    # None: d_model // n_heads
    head_dim: Optional[int] = None
    rope: bool = True
    rope_theta: float = 10000.0
    # softmax attention's kernel (components/ops/attention.py): auto, sdpa or matmul
    attention_kernel: str = "auto"

    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.default_kv_heads()

    def default_kv_heads(self) -> int:
        """K/V heads when ``n_kv_heads`` is unset; each variant states its own rule."""
        return self.n_heads

    def check_kv_heads(self, kv: int, key: str) -> None:
        """Refuse a K/V head count the variant does not allow (GQA: any divisor of ``n_heads``)."""
        if self.n_kv_heads is None:
            raise ConfigError(f"{key}.n_kv_heads", f"{self.name} needs n_kv_heads")

    def head_size(self, d_model: int) -> int:
        return self.head_dim if self.head_dim is not None else d_model // self.n_heads

    def validate(self, model: Any, key: str) -> None:
        d_model = model.d_model
        if self.n_heads <= 0:
            raise ConfigError(f"{key}.n_heads", f"must be positive, got {self.n_heads}")
        if self.head_dim is None and d_model % self.n_heads:
            raise ConfigError(
                f"{key}.n_heads",
                f"model.d_model={d_model} is not divisible by {key}.n_heads={self.n_heads} (or set {key}.head_dim)",
            )
        head_dim = self.head_size(d_model)
        if head_dim <= 0:
            raise ConfigError(f"{key}.head_dim", f"must be positive, got {head_dim}")
        if self.rope and head_dim % 2:
            raise ConfigError(
                f"{key}.head_dim", f"RoPE needs an even head_dim, got {head_dim} (or set {key}.rope=false)"
            )
        kv = self.kv_heads()
        if kv <= 0 or self.n_heads % kv:
            raise ConfigError(
                f"{key}.n_kv_heads", f"{key}.n_heads={self.n_heads} is not divisible by {key}.n_kv_heads={kv}"
            )
        self.check_kv_heads(kv, key)
        if self.rope_theta <= 0:
            raise ConfigError(f"{key}.rope_theta", f"must be positive, got {self.rope_theta}")
        check_attention_kernel(self.attention_kernel, key)


@dataclass
class MHAConfig(AttentionConfig):
    name: str = "mha"

    def check_kv_heads(self, kv: int, key: str) -> None:
        if kv != self.n_heads:
            raise ConfigError(
                f"{key}.n_kv_heads",
                f"mha uses n_kv_heads = n_heads = {self.n_heads}, got {kv}; use mixer=gqa for fewer K/V heads",
            )


@dataclass
class GQAConfig(AttentionConfig):
    name: str = "gqa"
    n_kv_heads: Optional[int] = 2


@dataclass
class MQAConfig(AttentionConfig):
    name: str = "mqa"

    def default_kv_heads(self) -> int:
        return 1

    def check_kv_heads(self, kv: int, key: str) -> None:
        if kv != 1:
            raise ConfigError(f"{key}.n_kv_heads", f"mqa uses one K/V head, got {kv}; use mixer=gqa for more")


class KVCache:
    """Keys and values of all processed tokens: ``[B, H_kv, S, head_dim]`` each."""

    def __init__(self) -> None:
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


class Attention(Mixer):
    """Causal multi-head attention with grouped K/V heads (MHA / GQA / MQA)."""

    def __init__(
        self,
        cfg: AttentionConfig,
        ctx: BuildContext,
    ):
        super().__init__(cfg, ctx)
        d_model, init_std, out_init_std = ctx.d_model, ctx.init_std, ctx.out_init_std
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads()
        self.head_dim = cfg.head_size(d_model)
        self.q_proj = nn.Linear(d_model, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d_model, bias=False)
        for lin in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.normal_(lin.weight, std=init_std)
        nn.init.normal_(self.o_proj.weight, std=out_init_std or init_std)

    def muon_layouts(self) -> dict[str, MatrixLayout]:
        """Per-head blocks: rows of the input projections, columns of the output projection."""
        return {
            "q_proj.weight": MatrixLayout(self.n_heads, 0, qkv=True),
            "k_proj.weight": MatrixLayout(self.n_kv_heads, 0, qkv=True),
            "v_proj.weight": MatrixLayout(self.n_kv_heads, 0, qkv=True),
            "o_proj.weight": MatrixLayout(self.n_heads, 1),
        }

    def new_cache(self, batch_size: int) -> KVCache:
        return KVCache()

    def forward(
        self, x: torch.Tensor, state: Optional[KVCache] = None, offset: int = 0, segments: Optional[Segments] = None
    ) -> torch.Tensor:
        if segments is not None and state is not None:
            raise ValueError("attention: document segments are for whole windows, not for decoding from a cache")
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        if self.cfg.rope:
            positions = torch.arange(offset, offset + T, device=x.device)
            cos, sin = rope_cos_sin(positions, self.head_dim, self.cfg.rope_theta)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if state is not None:
            k, v = state.append(k, v)  # [B, Hkv, S, D], S = past + T
        if self.n_kv_heads != self.n_heads:
            # enable_gqa is not implemented by every SDPA backend; repeating K/V is exact and cheap here
            rep = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        doc_mask = segments.attention_mask() if segments is not None else None  # [B, 1, T, T]: causal, same document
        o = causal_attention(q, k, v, doc_mask=doc_mask, kernel=self.cfg.attention_kernel)  # [B, H, T, D]
        o = o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # [B, T, H*D]
        return self.o_proj(o)

    def flops_per_token(self, seq_len: int) -> float:
        # scores and weighted sum: 2 * H * D multiply-adds per (query, key) pair; a causal query sees
        # (seq_len + 1) / 2 keys on average
        return 2.0 * 2 * self.n_heads * self.head_dim * (seq_len + 1) / 2

    def cache_numbers_per_token(self) -> int:
        return 2 * self.n_kv_heads * self.head_dim


MIXERS.register("mha", MHAConfig, "Multi-head softmax attention (one K/V head per query head), RoPE or NoPE.")(
    Attention
)
MIXERS.register("gqa", GQAConfig, "Grouped-query attention: `n_kv_heads` K/V heads shared by groups of query heads.")(
    Attention
)
MIXERS.register("mqa", MQAConfig, "Multi-query attention: one K/V head shared by all query heads.")(Attention)

__all__ = ["Attention", "AttentionConfig", "MHAConfig", "GQAConfig", "MQAConfig", "KVCache"]
