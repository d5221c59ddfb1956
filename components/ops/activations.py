"""GLU-family activations (docs/k3.md §5): z = f(gate) * g(up), elementwise.

All functions take `gate`, `up` of the same shape ([..., m], the two halves of
`cat([w1 x, w3 x], -1)`, gate first) and return z of that shape in the input
dtype. The math runs in fp32 (fp64 inputs stay fp64) and is cast back once,
matching the reference `SituAndMul`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from components.ops.backend import resolve

GluFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

SITU_BETA = 4.0  # beta_1: cap on the gate branch (|SiTU(a)| < 4)
SITU_LINEAR_BETA = 25.0  # beta_2: cap on the up branch (|z| < 4 * 25 = 100)


def _upcast(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    out_dtype = torch.promote_types(gate.dtype, up.dtype)
    if not out_dtype.is_floating_point:
        out_dtype = torch.get_default_dtype()
    # at least fp32 (reference semantics); fp64 is kept for gradcheck-grade accuracy
    compute_dtype = torch.promote_types(out_dtype, torch.float32)
    return gate.to(compute_dtype), up.to(compute_dtype), out_dtype


def glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """z = sigmoid(gate) * up."""
    a, b, out_dtype = _upcast(gate, up)
    return (torch.sigmoid(a) * b).to(out_dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """z = silu(gate) * up = gate * sigmoid(gate) * up."""
    a, b, out_dtype = _upcast(gate, up)
    return (F.silu(a) * b).to(out_dtype)


def _resolve_betas(beta: float | None, linear_beta: float | None) -> tuple[float, float | None]:
    # reference semantics: `beta or 1.0`, so None and 0 both mean 1.0
    beta = float(beta) if beta else 1.0
    if beta < 0:
        raise ValueError(f"beta must be positive (or None/0 for 1.0), got {beta}")
    if linear_beta is not None:
        linear_beta = float(linear_beta)
        if linear_beta <= 0:
            raise ValueError(f"linear_beta must be positive or None (uncapped), got {linear_beta}")
    return beta, linear_beta


def situ_glu_reference(
    gate: torch.Tensor,
    up: torch.Tensor,
    beta: float | None = SITU_BETA,
    linear_beta: float | None = SITU_LINEAR_BETA,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Pure PyTorch SiTU-GLU: z = [beta tanh(a/beta) sigmoid(a)] * [linear_beta tanh(b/linear_beta)].

    beta None/0 -> 1.0; linear_beta None -> up branch uncapped. ``compute_dtype``: the math's dtype instead
    of fp32 (fp64 for fp64 inputs); bf16 measures what bf16 arithmetic costs (benchmarks/gpu_check.py).
    """
    beta, linear_beta = _resolve_betas(beta, linear_beta)
    a, b, out_dtype = _upcast(gate, up)
    if compute_dtype is not None:
        a, b = a.to(compute_dtype), b.to(compute_dtype)
    act = beta * torch.tanh(a / beta) * torch.sigmoid(a)  # SiTU(a), |.| < beta
    if linear_beta is not None:
        b = linear_beta * torch.tanh(b / linear_beta)  # softcap, |.| < linear_beta
    return (act * b).to(out_dtype)


class _SituGluExpForm(torch.autograd.Function):
    """SiTU-GLU from exponentials of non-positive arguments, with a hand-written backward: what the
    ``torch`` back-end runs (compiled layers fuse forward and backward into one pass each). Per element
    one ``exp`` for the gate branch when ``beta`` is 4 (K3; two otherwise), one for the cap and three
    divisions, where tanh, tanh and sigmoid cost three transcendental calls and their quotients; the
    arguments stay <= 0, so nothing overflows for any input. ``situ_glu_reference`` is the
    obviously-correct form it is tested against.

    With ``e = exp(-|a| / beta')`` for ``beta' = beta / 2``: ``tanh(a / beta) = sign(a) (1 - e) / (1 + e)``,
    and with ``e2 = exp(-|a|)`` (``e ** 2`` when ``beta = 4``): ``sigmoid(a) = 1 / (1 + e2)`` for a >= 0,
    ``e2 / (1 + e2)`` below; ``sigmoid'(a) = e2 / (1 + e2) ** 2`` on both sides.
    """

    @staticmethod
    def forward(ctx, gate, up, beta, linear_beta):
        ctx.save_for_backward(gate, up)
        ctx.betas = (beta, linear_beta)
        act, cap, *_ = _situ_exp_parts(gate, up, beta, linear_beta)
        return (act * cap).to(torch.promote_types(gate.dtype, up.dtype))

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        beta, linear_beta = ctx.betas
        act, cap, t, sech2, s, ds, cap_sech2 = _situ_exp_parts(gate, up, beta, linear_beta)
        g = grad.to(act.dtype)
        d_act = sech2 * s + beta * t * ds  # d/da [beta tanh(a/beta) sigmoid(a)]
        d_cap = cap_sech2 if linear_beta is not None else 1  # d/db [L tanh(b/L)]
        return (g * cap * d_act).to(gate.dtype), (g * act * d_cap).to(up.dtype), None, None


