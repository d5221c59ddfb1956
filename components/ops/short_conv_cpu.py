"""KDA's q/k/v prologue (short causal depthwise convolution, SiLU, per-head L2 norm) as one native CPU op,
forward and backward (``short_conv_cpu.cpp``), built on first use.

Compiled, the same prologue is a handful of fused Inductor loops whose backward reduces the convolution
taps' gradients column by column over every token (poorly parallel), and it writes the conv output, its SiLU
and the normalised result to memory between them: about as much step time as KDA's chunked core. The native
op makes one pass over the tokens forward and one backward, computes in fp32 (fp64 for fp64 inputs) and
rounds once, and sums the taps' gradient per tile of tokens. It is a PyTorch operator with a fake-tensor rule and
an autograd formula, so compiled layers keep it inside their graphs (no graph break).

``components.mixers.kda.causal_depthwise_conv`` followed by ``components.ops.kda.l2norm`` is the reference
(and the path for decoding from a cache, other devices, and builds without a compiler).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from components.nn.eager_island import compile_constant
from components.ops.native_build import build_cpu_extension

__all__ = ["native_available", "short_conv_silu_norm"]

_SOURCE = Path(__file__).with_name("short_conv_cpu.cpp")
# set K3_SHORT_CONV_CPU_KERNEL=0 to run the compiled PyTorch form everywhere (comparisons, debugging)
_ENV = "K3_SHORT_CONV_CPU_KERNEL"


def _register() -> None:
    """Fake-tensor rules (shapes for tracing) and the autograd formula of the C++ ops."""
    lib = "k3_short_conv_cpu"

    @torch.library.register_fake(f"{lib}::forward")
    def _(x, taps, ids, head_dim, eps):
        return torch.empty_like(x)

    @torch.library.register_fake(f"{lib}::backward")
    def _(x, taps, ids, dout, head_dim, eps):
        return torch.empty_like(x), torch.empty_like(taps)

    def setup_context(ctx, inputs, output):
        x, taps, ids, head_dim, eps = inputs
        ctx.save_for_backward(x, taps, ids)
        ctx.head_dim, ctx.eps = head_dim, eps

    def backward(ctx, dout):
        x, taps, ids = ctx.saved_tensors
        dx, dtaps = torch.ops.k3_short_conv_cpu.backward(x, taps, ids, dout.contiguous(), ctx.head_dim, ctx.eps)
        return dx, dtaps, None, None, None

    torch.library.register_autograd(f"{lib}::forward", backward, setup_context=setup_context)


@compile_constant
def native_available() -> bool:
    """Whether the native op is (or can be) loaded: built on the first call, then cached. A constant to
    TorchDynamo (the build never enters a graph)."""
    return build_cpu_extension(_SOURCE, _ENV, on_load=_register)


def short_conv_silu_norm(
    x: torch.Tensor, weight: torch.Tensor, ids: Optional[torch.Tensor], head_dim: int, eps: float
) -> torch.Tensor:
    """``silu(causal depthwise conv(x))`` of ``x [B, T, P]`` with kernel ``weight [P, 1, W]`` (zeros before
    each row), L2-normalised per head of ``head_dim`` channels (``x / sqrt(sum x^2 + eps)``; ``head_dim=0``:
    not normalised); ``[B, T, P]`` in x's dtype. ``ids [B, T]`` (document ids): inputs of another document
    add nothing. CPU only; needs ``native_available()``."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    taps = weight[:, 0, :].t().to(compute).contiguous()  # [W, P]: tap j weights x[t - (W-1-j)]
    return torch.ops.k3_short_conv_cpu.forward(
        x.contiguous(), taps, None if ids is None else ids.contiguous(), head_dim, eps
    )
