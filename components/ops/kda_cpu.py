"""Chunked KDA as one native CPU kernel per (batch, head) pair (``kda_cpu.cpp``), built on first use.

The batched PyTorch form (``components.ops.kda._ChunkKDA``) runs every step of the chunked algorithm as one
op over all chunks at once: each op reads and writes ``[chunks x batch x heads, C, C or K]`` fp32 tensors
from memory, and at training sizes the kernel is bound by that traffic. The native kernel walks one
(batch, head) pair at a time through its chunks with the chunk's buffers in cache (the small products go to
the BLAS libtorch links), reads q/k/v in their own dtype and layout and writes the output straight back in
it: no chunk-layout copies. Its backward keeps only the state entering each chunk and recomputes the rest
of the chunk, so it saves ``(chunks + 1) x K x V`` numbers per pair instead of a dozen chunk-sized tensors.

Same contract and result as ``chunk_kda`` (round-off apart); ``chunk_kda`` uses it on the CPU where it
applies (``components.ops.kda._native_chunk`` decides, chunk size included) and the batched form elsewhere.
The kernel is compiled with the C++ compiler TorchInductor uses, once per machine (PyTorch's extension
cache); when it cannot be built the batched form runs and the reason is logged once.
"""

from __future__ import annotations

from pathlib import Path

import torch

from components.ops.native_build import build_cpu_extension

__all__ = ["native_available", "native_chunk_kda", "max_chunk_span"]

_SOURCE = Path(__file__).with_name("kda_cpu.cpp")
# set K3_KDA_CPU_KERNEL=0 to run the batched PyTorch form everywhere (comparisons, debugging)
_ENV = "K3_KDA_CPU_KERNEL"


def native_available() -> bool:
    """Whether the native kernel is (or can be) loaded: built on the first call, then cached."""
    return build_cpu_extension(_SOURCE, _ENV)


def max_chunk_span(g: torch.Tensor, chunk: int) -> float:
    """The largest total log-decay ``-sum(g)`` over any ``chunk`` consecutive tokens of a chunking of ``g``
    ``[B, T, H, K]`` (one pass, in the native kernel)."""
    return torch.ops.k3_kda_cpu.max_chunk_span(g.contiguous(), chunk)


class _NativeChunkKDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, chunk, keep):
        o, states = torch.ops.k3_kda_cpu.forward(q, k, v, g, beta, initial_state, keep, scale, chunk)
        ctx.save_for_backward(q, k, v, g, beta, states)
        ctx.keep, ctx.scale, ctx.chunk = keep, scale, chunk
        ctx.has_init = initial_state is not None
        ctx.init_dtype = None if initial_state is None else initial_state.dtype
        ctx.set_materialize_grads(False)  # an unused output's grad stays None instead of zeros
        return o, states

    @staticmethod
    def backward(ctx, do, dstates):
        q, k, v, g, beta, states = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(v)
        # only the final state, states[:, :, -1], leaves the function; its grad arrives through states
        dfinal = None if dstates is None else dstates[:, :, -1].contiguous()
        dq, dk, dv, dg, dbeta, dinit = torch.ops.k3_kda_cpu.backward(
            q, k, v, g, beta, ctx.keep, states, do.contiguous(), dfinal, ctx.has_init, ctx.scale, ctx.chunk
        )
        return dq, dk, dv, dg, dbeta, (dinit.to(ctx.init_dtype) if ctx.has_init else None), None, None, None


def native_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    chunk: int,
    initial_state: torch.Tensor | None = None,
    resets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [B, T, H, V] in q/k/v's dtype, final state [B, H, K, V] in the compute dtype)`` of chunked KDA
    on the native kernel. q, k, v share one dtype (bf16, fp32 or fp64) and their head count; g and beta
    are in the compute dtype (fp32, or fp64); ``chunk`` must keep every chunk's log-decay span within what
    a midpoint factorisation takes (``max_chunk_span``: 80 in fp32). ``resets [B, T]``: True at chunk
    starts where a document starts."""
    keep = None
    if resets is not None:
        keep = (~resets[:, ::chunk]).to(g.dtype).contiguous()  # [B, N]
    init = None if initial_state is None else initial_state.to(g.dtype).contiguous()
    o, states = _NativeChunkKDA.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), init, scale, chunk, keep
    )
    return o, states[:, :, -1]  # states: [B, H, chunks + 1, K, V], the last one final
