"""Kimi Delta Attention (KDA), K3's linear-attention mixer (docs/k3.md §2).

Per layer: q/k/v projections -> short causal depthwise convolutions + SiLU -> heads -> L2-normalised
q and k -> per-channel decay gate (K3's lower-bound sigmoid form, or Kimi Linear's softplus form) and
write strength beta = sigmoid(b_proj x) -> gated delta rule (chunked for training and prefill, token by
token for decoding) -> per-head RMSNorm times sigmoid output gate -> o_proj.

The recurrent state is fixed-size ([H, K, V] per sequence), so decoding caches that state plus the last
``conv_size - 1`` inputs of each convolution. Parameter names and shapes follow the K3 reference
checkpoint (docs/k3.md §2.1), so a reference state dict loads without renaming.

Document segments (training windows of packed documents): the short convolutions add only inputs of the
token's own document, and the recurrent state restarts at every document start (the torch kernel resets
it at chunk boundaries, fla's kernels take the documents as variable-length sequences).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from components.config import ComponentConfig
from components.mixers.base import Mixer
from components.nn.build_context import NORM_EPS, BuildContext
from components.nn.matrix_layout import MatrixLayout
from components.nn.rmsnorm import rms_norm
from components.nn.segments import Segments
from components.ops.backend import allowed_backends, resolve
from components.ops.kda import L2NORM_EPS, chunk_kda, kda_gate, l2norm, recurrent_kda
from components.ops.short_conv_cpu import native_available as short_conv_native_available
from components.ops.short_conv_cpu import short_conv_silu_norm
from components.registry import MIXERS, ConfigError

A_LOG_INITS = ("auto", "zero", "log_uniform")
DT_BIAS_INITS = ("inverse_softplus", "zero")
# fla's KDA kernels take key heads up to this size (fla/ops/kda/chunk.py asserts K <= 256)
FLA_MAX_HEAD_DIM = 256
# fla's bounded-gate path (safe_gate) needs every step's log-decay in [FLA_SAFE_GATE_BOUND, 0)
FLA_SAFE_GATE_BOUND = -5.0
# windows of at least this many tokens (batch x time) run the input projections as one stacked product
FUSED_PROJECTION_MIN_ROWS = 256

log = logging.getLogger(__name__)
_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.warning(message)


@dataclass
class KDAConfig(ComponentConfig):
    name: str = "kda"
    n_heads: int = 4
    # key = value head size (K3: 128)
    head_dim: int = 32
    # depthwise causal convolution width (K3: 4)
    conv_size: int = 4
    # None: softplus gate -exp(A_log) * softplus(f + dt_bias) (Kimi Linear);
    # a number L < 0: L * sigmoid(exp(A_log) * (f + dt_bias)) (K3: -5)
    gate_lower_bound: Optional[float] = -5.0
    # output gate: one d -> H*V matrix (K3) or the low-rank pair d -> head_dim -> H*V (Kimi Linear)
    full_rank_gate: bool = True
    norm_eps: float = NORM_EPS
    # A_log at initialisation (sources disagree, docs/k3.md §9): zero (exp(A_log) = 1; fla's safe-gate
    # init, the K3 report as quoted), log_uniform (log U[1, 16]: the public constructors, Kimi Linear), or
    # auto (zero for the lower-bound gate, log_uniform for the softplus gate)
    a_log_init: str = "auto"
    # dt_bias at initialisation: inverse_softplus (fla: the inverse softplus of dt ~ exp(U[log 1e-3,
    # log 1e-1])) or zero
    dt_bias_init: str = "inverse_softplus"
    chunk_size: int = 64
    # torch: pure-PyTorch chunked kernel (any device); fla: fla-core Triton kernels (CUDA); auto
    backend: str = "auto"

    def kernel_backends(self) -> dict[str, str]:
        return {"backend": self.backend}

    def validate(self, model: Any, key: str) -> None:
        for field_name in ("n_heads", "head_dim", "conv_size", "chunk_size"):
            if getattr(self, field_name) <= 0:
                raise ConfigError(f"{key}.{field_name}", f"must be positive, got {getattr(self, field_name)}")
        if self.chunk_size < 16 or self.chunk_size & (self.chunk_size - 1):
            raise ConfigError(f"{key}.chunk_size", f"must be a power of two >= 16, got {self.chunk_size}")
        if self.gate_lower_bound is not None and not self.gate_lower_bound < 0:
            raise ConfigError(
                f"{key}.gate_lower_bound",
                f"must be negative (or null for the softplus gate), got {self.gate_lower_bound}",
            )
        if self.a_log_init not in A_LOG_INITS:
            raise ConfigError(
                f"{key}.a_log_init", f"'{self.a_log_init}' is not allowed; choose one of {', '.join(A_LOG_INITS)}"
            )
        if self.dt_bias_init not in DT_BIAS_INITS:
            raise ConfigError(
                f"{key}.dt_bias_init", f"'{self.dt_bias_init}' is not allowed; choose one of {', '.join(DT_BIAS_INITS)}"
            )
        if self.backend not in allowed_backends("kda"):
            raise ConfigError(
                f"{key}.backend", f"'{self.backend}' is not allowed; choose one of {', '.join(allowed_backends('kda'))}"
            )
        if self.backend == "fla" and self.gate_lower_bound is not None and self.gate_lower_bound < FLA_SAFE_GATE_BOUND:
            raise ConfigError(
                f"{key}.gate_lower_bound",
                f"fla's kernels need a bound in [{FLA_SAFE_GATE_BOUND:g}, 0), got {self.gate_lower_bound}",
            )
        if self.backend == "fla" and self.head_dim > FLA_MAX_HEAD_DIM:
            raise ConfigError(
                f"{key}.head_dim",
                f"{self.head_dim} is above fla's KDA limit of {FLA_MAX_HEAD_DIM} (fla/ops/kda/chunk.py: K <= "
                f"{FLA_MAX_HEAD_DIM}) for {key}.backend=fla; use a head_dim <= {FLA_MAX_HEAD_DIM} or "
                f"{key}.backend=torch or auto (auto runs such heads on the torch kernel)",
            )

    def fla_supports(self) -> Optional[str]:
        """None when fla's KDA kernels take this layer's shapes, else why not."""
        if self.head_dim > FLA_MAX_HEAD_DIM:
            return f"head_dim {self.head_dim} is above fla's KDA limit of {FLA_MAX_HEAD_DIM} (K <= {FLA_MAX_HEAD_DIM})"
        return None

    def fla_safe_gate(self) -> bool:
        """Whether the gate is bounded as fla's faster bounded-gate path (``safe_gate``) requires."""
        return self.gate_lower_bound is not None and self.gate_lower_bound >= FLA_SAFE_GATE_BOUND


