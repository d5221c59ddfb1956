"""Fused SiTU-GLU forward/backward Triton kernel (docs/k3.md §5).

z = [beta * tanh(a / beta) * sigmoid(a)] * [linear_beta * tanh(b / linear_beta)],
a = gate, b = up, computed in fp32 registers and stored in the input dtype.
The backward kernel recomputes the activation from (gate, up) instead of saving
intermediates, so the only saved tensors are the inputs.

Importing this module never requires triton: without it, `HAS_TRITON` is False
and `situ_glu_triton` / `SituGluTriton` raise at call time.
"""

from __future__ import annotations

import contextlib

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the package must work on machines without triton
    triton = None
    tl = None
    HAS_TRITON = False

DEFAULT_BLOCK = 1024

# dtypes the kernel loads/stores; computation is always fp32
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


if HAS_TRITON:

    @triton.jit
    def _tanh_sech2(y):
        # tanh(y) and sech^2(y) without overflow: e = exp(-2|y|) lies in (0, 1]
        ay = tl.abs(y)
        e = tl.exp(-2.0 * ay)
        one_p_e = 1.0 + e
        t_exp = (1.0 - e) / one_p_e
        # 1 - exp(-2|y|) cancels for small |y|; use the odd Taylor series there
        # (truncation error < 1e-9 relative at |y| = 0.125)
        y2 = ay * ay
        t_taylor = ay * (1.0 + y2 * (-1.0 / 3.0 + y2 * (2.0 / 15.0 + y2 * (-17.0 / 315.0))))
        t = tl.where(ay < 0.125, t_taylor, t_exp)
        t = tl.where(y < 0.0, -t, t)
        # sech^2 = 4e / (1 + e)^2: no 1 - t^2 cancellation when |y| is large
        s2 = 4.0 * e / (one_p_e * one_p_e)
        return t, s2

    @triton.jit
    def _sigmoid(x):
        # both branches use exp(-|x|) <= 1, so no inf/inf for large |x|
        e = tl.exp(-tl.abs(x))
        inv = 1.0 / (1.0 + e)
        return tl.where(x >= 0.0, inv, e * inv)

    @triton.jit
    def _situ_glu_fwd_kernel(
        gate_ptr,
        up_ptr,
        z_ptr,
        n_elements,
        beta,
        linear_beta,
        CAP_UP: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: > 2^31 elements
        mask = offs < n_elements
        a = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)

        t_a, _ = _tanh_sech2(a / beta)
        act = beta * t_a * _sigmoid(a)
        if CAP_UP:
            t_b, _ = _tanh_sech2(b / linear_beta)
            lin = linear_beta * t_b
        else:
            lin = b
        z = act * lin
        tl.store(z_ptr + offs, z.to(z_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _situ_glu_bwd_kernel(
        grad_z_ptr,
        gate_ptr,
        up_ptr,
        grad_gate_ptr,
        grad_up_ptr,
        n_elements,
        beta,
        linear_beta,
        CAP_UP: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_elements
        dz = tl.load(grad_z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)

        # act(a) = beta tanh(a/beta) sigma(a)
        # act'(a) = sech^2(a/beta) sigma(a) + beta tanh(a/beta) sigma(a) (1 - sigma(a))
        t_a, s2_a = _tanh_sech2(a / beta)
        sig = _sigmoid(a)
        cap_a = beta * t_a
        act = cap_a * sig
        d_act = s2_a * sig + cap_a * sig * (1.0 - sig)
        if CAP_UP:
            # lin(b) = lb tanh(b/lb), lin'(b) = sech^2(b/lb)
            t_b, s2_b = _tanh_sech2(b / linear_beta)
            lin = linear_beta * t_b
            d_lin = s2_b
        else:
            lin = b
            d_lin = 1.0

        grad_gate = dz * lin * d_act
        grad_up = dz * act * d_lin
        tl.store(grad_gate_ptr + offs, grad_gate.to(grad_gate_ptr.dtype.element_ty), mask=mask)
        tl.store(grad_up_ptr + offs, grad_up.to(grad_up_ptr.dtype.element_ty), mask=mask)


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("SiTU-GLU Triton kernel requested but triton is not installed")


def _check_inputs(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise ValueError(f"gate and up must have the same dtype, got {gate.dtype} and {up.dtype}")
    if gate.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {gate.dtype}; expected one of {SUPPORTED_DTYPES}")
    if gate.device != up.device:
        raise ValueError(f"gate and up are on different devices: {gate.device} and {up.device}")


def _launch_params(beta: float, linear_beta: float | None) -> tuple[float, float, bool]:
    cap_up = linear_beta is not None
    # the kernel always receives a float; 1.0 is a dummy when the up branch is uncapped
    return float(beta), float(linear_beta) if cap_up else 1.0, cap_up


def _device_ctx(t: torch.Tensor):
    # launch on the tensors' GPU, not the current one
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def situ_glu_fwd(
    gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None, block: int = DEFAULT_BLOCK
) -> torch.Tensor:
    """Forward only (no autograd). gate, up: same shape/dtype -> z of that shape/dtype."""
    _require_triton()
    _check_inputs(gate, up)
    gate_c, up_c = gate.contiguous(), up.contiguous()
    z = torch.empty_like(gate_c)
    n = gate_c.numel()
    if n == 0:
        return z
    beta_f, lb_f, cap_up = _launch_params(beta, linear_beta)
    grid = (triton.cdiv(n, block),)
    with _device_ctx(gate_c):
        _situ_glu_fwd_kernel[grid](gate_c, up_c, z, n, beta_f, lb_f, CAP_UP=cap_up, BLOCK=block)
    return z


def situ_glu_bwd(
    grad_z: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    beta: float,
    linear_beta: float | None,
    block: int = DEFAULT_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recompute-and-differentiate in one pass -> (grad_gate, grad_up) in the input dtype."""
    _require_triton()
    _check_inputs(gate, up)
    gate_c, up_c = gate.contiguous(), up.contiguous()
    # grad_z may arrive in another dtype (e.g. fp32 from a loss); the kernel casts on load
    grad_z_c = grad_z.contiguous()
    grad_gate = torch.empty_like(gate_c)
    grad_up = torch.empty_like(up_c)
    n = gate_c.numel()
    if n == 0:
        return grad_gate, grad_up
    beta_f, lb_f, cap_up = _launch_params(beta, linear_beta)
    grid = (triton.cdiv(n, block),)
    with _device_ctx(gate_c):
        _situ_glu_bwd_kernel[grid](
            grad_z_c, gate_c, up_c, grad_gate, grad_up, n, beta_f, lb_f, CAP_UP=cap_up, BLOCK=block
        )
    return grad_gate, grad_up


class SituGluTriton(torch.autograd.Function):
    """Autograd wrapper: `SituGluTriton.apply(gate, up, beta, linear_beta)`.

    beta must already be resolved to a positive float (callers map None/0 -> 1.0);
    linear_beta=None leaves the up branch uncapped. Only the inputs are saved.
    """

    @staticmethod
    def forward(ctx, gate, up, beta=4.0, linear_beta=25.0, block=DEFAULT_BLOCK):
        z = situ_glu_fwd(gate, up, beta, linear_beta, block)
        ctx.save_for_backward(gate, up)
        ctx.beta, ctx.linear_beta, ctx.block = beta, linear_beta, block
        return z

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_z):
        gate, up = ctx.saved_tensors
        grad_gate, grad_up = situ_glu_bwd(grad_z, gate, up, ctx.beta, ctx.linear_beta, ctx.block)
        return grad_gate, grad_up, None, None, None


def situ_glu_triton(
    gate: torch.Tensor,
    up: torch.Tensor,
    beta: float = 4.0,
    linear_beta: float | None = 25.0,
    block: int = DEFAULT_BLOCK,
) -> torch.Tensor:
    """Fused SiTU-GLU with autograd. gate, up: [...], same shape and dtype -> z: [...]."""
    _require_triton()
    return SituGluTriton.apply(gate, up, beta, linear_beta, block)
