"""AttnRes depth read: softmax attention over residual sources, per token (docs/k3.md §7).

For a sublayer with pseudo-query ``w`` and key-norm gain ``gamma``, and sources ``u_0 .. u_{S-1}``
(completed blocks oldest first, current partial sum last):

    k_i     = u_i / sqrt(mean(u_i ** 2) + eps)          # RMSNorm without its gain
    score_i = sum_d k_{i,d} * gamma_d * w_d              # gain and query fold into one vector
    a       = softmax_i(score)                           # over the source axis, no temperature
    h       = sum_i a_i * u_i                            # mix the RAW sources

All of it in fp32 (fp64 for fp64 inputs); ``h`` is cast back to the sources' dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from components.ops.attnres_cpu import attnres_read_native, native_available
from components.ops.backend import check_choice, resolve

__all__ = ["attnres_read", "attnres_read_and_norm", "attnres_read_reference", "fused_norm_applies"]

_NATIVE_DTYPES = (torch.bfloat16, torch.float32, torch.float64)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 math for half types; fp64 inputs keep fp64 so float64 tests can be tight
    return torch.promote_types(dtype, torch.float32)


def _as_vector(x: torch.Tensor, d: int, name: str) -> torch.Tensor:
    # accept [d], [1, d] (a Linear(d, 1) weight) or [d, 1]
    if x.numel() != d:
        raise ValueError(f"{name} must have {d} elements (the hidden size), got shape {tuple(x.shape)}")
    return x.reshape(d)


def _split_sources(
    sources: torch.Tensor | Sequence[torch.Tensor],
) -> tuple[torch.Tensor | None, list[torch.Tensor] | None, torch.Tensor]:
    """Returns (stacked [S, ..., d] or None, list of S [..., d] or None, one source as a template)."""
    if isinstance(sources, torch.Tensor):
        if sources.dim() < 2 or sources.shape[0] == 0:
            raise ValueError(f"stacked sources must be [S >= 1, ..., d], got shape {tuple(sources.shape)}")
        return sources, None, sources[0]
    srcs = list(sources)
    if not srcs:
        raise ValueError("attnres_read needs at least one source")
    first = srcs[0]
    for u in srcs[1:]:
        if u.shape != first.shape or u.dtype != first.dtype or u.device != first.device:
            raise ValueError(
                "all sources must share shape, dtype and device; got "
                f"{tuple(first.shape)}/{first.dtype}/{first.device} and {tuple(u.shape)}/{u.dtype}/{u.device}"
            )
    return None, srcs, first


def _scores(u: torch.Tensor, qw: torch.Tensor, eps: float) -> torch.Tensor:
    """Scores of the sources in ``u`` [..., d] against the folded query ``qw`` [d] -> [...] in qw's dtype.

    Written so that autograd saves ``u`` itself (plus [...]-sized stats), never an upcast copy:
    vector_norm(dtype=) accumulates in the compute dtype straight from u, and ``u * qw`` promotes
    to the compute dtype inside the kernel. score = (u . qw) * rstd equals k . qw without
    materialising the normalised keys k.
    """
    d = u.shape[-1]
    sumsq = torch.linalg.vector_norm(u, dim=-1, dtype=qw.dtype).square()  # [...]
    rstd = torch.rsqrt(sumsq / d + eps)  # [...]
    return (u * qw).sum(dim=-1) * rstd  # [...]


def _read_torch(
    stacked: torch.Tensor | None,
    srcs: list[torch.Tensor] | None,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    cdt = _compute_dtype(dtype)
    qw = query.to(cdt) * norm_weight.to(cdt)  # [d]
    if stacked is not None:
        weights = torch.softmax(_scores(stacked, qw, eps), dim=0)  # [S, ...]
        # fp32 weights x raw sources promotes to fp32; autograd keeps only `weights` and `stacked`
        mixed = (weights.unsqueeze(-1) * stacked).sum(dim=0)  # [..., d]
    else:
        # per source, so no stacked copy of the sources is made (and kept for backward)
        weights = torch.softmax(torch.stack([_scores(u, qw, eps) for u in srcs]), dim=0)  # [S, ...]
        mixed = weights[0].unsqueeze(-1) * srcs[0]  # [..., d]
        for i in range(1, len(srcs)):
            mixed = mixed + weights[i].unsqueeze(-1) * srcs[i]
    return mixed.to(dtype), weights


def _aligned(u: torch.Tensor) -> torch.Tensor:
    # the fused kernel gathers each source through a raw pointer that must be 16-byte aligned (fla asserts
    # it); slices of a stacked tensor are not when (numel per source * itemsize) % 16 != 0. Called inside
    # the kernel's ops only, never in a traced graph: data_ptr() there would end the graph
    u = u.contiguous()
    return u if u.data_ptr() % 16 == 0 else u.clone()


def _fla_kernels() -> tuple[Callable, Callable, Callable]:
    """fla's fused AttnRes read as its two launches and their pointer table: ``(fused_attnres_fwd,
    fused_attnres_bwd, _build_ptr_table)`` of ``fla.ops.attnres.fused`` (the functions its
    ``FusedAttnresFunction`` calls). The one place they are looked up, so a test can put functions of
    the same signatures in their place (the torch read, on a CPU)."""
    from fla.ops.attnres import fused  # GPU-only: fla needs triton

    return fused.fused_attnres_fwd, fused.fused_attnres_bwd, fused._build_ptr_table


def _on_device(t: torch.Tensor):
    # launch on the tensors' GPU, not the current one (as fla's input_guard does)
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


# The kernel enters a compiled graph as two opaque ops (forward and backward, each with a shape function):
# TorchDynamo never traces fla's Python wrappers (their pointer table reads data_ptr(), which would end the
# graph), so the graph around the read stays whole. Sources arrive flattened, [N, d] each.
@torch.library.custom_op("k3::attnres_read_fla", mutates_args=())
def _fla_forward(
    query: torch.Tensor, norm_weight: torch.Tensor, residuals: list[torch.Tensor], eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mixed [N, d] in the sources' dtype, rstd [S, N], logits [S, N], logsumexp [N]; fp32 statistics)."""
    forward, _, table = _fla_kernels()
    srcs = [_aligned(u) for u in residuals]
    with _on_device(query):
        # fla's rms_eps defaults to 1e-6; K3 uses 1e-5. scale=1.0: AttnRes has no temperature.
        # checkpoint_level=1: the pre-norm mix is not kept (fla's default; there is no output norm here)
        o, _, rstd, logit, lse = forward(
            q=query.contiguous(),
            residuals=srcs,
            res=table(srcs),
            w=norm_weight.contiguous(),
            ow=None,
            eps=eps,
            scale=1.0,
            checkpoint_level=1,
        )
    return o, rstd, logit, lse


