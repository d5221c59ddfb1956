"""The AttnRes depth read as one native CPU op, forward and backward (``attnres_cpu.cpp``), built on first use.

Compiled, the PyTorch read (``components.ops.attnres._read_torch``) is a few fused loops per read, each a pass
over every source: norms and scores, the softmax, the mix, and as many again backward, whose gradients reduce
over the tokens. The native op reads a token's sources into cache once per pass and does the whole read
there, in fp32 (fp64 for fp64 sources) rounded once; the backward recomputes the scores from the sources, so
nothing but the sources is saved. It is a PyTorch operator with a fake-tensor rule and an autograd formula:
compiled layers keep it inside their graphs. ``attnres_read`` uses it on the CPU where it applies.
"""

from __future__ import annotations

from pathlib import Path

import torch

from components.nn.eager_island import compile_constant
from components.ops.native_build import build_cpu_extension

__all__ = ["native_available", "attnres_read_native"]

_SOURCE = Path(__file__).with_name("attnres_cpu.cpp")
# set K3_ATTNRES_CPU_KERNEL=0 to run the PyTorch read everywhere (comparisons, debugging)
_ENV = "K3_ATTNRES_CPU_KERNEL"


def _register() -> None:
    """Fake-tensor rules (shapes for tracing) and the autograd formula of the C++ ops."""
    lib = "k3_attnres_cpu"

    @torch.library.register_fake(f"{lib}::forward")
    def _(sources, qw, eps, norm_weight, norm_eps):
        return torch.empty_like(sources[0], dtype=qw.dtype if norm_weight is not None else sources[0].dtype)

    @torch.library.register_fake(f"{lib}::backward")
    def _(sources, qw, dout, eps, norm_weight, norm_eps):
        dnorm = torch.empty_like(qw) if norm_weight is not None else qw.new_empty(0)
        return [torch.empty_like(u) for u in sources], torch.empty_like(qw), dnorm

    def setup_context(ctx, inputs, output):
        sources, qw, eps, norm_weight, norm_eps = inputs
        ctx.save_for_backward(qw, norm_weight, *sources)
        ctx.eps, ctx.norm_eps = eps, norm_eps

    def backward(ctx, dout):
        qw, norm_weight, *sources = ctx.saved_tensors
        dsources, dqw, dnorm = torch.ops.k3_attnres_cpu.backward(
            sources, qw, dout.contiguous(), ctx.eps, norm_weight, ctx.norm_eps
        )
        return dsources, dqw, None, (dnorm if norm_weight is not None else None), None

    torch.library.register_autograd(f"{lib}::forward", backward, setup_context=setup_context)


@compile_constant
def native_available() -> bool:
    """Whether the native op is (or can be) loaded: built on the first call, then cached. A constant to
    TorchDynamo (the build never enters a graph)."""
    return build_cpu_extension(_SOURCE, _ENV, on_load=_register)


def attnres_read_native(
    sources: list[torch.Tensor],
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    out_norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """One AttnRes read (``components.ops.attnres.attnres_read``'s contract, without the weights) of S sources
    ``[..., d]`` (one shape and dtype: bf16, fp32 or fp64) against ``query [d]`` and the key-norm gain
    ``norm_weight [d]``; ``[..., d]`` in the sources' dtype. CPU only; needs ``native_available()``.

    ``out_norm = (gain [d], eps)``: the RMSNorm that follows the read (``components.nn.rmsnorm.rms_norm``, its
    gain in the compute dtype) in the same op, returning ``rms_norm(read, gain, eps)`` in the compute dtype.
    Its backward recomputes the read from the sources, so nothing of the read is kept for the norm."""
    first = sources[0]
    d = first.shape[-1]
    compute = torch.promote_types(first.dtype, torch.float32)
    qw = (query.to(compute) * norm_weight.to(compute)).contiguous()  # [d]: the gain folds into the query
    flat = [u.reshape(-1, d).contiguous() for u in sources]  # S x [N, d]
    gain, gain_eps = (None, 0.0) if out_norm is None else (out_norm[0].contiguous(), out_norm[1])
    return torch.ops.k3_attnres_cpu.forward(flat, qw, eps, gain, gain_eps).view(first.shape)
