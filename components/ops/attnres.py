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

from collections.abc import Sequence

import torch

from components.ops.backend import check_choice, resolve

__all__ = ["attnres_read", "attnres_read_reference"]


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
    # the fused kernel gathers each source through a raw pointer that must be 16-byte aligned;
    # slices of a stacked tensor are not when (numel per source * itemsize) % 16 != 0
    u = u.contiguous()
    return u if u.data_ptr() % 16 == 0 else u.clone()


def _read_fla(
    stacked: torch.Tensor | None,
    srcs: list[torch.Tensor] | None,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    return_weights: bool,
    kernel=None,
):
    """fla's AttnRes kernel; ``kernel`` overrides it (same call signature) so the wiring is testable on CPU."""
    if kernel is None:
        from fla.ops.attnres import fused_attnres as kernel  # lazy: needs triton
    residuals = list(stacked.unbind(0)) if stacked is not None else srcs  # S x [..., d]
    residuals = [_aligned(u) for u in residuals]
    # fla's rms_eps defaults to 1e-6; K3 uses 1e-5. scale=1.0: AttnRes has no temperature.
    return kernel(
        query,
        residuals,
        norm_weight,
        output_rms_weight=None,
        rms_eps=eps,
        scale=1.0,
        return_weights=return_weights,
    )


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

    mixed, weights = _read_torch(stacked, srcs, query, norm_weight, eps, first.dtype)
    return (mixed, weights) if return_weights else mixed


def attnres_read_reference(
    sources_list: Sequence[torch.Tensor],
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Plain loop over sources, for tests: per-source RMSNorm, dot with the query, softmax, weighted sum."""
    dtype = sources_list[0].dtype
    cdt = _compute_dtype(dtype)
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