def _situ_exp_parts(gate, up, beta, linear_beta):
    """(SiTU(a), cap(b), tanh(a/beta), sech^2(a/beta), sigmoid(a), sigmoid'(a), sech^2(b/L)) in the compute
    dtype. sech^2 = 4 e / (1 + e)^2 directly, not 1 - tanh^2, which cancels where tanh saturates."""
    a = gate.to(torch.promote_types(gate.dtype, torch.float32))
    b = up.to(torch.promote_types(up.dtype, torch.float32))
    neg = a.abs().neg()  # -|a| <= 0: every exp below is in (0, 1]
    e = torch.exp(neg * (2.0 / beta))
    e2 = e * e if beta == 4.0 else torch.exp(neg)
    r = 1 / (1 + e2)
    q = 1 / (1 + e)
    t = torch.copysign((1 - e) * q, a)  # tanh(a / beta)
    sech2 = 4 * e * q * q
    s = torch.where(a >= 0, r, e2 * r)  # sigmoid(a)
    ds = e2 * r * r  # sigmoid'(a)
    act = beta * t * s
    if linear_beta is None:
        return act, b, t, sech2, s, ds, None
    c = torch.exp(b.abs() * (-2.0 / linear_beta))
    qc = 1 / (1 + c)
    b_cap = torch.copysign((1 - c) * qc, b)  # tanh(b / L)
    return act, linear_beta * b_cap, t, sech2, s, ds, 4 * c * qc * qc


def situ_glu_exp_form(
    gate: torch.Tensor, up: torch.Tensor, beta: float | None = SITU_BETA, linear_beta: float | None = SITU_LINEAR_BETA
) -> torch.Tensor:
    """SiTU-GLU as ``situ_glu_reference`` computes it, from exponentials (``_SituGluExpForm``)."""
    beta, linear_beta = _resolve_betas(beta, linear_beta)
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    return _SituGluExpForm.apply(gate, up, beta, linear_beta)


def _triton_module() -> ModuleType:
    # the kernels' interpreter mode (TRITON_INTERPRET) is read when this module is first imported
    from components.ops.triton import situ_glu as mod  # GPU-only: triton, never loaded by CPU-only callers

    return mod


def _triton_applies(gate: torch.Tensor, up: torch.Tensor) -> bool:
    # one layout and dtype for both inputs; fp64 stays on the reference so it keeps fp64 accuracy
    return (
        up.device == gate.device
        and gate.shape == up.shape
        and gate.dtype == up.dtype
        and gate.dtype in _triton_module().SUPPORTED_DTYPES
    )


def situ_glu(
    gate: torch.Tensor,
    up: torch.Tensor,
    beta: float | None = SITU_BETA,
    linear_beta: float | None = SITU_LINEAR_BETA,
    backend: str = "auto",
) -> torch.Tensor:
    """SiTU-GLU on the back-end ``components.ops.backend.resolve`` picks: ``torch`` (``situ_glu_exp_form``),
    ``triton`` (the fused kernel: CUDA, or the CPU under TRITON_INTERPRET=1) or ``auto``."""
    if resolve("situ_glu", backend, gate.device, applies=lambda: _triton_applies(gate, up)) == "torch":
        return situ_glu_exp_form(gate, up, beta, linear_beta)
    beta, linear_beta = _resolve_betas(beta, linear_beta)
    return _situ_glu_triton(gate, up, beta, linear_beta)


# The Triton kernel enters a compiled graph as two opaque ops (forward, backward; each with a shape
# function), launched by components/ops/triton/situ_glu.py: TorchDynamo never traces the launch code, and
# the graph around the activation stays whole. The backward recomputes from the inputs, as the kernel does.
@torch.library.custom_op("k3::situ_glu_triton", mutates_args=())
def _situ_glu_triton(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: Optional[float]) -> torch.Tensor:
    return _triton_module().situ_glu_fwd(gate, up, beta, linear_beta)


@_situ_glu_triton.register_fake
def _(gate, up, beta, linear_beta):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.custom_op("k3::situ_glu_triton_backward", mutates_args=())
def _situ_glu_triton_backward(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: Optional[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    return _triton_module().situ_glu_bwd(grad, gate, up, beta, linear_beta)


@_situ_glu_triton_backward.register_fake
def _(grad, gate, up, beta, linear_beta):
    return (
        torch.empty_like(gate, memory_format=torch.contiguous_format),
        torch.empty_like(up, memory_format=torch.contiguous_format),
    )


def _situ_glu_setup(ctx, inputs, output) -> None:
    gate, up, beta, linear_beta = inputs
    ctx.save_for_backward(gate, up)
    ctx.betas = (beta, linear_beta)


def _situ_glu_grad(ctx, grad):
    gate, up = ctx.saved_tensors
    return (*_situ_glu_triton_backward(grad, gate, up, *ctx.betas), None, None)


_situ_glu_triton.register_autograd(_situ_glu_grad, setup_context=_situ_glu_setup)