def fla_kda_kernels():
    """fla's ``(chunk_kda, fused_recurrent_kda)``, the kernels ``backend=fla`` calls; the one place they
    are looked up, so a test can put functions of the same signatures in their place."""
    from fla.ops.kda import chunk_kda, fused_recurrent_kda  # GPU-only: fla needs triton

    return chunk_kda, fused_recurrent_kda


class KDACache:
    """Recurrent state ``S [B, H, K, V]`` (fp32) and the last ``W-1`` inputs of each convolution."""

    def __init__(self) -> None:
        self.state: Optional[torch.Tensor] = None
        self.conv_q: Optional[torch.Tensor] = None  # [B, W-1, H*K]
        self.conv_k: Optional[torch.Tensor] = None
        self.conv_v: Optional[torch.Tensor] = None


def causal_depthwise_conv(
    x: torch.Tensor, weight: torch.Tensor, prefix: Optional[torch.Tensor], segments: Optional[Segments] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU(causal depthwise conv) of ``x [B, T, P]`` with kernel ``[P, 1, W]``; returns (y, new prefix).

    ``prefix`` holds the previous ``W-1`` inputs (zeros at the start of a sequence); the returned
    prefix is the last ``W-1`` inputs including ``x``, i.e. the conv cache after these tokens.
    ``segments``: input t-s adds to output t only if it is in t's document (no prefix then).
    """
    B, T, P = x.shape
    W = weight.shape[-1]
    shifted_form = torch.compiler.is_compiling() or segments is not None
    # x behind its prefix, [B, W-1+T, P]: a full copy, made only where something reads it (conv1d, a cached
    # prefix, or a window shorter than the kernel); the shifted form pads a zero prefix per term instead
    xp = None
    if not shifted_form or prefix is not None or T < W:
        xp = torch.cat([x.new_zeros(B, W - 1, P) if prefix is None else prefix.to(x.dtype), x], dim=1)
    if shifted_form:
        y = shifted_depthwise_conv(x, weight, xp, segments)
    else:
        y = F.conv1d(xp.transpose(1, 2), weight.to(x.dtype), groups=P).transpose(1, 2)  # [B, T, P]
    new_prefix = x[:, T - (W - 1) :] if xp is None else xp[:, T:]  # the last W-1 inputs
    return F.silu(y), new_prefix


def shifted_depthwise_conv(
    x: torch.Tensor, weight: torch.Tensor, xp: Optional[torch.Tensor], segments: Optional[Segments] = None
) -> torch.Tensor:
    """The causal depthwise convolution of ``x [B, T, P]`` (kernel ``[P, 1, W]``, no SiLU) as ``W`` shifted
    multiply-adds: the form compiled layers use, and the one that can mask each shifted term at document
    boundaries. ``xp [B, W-1+T, P]`` is ``x`` behind its prefix (the cached inputs); None: a zero prefix,
    each shifted term then padded with zeros (T >= W; the padded shifts compile to one read each, where
    slices of a concatenation would be materialised first).

    Inductor fuses the taps with the SiLU and the projections around them (a convolution would stay an
    opaque library call, forward and backward). The taps are read as rows of a contiguous ``[W, P]``
    copy of the kernel, so the fused loops run vectorised over channels; read straight from ``[P, 1, W]``
    (stride W between channels) they compile to scalar loops, about 2x slower forward and backward.
    """
    T = x.shape[1]
    W = weight.shape[-1]
    taps = weight.to(x.dtype)[:, 0, :].t().contiguous()  # [W, P]: tap j weights x[t - (W-1-j)]
    y = None
    for j in range(W):
        s = W - 1 - j
        # [B, T, P]: x[t - s], the prefix (or zeros) before the window
        if s == 0:
            shifted = x
        else:
            shifted = xp[:, j : j + T] if xp is not None else F.pad(x[:, : T - s], (0, 0, s, 0))
            if segments is not None:
                shifted = shifted * segments.same_segment_as_shifted(s)  # [B, T, 1] mask: other documents add 0
        y = shifted * taps[j] if y is None else y + shifted * taps[j]
    return y


@MIXERS.register("kda", KDAConfig)
class KimiDeltaAttention(Mixer):
    """Kimi Delta Attention: gated delta-rule linear attention with a fixed-size state (K3)."""

    compile_friendly = (
        False  # the chunked kernel (its chunk size read from the data) is an eager island: compiled per layer
    )

    def __init__(
        self,
        cfg: KDAConfig,
        ctx: BuildContext,
    ):
        super().__init__(cfg, ctx)
        d_model, init_std, out_init_std = ctx.d_model, ctx.init_std, ctx.out_init_std
        H, K = cfg.n_heads, cfg.head_dim
        P = H * K
        self.n_heads, self.head_dim = H, K
        self.q_proj = nn.Linear(d_model, P, bias=False)
        self.k_proj = nn.Linear(d_model, P, bias=False)
        self.v_proj = nn.Linear(d_model, P, bias=False)
        self.q_conv1d = nn.Conv1d(P, P, cfg.conv_size, groups=P, bias=False)
        self.k_conv1d = nn.Conv1d(P, P, cfg.conv_size, groups=P, bias=False)
        self.v_conv1d = nn.Conv1d(P, P, cfg.conv_size, groups=P, bias=False)
        self.f_a_proj = nn.Linear(d_model, K, bias=False)
        self.f_b_proj = nn.Linear(K, P, bias=False)
        self.b_proj = nn.Linear(d_model, H, bias=False)
        if cfg.full_rank_gate:
            self.g_proj = nn.Linear(d_model, P, bias=False)
        else:
            self.g_a_proj = nn.Linear(d_model, K, bias=False)
            self.g_b_proj = nn.Linear(K, P, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(K))
        self.o_proj = nn.Linear(P, d_model, bias=False)
        # decay parameters stay fp32 and out of weight decay (no_weight_decay)
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(P, dtype=torch.float32))
        self.reset_parameters(init_std, out_init_std or init_std)
        # whether fla's kernels take these shapes, decided here once (a constant of every forward)
        unsupported = cfg.fla_supports()
        self.fla_applies = unsupported is None
        if unsupported is not None and cfg.backend == "auto":
            _log_once(f"kda: {unsupported}; mixer.backend=auto runs these layers on the torch kernel")

    def no_weight_decay(self) -> set[str]:
        return {"A_log", "dt_bias"}

    def muon_layouts(self) -> dict[str, MatrixLayout]:
        """Per-head blocks of the head-indexed projections; f_a_proj, g_a_proj and b_proj are shared by
        all heads and stay whole."""
        H = self.n_heads
        layouts = {f"{n}.weight": MatrixLayout(H, 0, qkv=True) for n in ("q_proj", "k_proj", "v_proj")}
        for n in ["f_b_proj"] + (["g_proj"] if self.cfg.full_rank_gate else ["g_b_proj"]):
            layouts[f"{n}.weight"] = MatrixLayout(H, 0)
        layouts["o_proj.weight"] = MatrixLayout(H, 1)
        return layouts

    def reset_parameters(self, init_std: float, out_init_std: float) -> None:
        for name, module in self.named_children():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=out_init_std if name == "o_proj" else init_std)
        # the conv kernels keep PyTorch's default (uniform, fan-in scaled) init: a usable local filter
        with torch.no_grad():
            if self.A_log.device.type == "meta":
                return
            a_log = self.cfg.a_log_init
            if a_log == "auto":  # exp(A_log) = 1 for the lower-bound gate, which is bounded already
                a_log = "log_uniform" if self.cfg.gate_lower_bound is None else "zero"
            if a_log == "log_uniform":
                self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
            else:
                self.A_log.zero_()
            if self.cfg.dt_bias_init == "zero":
                self.dt_bias.zero_()
            else:  # dt in [1e-3, 1e-1] (log-uniform), stored as its inverse softplus
                dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1))).clamp(min=1e-4)
                self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    # -- cache ------------------------------------------------------------------------------------
    def new_cache(self, batch_size: int) -> KDACache:
        return KDACache()

    def use_fla(self, x: torch.Tensor) -> bool:
        return resolve("kda", self.cfg.backend, x.device, applies=self.fla_applies) == "fla"

    # -- forward ----------------------------------------------------------------------------------
    def forward(
        self, x: torch.Tensor, state: Optional[KDACache] = None, offset: int = 0, segments: Optional[Segments] = None
    ) -> torch.Tensor:
        if segments is not None and state is not None:
            raise ValueError("kda: document segments are for whole windows, not for decoding from a cache")
        B, T, _ = x.shape
        H, K = self.n_heads, self.head_dim
        q_in, k_in, v_in, g_in, f_in, b_in = self._input_projections(x)
        q, k, v, cq, ck, cv = self._qkv((q_in, k_in, v_in), state, segments)
        f = self.f_b_proj(f_in).view(B, T, H, K)
        g = kda_gate(f, self.A_log, self.dt_bias, self.cfg.gate_lower_bound)  # [B, T, H, K] fp32, <= 0
        beta = torch.sigmoid(b_in.to(self._fp32_or_wider(x)))  # [B, T, H] fp32

        initial = state.state if state is not None else None
        want_state = state is not None
        if self.use_fla(x):
            o, final = self._fla_core(q, k, v, g, beta, initial, want_state, segments)
        else:
            # the core computes in fp32 itself; autocast would hand its in-place products bf16 operands
            with torch.autocast(device_type=x.device.type, enabled=False):
                if state is not None and T <= 8:
                    # a few decode steps: the plain recurrence is cheaper than setting up chunks
                    o, final = recurrent_kda(q, k, v, g, beta, initial_state=initial, output_final_state=True)
                else:
                    o, final = chunk_kda(
                        q,
                        k,
                        v,
                        g,
                        beta,
                        initial_state=initial,
                        output_final_state=want_state,
                        chunk_size=self.cfg.chunk_size,
                        segments=segments,
                    )
        if state is not None:
            state.state, state.conv_q, state.conv_k, state.conv_v = final, cq, ck, cv

        gate = g_in if self.cfg.full_rank_gate else self.g_b_proj(g_in)
        wide = self._fp32_or_wider(x)  # fp32 for bf16/fp32 models; fp64 stays exact
        o = rms_norm(o.to(wide), self.o_norm.weight.to(wide), self.cfg.norm_eps) * torch.sigmoid(
            gate.to(wide).view(B, T, H, K)
        )
        return self.o_proj(o.reshape(B, T, H * K).to(x.dtype))

    def _input_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x through every projection that reads the layer input: q, k, v ``[B, T, H*K]``, the output gate's
        (or its low-rank first half's), the forget gate's first half ``[B, T, K]`` and beta's ``[B, T, H]``.

        For windows of at least ``FUSED_PROJECTION_MIN_ROWS`` tokens they are one product with the weights
        stacked: one wide matrix product runs several times faster than six narrow ones on a CPU (and reads x
        once, forward and backward); the parameters stay separate (checkpoint names, per-head Muon). Decoding
        steps keep the separate products, where stacking the weights would cost more than the product."""
        linears = (
            self.q_proj,
            self.k_proj,
            self.v_proj,
            self.g_proj if self.cfg.full_rank_gate else self.g_a_proj,
            self.f_a_proj,
            self.b_proj,
        )
        if x.numel() // x.shape[-1] < FUSED_PROJECTION_MIN_ROWS:
            return tuple(linear(x) for linear in linears)
        weight = torch.cat([linear.weight for linear in linears])  # [sum of the widths, d]
        return F.linear(x, weight).split([linear.out_features for linear in linears], dim=-1)

    def _qkv(self, inputs: tuple[torch.Tensor, ...], state: Optional[KDACache], segments: Optional[Segments]):
        """q, k (L2-normalised per head) and v ``[B, T, H, K]`` from their projections ``inputs`` after the
        convolutions and SiLU, and the three conv caches after these tokens (None unless decoding from a cache)."""
        B, T, _ = inputs[0].shape
        H, K = self.n_heads, self.head_dim
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        if state is None and inputs[0].device.type == "cpu" and short_conv_native_available():
            # whole windows on the CPU: conv + SiLU (+ L2 norm) as one native op each (no conv cache to keep)
            ids = None if segments is None else segments.ids
            q, k, v = [
                short_conv_silu_norm(u, conv.weight, ids, head_dim, L2NORM_EPS).view(B, T, H, K)
                for u, conv, head_dim in zip(inputs, convs, (K, K, 0))
            ]
            return q, k, v, None, None, None
        prefixes = (state.conv_q, state.conv_k, state.conv_v) if state is not None else (None, None, None)
        (q, cq), (k, ck), (v, cv) = [
            causal_depthwise_conv(u, conv.weight, prefix, segments) for u, conv, prefix in zip(inputs, convs, prefixes)
        ]
        q = l2norm(q.view(B, T, H, K))  # [B, T, H, K]
        k = l2norm(k.view(B, T, H, K))  # [B, T, H, K]
        return q, k, v.view(B, T, H, K), cq, ck, cv

    @staticmethod
    def _fp32_or_wider(x: torch.Tensor) -> torch.dtype:
        return torch.promote_types(x.dtype, torch.float32)

    def _fla_core(self, q, k, v, g, beta, initial, want_state, segments=None):
        fla_chunk_kda, fused_recurrent_kda = fla_kda_kernels()
        # a gate bounded by >= -5 per step takes fla's bounded-gate path (safe_gate: 16-token diagonal blocks
        # on Tensor Cores), which fla documents for such gates; the same result as the general path
        safe_gate = self.cfg.fla_safe_gate()

        if segments is not None:
            # fla's variable-length form: the rows flattened to one sequence, cut at every document
            # and row start; each piece starts from a zero state
            B, T = q.shape[:2]
            flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]  # [1, B*T, ...]
            o, _ = fla_chunk_kda(*flat, cu_seqlens=segments.cu_seqlens(), safe_gate=safe_gate)
            return o.view(B, T, *o.shape[2:]), None

        if initial is not None and q.shape[1] == 1 and not torch.is_grad_enabled():
            return fused_recurrent_kda(q, k, v, g, beta, initial_state=initial, output_final_state=want_state)
        return fla_chunk_kda(
            q, k, v, g, beta, initial_state=initial, output_final_state=want_state, safe_gate=safe_gate
        )

    # -- accounting -------------------------------------------------------------------------------
    def flops_per_token(self, seq_len: int) -> float:
        # the chunked algorithm's multiply-adds per token and head (causal halves of C x C products):
        # q k^T and (beta k) k^T over K (C K), their UT solve (C^2 / 6), the chunk's w over K and u over V
        # (C K / 2 + C V / 2), the intra-chunk output over V (C V / 2), and the state's read by q and w and
        # its update (3 K V)
        C = min(self.cfg.chunk_size, max(seq_len, 1))
        K = V = self.head_dim
        per_head = 2 * (C * (3 * K / 2 + V) + C * C / 6 + 3 * K * V)
        return self.n_heads * per_head

    def cache_numbers_per_token(self) -> int:
        return 0  # the state does not grow with the sequence

    def recurrent_state_numbers(self) -> int:
        """Numbers of the recurrent state S [H, K, V] held per sequence."""
        return self.n_heads * self.head_dim * self.head_dim

    def state_numbers(self) -> int:
        """Numbers held per sequence: the recurrent state plus the three conv caches."""
        P = self.n_heads * self.head_dim
        return self.recurrent_state_numbers() + 3 * P * (self.cfg.conv_size - 1)
