"""Multi-head latent attention (MLA) as K3 uses it: q-LoRA, a shared latent + a shared key part, output gate.

K3 (docs/k3.md §3.2-3.5): keys and values of all heads come from one normalised latent ``c`` (``kv_lora_rank``)
through ``kv_b_proj``; every head also sees one shared ``qk_rope_head_dim`` key part ``k^r`` that K3 does
*not* rotate (NoPE, bypass kept; ``rope: true`` gives DeepSeek-style RoPE on that part). The head outputs
are multiplied by ``sigmoid(g_proj(x))`` before ``o_proj`` (``output_gate``).

Two computation orders give the same result:
* expanded (training, prefill): build per-head K ``[U^K c || k^r]`` and V ``U^V c``, causal softmax attention;
* absorbed (decoding): ``q_hat = U^K^T q^c`` scores against the cached latent, aggregation stays in latent
  space, ``U^V`` is applied afterwards. The cache holds only ``c`` and ``k^r``: ``kv_lora + rope`` numbers
  per token and layer.

With document segments both orders mask the scores to the query's own document as well.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from components.config import ComponentConfig
from components.mixers.attention import check_attention_kernel
from components.mixers.base import Mixer
from components.nn.build_context import BuildContext
from components.nn.matrix_layout import MatrixLayout
from components.nn.rmsnorm import RMSNorm
from components.nn.rope import apply_rope, rope_cos_sin
from components.nn.segments import Segments
from components.ops.attention import causal_attention, causal_mask
from components.registry import MIXERS, ConfigError

ORDERS = ("expanded", "absorbed")


@dataclass
class MLAConfig(ComponentConfig):
    name: str = "mla"
    n_heads: int = 4
    # None: one q_proj [H*(nope+rope), d] (Kimi Linear 48B); K3 uses q-LoRA (1536)
    q_lora_rank: Optional[int] = 64
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    # the key part shared by all heads (K3: 64, not rotated)
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    # False: NoPE on the shared part (K3); True: rotate-half RoPE on it (DeepSeek style)
    rope: bool = False
    rope_theta: float = 10000.0
    # K3: sigmoid gate on the concatenated head outputs before o_proj
    output_gate: bool = True
    # eps of q_a_layernorm / kv_a_layernorm (K3 builds them without the model's eps)
    lora_norm_eps: float = 1e-6
    # decode from the cache in the absorbed order (expanded otherwise)
    absorbed_decode: bool = True
    # the expanded order's softmax attention kernel (components/ops/attention.py): auto, sdpa or matmul
    attention_kernel: str = "auto"

    def validate(self, model: Any, key: str) -> None:
        positive = {
            "n_heads": self.n_heads,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
        }
        if self.q_lora_rank is not None:
            positive["q_lora_rank"] = self.q_lora_rank
        for field, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{key}.{field}", f"must be positive, got {value}")
        if self.rope and self.qk_rope_head_dim % 2:
            raise ConfigError(
                f"{key}.qk_rope_head_dim",
                f"RoPE needs an even qk_rope_head_dim, got {self.qk_rope_head_dim} (or set {key}.rope=false)",
            )
        if self.rope_theta <= 0:
            raise ConfigError(f"{key}.rope_theta", f"must be positive, got {self.rope_theta}")
        if self.lora_norm_eps <= 0:
            raise ConfigError(f"{key}.lora_norm_eps", f"must be positive, got {self.lora_norm_eps}")
        check_attention_kernel(self.attention_kernel, key)


class MLACache:
    """The normalised latent ``c`` ``[B, S, kv_lora]`` and the shared key part ``k^r`` ``[B, S, rope]``
    (after RoPE when it is on) of all processed tokens; nothing else."""

    def __init__(self) -> None:
        self.c: Optional[torch.Tensor] = None
        self.kr: Optional[torch.Tensor] = None

    def append(self, c: torch.Tensor, kr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.c = c if self.c is None else torch.cat([self.c, c], dim=1)
        self.kr = kr if self.kr is None else torch.cat([self.kr, kr], dim=1)
        return self.c, self.kr

    @property
    def seq_len(self) -> int:
        return 0 if self.c is None else self.c.shape[1]


class MLA(Mixer):
    """Multi-head latent attention (K3 / DeepSeek MLA) with a latent-only cache and absorbed decoding."""

    def __init__(
        self,
        cfg: MLAConfig,
        ctx: BuildContext,
    ):
        super().__init__(cfg, ctx)
        d_model, init_std, out_init_std = ctx.d_model, ctx.init_std, ctx.out_init_std
        self.n_heads = H = cfg.n_heads
        self.kv_lora_rank = r = cfg.kv_lora_rank
        self.nope_dim = cfg.qk_nope_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.v_head_dim = cfg.v_head_dim
        self.scale = 1.0 / math.sqrt(self.qk_head_dim)
        # parameter names and [out, in] shapes follow the K3 reference (docs/k3.md §3.2)
        if cfg.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(d_model, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.lora_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * self.qk_head_dim, bias=False)
            in_projs = [self.q_a_proj, self.q_b_proj]
        else:
            self.q_proj = nn.Linear(d_model, H * self.qk_head_dim, bias=False)
            in_projs = [self.q_proj]
        self.kv_a_proj_with_mqa = nn.Linear(d_model, r + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(r, cfg.lora_norm_eps)
        # per head h: rows [h*(nope+v), h*(nope+v)+nope) = U^K_h, the next v rows = U^V_h
        self.kv_b_proj = nn.Linear(r, H * (self.nope_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_head_dim, d_model, bias=False)
        in_projs += [self.kv_a_proj_with_mqa, self.kv_b_proj]
        if cfg.output_gate:
            self.g_proj = nn.Linear(d_model, H * self.v_head_dim, bias=False)
            in_projs.append(self.g_proj)
        for lin in in_projs:
            nn.init.normal_(lin.weight, std=init_std)
        nn.init.normal_(self.o_proj.weight, std=out_init_std or init_std)

    def muon_layouts(self) -> dict[str, MatrixLayout]:
        """Per-head blocks; head h of kv_b_proj is its U^K_h and U^V_h rows together. The down-projections
        (q_a_proj, kv_a_proj_with_mqa) are shared by all heads and stay whole."""
        H = self.n_heads
        layouts = {"kv_b_proj.weight": MatrixLayout(H, 0, qkv=True), "o_proj.weight": MatrixLayout(H, 1)}
        layouts["q_b_proj.weight" if self.cfg.q_lora_rank is not None else "q_proj.weight"] = MatrixLayout(
            H, 0, qkv=True
        )
        if self.cfg.output_gate:
            layouts["g_proj.weight"] = MatrixLayout(H, 0)
        return layouts

    # -- cache and accounting ---------------------------------------------------------------------
    def new_cache(self, batch_size: int) -> MLACache:
        return MLACache()

    def cache_numbers_per_token(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def prefill_macs_per_key(self) -> int:
        """Multiply-adds per (query, key) pair in the expanded order: QK over d_qk, AV over d_v."""
        return self.n_heads * (self.qk_head_dim + self.v_head_dim)

    def decode_macs_per_key(self) -> int:
        """Multiply-adds per (query, cached key) pair in the absorbed order: QK over kv_lora + rope,
        AV over kv_lora (an MQA with (kv_lora + rope)-d keys and kv_lora-d values)."""
        return self.n_heads * (self.kv_lora_rank + self.rope_dim + self.kv_lora_rank)

    def decode_macs(self) -> dict[str, int]:
        return {
            "prefill_macs_per_cached_position": self.prefill_macs_per_key(),
            "decode_macs_per_cached_position": self.decode_macs_per_key(),
        }

    def flops_per_token(self, seq_len: int) -> float:
        # expanded order (training); a causal query sees (seq_len + 1) / 2 keys on average
        return 2.0 * self.prefill_macs_per_key() * (seq_len + 1) / 2

    # -- weights viewed per head ------------------------------------------------------------------
    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``U^K`` ``[H, nope, kv_lora]`` and ``U^V`` ``[H, v, kv_lora]`` (views of ``kv_b_proj``)."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    # -- forward ----------------------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        state: Optional[MLACache] = None,
        offset: int = 0,
        segments: Optional[Segments] = None,
        order: Optional[str] = None,
    ) -> torch.Tensor:
        """``x`` ``[B, T, d]`` -> ``[B, T, d]``. ``order`` forces "expanded" or "absorbed"; None: absorbed
        when decoding from a cache (if ``absorbed_decode``), expanded otherwise. ``segments``: attend
        within each document only (not with a cache)."""
        if segments is not None and state is not None:
            raise ValueError("mla: document segments are for whole windows, not for decoding from a cache")
        if order is None:
            order = "absorbed" if state is not None and self.cfg.absorbed_decode else "expanded"
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS} or None, got {order!r}")
        B, T, _ = x.shape
        H = self.n_heads
        if self.cfg.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # [B, T, H*d_qk]
        else:
            q = self.q_proj(x)
        q = q.view(B, T, H, self.qk_head_dim).transpose(1, 2)  # [B, H, T, d_qk]
        qc, qr = q.split([self.nope_dim, self.rope_dim], dim=-1)  # [B, H, T, nope], [B, H, T, rope]
        ckv = self.kv_a_proj_with_mqa(x)  # [B, T, kv_lora + rope]
        c_new, kr_new = ckv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c_new = self.kv_a_layernorm(c_new)  # [B, T, kv_lora]; k^r is not normalised
        if self.cfg.rope:
            positions = torch.arange(offset, offset + T, device=x.device)
            cos, sin = rope_cos_sin(positions, self.rope_dim, self.cfg.rope_theta)  # [T, rope]
            qr, kr_new = apply_rope(qr, cos, sin), apply_rope(kr_new, cos, sin)
        if state is not None:
            c, kr = state.append(c_new, kr_new)  # [B, S, kv_lora], [B, S, rope]; S = past + T
        else:
            c, kr = c_new, kr_new
        mask = segments.attention_mask() if segments is not None else None  # [B, 1, T, T]
        if order == "expanded":
            o = self._expanded(qc, qr, c, kr, mask)
        else:
            o = self._absorbed(qc, qr, c, kr, mask)
        o = o.transpose(1, 2).reshape(B, T, H * self.v_head_dim)  # [B, T, H*v]
        if self.cfg.output_gate:
            # elementwise and input dependent: this is why U^V cannot be folded into o_proj
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    def _expanded(
        self,
        qc: torch.Tensor,
        qr: torch.Tensor,
        c: torch.Tensor,
        kr: torch.Tensor,
        doc_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Per-head K/V from the latent, causal attention (``doc_mask [B, 1, T, T]``: causal and same
        document, instead). Returns ``[B, H, T, v]``."""
        B, H, T, _ = qc.shape
        S = c.shape[1]
        kv = self.kv_b_proj(c).view(B, S, H, self.nope_dim + self.v_head_dim).transpose(1, 2)  # [B, H, S, nope+v]
        kc, v = kv.split([self.nope_dim, self.v_head_dim], dim=-1)  # [B, H, S, nope], [B, H, S, v]
        k = torch.cat([kc, kr[:, None].expand(B, H, S, self.rope_dim)], dim=-1)  # [B, H, S, d_qk]
        q = torch.cat([qc, qr], dim=-1)  # [B, H, T, d_qk]
        # a value head dim different from d_qk needs no padding
        return causal_attention(q, k, v, scale=self.scale, doc_mask=doc_mask, kernel=self.cfg.attention_kernel)

    def _absorbed(
        self,
        qc: torch.Tensor,
        qr: torch.Tensor,
        c: torch.Tensor,
        kr: torch.Tensor,
        doc_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Scores and aggregation in latent space (docs/k3.md §3.3); ``doc_mask`` as in ``_expanded``.
        Returns ``[B, H, T, v]``."""
        T, S = qc.shape[2], c.shape[1]
        uk, uv = self.up_projections()  # [H, nope, kv_lora], [H, v, kv_lora]
        q_hat = torch.einsum("bhtn,hnr->bhtr", qc, uk)  # [B, H, T, kv_lora]: U^K absorbed into the query
        logits = torch.einsum("bhtr,bsr->bhts", q_hat, c) + torch.einsum("bhtd,bsd->bhts", qr, kr)  # [B, H, T, S]
        # softmax in (at least) fp32, as the K3 eager reference does
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) * self.scale
        if doc_mask is not None:
            logits = logits.masked_fill(~doc_mask, float("-inf"))
        elif T > 1:
            logits = logits.masked_fill(~causal_mask(T, S, logits.device), float("-inf"))
        probs = torch.softmax(logits, dim=-1).to(c.dtype)
        o_lat = torch.einsum("bhts,bsr->bhtr", probs, c)  # [B, H, T, kv_lora]: aggregate the latent
        return torch.einsum("bhtr,hvr->bhtv", o_lat, uv)  # [B, H, T, v]: U^V after the aggregation


MIXERS.register("mla", MLAConfig)(MLA)

__all__ = ["MLA", "MLAConfig", "MLACache"]