@_fla_forward.register_fake
def _(query, norm_weight, residuals, eps):
    S, (N, _) = len(residuals), residuals[0].shape
    stats = residuals[0].new_empty((S, N), dtype=torch.float32)
    return torch.empty_like(residuals[0]), stats, torch.empty_like(stats), stats.new_empty(N)


@torch.library.custom_op("k3::attnres_read_fla_backward", mutates_args=())
def _fla_backward(
    grad: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    residuals: list[torch.Tensor],
    rstd: torch.Tensor,
    logit: torch.Tensor,
    lse: torch.Tensor,
    eps: float,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Gradients of the read: (each source's [N, d], the query's [d], the key-norm gain's [d])."""
    _, backward, table = _fla_kernels()
    srcs = [_aligned(u) for u in residuals]
    with _on_device(query):
        dsrcs, dq, dw, _ = backward(
            do=grad.contiguous(),
            q=query.contiguous(),
            residuals=srcs,
            res=table(srcs),
            w=norm_weight.contiguous(),
            ow=None,
            o_pre=None,
            rstd=rstd,
            logit=logit,
            lse=lse,
            eps=eps,
            scale=1.0,
            checkpoint_level=1,
        )
    return list(dsrcs), dq, dw


@_fla_backward.register_fake
def _(grad, query, norm_weight, residuals, rstd, logit, lse, eps):
    return [torch.empty_like(u) for u in residuals], torch.empty_like(query), torch.empty_like(norm_weight)


def _fla_setup(ctx, inputs, output) -> None:
    query, norm_weight, residuals, eps = inputs
    _, rstd, logit, lse = output
    ctx.save_for_backward(query, norm_weight, rstd, logit, lse, *residuals)
    ctx.eps = eps
    ctx.mark_non_differentiable(rstd, logit, lse)


def _fla_grad(ctx, grad, *_stats):
    query, norm_weight, rstd, logit, lse, *residuals = ctx.saved_tensors
    dsrcs, dq, dw = _fla_backward(grad, query, norm_weight, residuals, rstd, logit, lse, ctx.eps)
    return dq, dw, dsrcs, None


_fla_forward.register_autograd(_fla_grad, setup_context=_fla_setup)


def _read_fla(
    stacked: torch.Tensor | None,
    srcs: list[torch.Tensor] | None,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    return_weights: bool,
):
    """The read on fla's kernels (``_fla_kernels``), through their custom ops; weights as fla computes
    them, ``exp(logit - logsumexp)``, fp32."""
    residuals = list(stacked.unbind(0)) if stacked is not None else srcs  # S x [..., d]
    lead, d = residuals[0].shape[:-1], residuals[0].shape[-1]
    mixed, _, logit, lse = _fla_forward(query, norm_weight, [u.reshape(-1, d) for u in residuals], eps)
    mixed = mixed.view(*lead, d)
    if not return_weights:
        return mixed
    return mixed, (logit - lse).exp().view(len(residuals), *lead)


def attnres_read(
    sources: torch.Tensor | Sequence[torch.Tensor],
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float = 1e-5,
    return_weights: bool = False,
    backend: str = "torch",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One AttnRes read (K3 ``R(sources; w, gamma)``).

    Args:
        sources: ``[S, ..., d]`` tensor (oldest source first, current partial sum last) or a sequence of
            S tensors ``[..., d]`` with equal shape/dtype/device.
        query: learned pseudo-query ``w`` ``[d]`` (``[1, d]`` / ``[d, 1]`` accepted).
        norm_weight: RMSNorm gain ``gamma`` ``[d]`` of the key norm; folded into the query.
        eps: RMSNorm epsilon (K3: 1e-5).
        return_weights: also return the depth softmax weights ``[S, ...]`` (fp32; fp64 for fp64 input).
        backend: ``"torch"``; ``"fla"`` (fla-core's fused Triton kernel: CUDA only, and ``d * itemsize``
            a multiple of 16 bytes); ``"auto"`` (fla where it applies and imports, torch otherwise).

    Returns:
        mixed ``[..., d]`` in the sources' dtype, and the weights if ``return_weights``.
    """
    stacked, srcs, first = _split_sources(sources)
    d = first.shape[-1]
    query = _as_vector(query, d, "query")
    norm_weight = _as_vector(norm_weight, d, "norm_weight")

    # the fused kernel addresses each token row as 16-byte aligned
    rows_aligned = (d * first.element_size()) % 16 == 0
    check_choice("attnres", backend)
    if backend == "fla" and not rows_aligned:
        raise ValueError(
            f"attnres_read(backend='fla'): the fla AttnRes kernel needs d * itemsize to be a multiple of "
            f"16 bytes, got d={d} in {first.dtype}; use backend='torch' or 'auto'"
        )
    if resolve("attnres", backend, first.device, applies=rows_aligned) == "fla":
        return _read_fla(stacked, srcs, query, norm_weight, eps, return_weights)

    if not return_weights and _native_applies(first):
        # the whole read as one native op on the CPU (the weights, for diagnostics, come from the PyTorch read)
        return attnres_read_native(srcs if srcs is not None else list(stacked.unbind(0)), query, norm_weight, eps)
    mixed, weights = _read_torch(stacked, srcs, query, norm_weight, eps, first.dtype)
    return (mixed, weights) if return_weights else mixed


def _native_applies(first: torch.Tensor) -> bool:
    return first.device.type == "cpu" and first.dtype in _NATIVE_DTYPES and native_available()


def fused_norm_applies(first: torch.Tensor, out_gain: torch.Tensor, backend: str = "torch") -> bool:
    """Whether ``attnres_read_and_norm`` can run a read of sources like ``first`` with the RMSNorm gain
    ``out_gain`` after it: the native CPU read, the gain in the compute dtype."""
    check_choice("attnres", backend)
    rows_aligned = (first.shape[-1] * first.element_size()) % 16 == 0
    return (
        resolve("attnres", backend, first.device, applies=rows_aligned) == "torch"
        and _native_applies(first)
        and out_gain.dtype == _compute_dtype(first.dtype)
    )


def attnres_read_and_norm(
    sources: Sequence[torch.Tensor],
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    out_gain: torch.Tensor,
    out_eps: float,
) -> torch.Tensor:
    """``rms_norm(attnres_read(sources, query, norm_weight, eps), out_gain, out_eps)`` (components/nn/rmsnorm.py)
    as one native CPU op, in the compute dtype; only where ``fused_norm_applies``. Its backward recomputes the
    read from the sources: the read's result is never kept, as ``residual.recompute`` would have it, without
    running the read a second time."""
    srcs = list(sources)
    d = srcs[0].shape[-1]
    return attnres_read_native(
        srcs, _as_vector(query, d, "query"), _as_vector(norm_weight, d, "norm_weight"), eps, (out_gain, out_eps)
    )


def attnres_read_reference(
    sources_list: Sequence[torch.Tensor],
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float = 1e-5,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Plain loop over sources, for tests: per-source RMSNorm, dot with the query, softmax, weighted sum.
    ``compute_dtype``: the math's dtype instead of fp32 (fp64 for fp64 sources); bf16 measures what bf16
    arithmetic costs the read (benchmarks/gpu_check.py's tolerances)."""
    dtype = sources_list[0].dtype
    cdt = compute_dtype or _compute_dtype(dtype)
    w = query.reshape(-1).to(cdt)  # [d]
    gamma = norm_weight.reshape(-1).to(cdt)  # [d]

    values, scores = [], []
    for u in sources_list:
        v = u.to(cdt)  # [..., d]
        k = v / torch.sqrt(v.pow(2).mean(dim=-1, keepdim=True) + eps) * gamma  # RMSNorm(v), [..., d]
        values.append(v)
        scores.append((k * w).sum(dim=-1))  # [...]

    # softmax over sources, max-subtracted
    m = scores[0]
    for s in scores[1:]:
        m = torch.maximum(m, s)
    exps = [torch.exp(s - m) for s in scores]
    z = exps[0]
    for e in exps[1:]:
        z = z + e

    out = torch.zeros_like(values[0])
    for e, v in zip(exps, values):
        out = out + (e / z).unsqueeze(-1) * v
    return out.to(dtype)
