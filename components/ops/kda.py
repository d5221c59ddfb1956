"""Kimi Delta Attention (KDA) core ops in pure PyTorch (docs/k3.md §2).

Per head, with state ``S`` of shape ``[K, V]`` (key channels first), per-channel log-decay
``g_t <= 0`` and write strength ``beta_t``:

    S  <- Diag(exp(g_t)) S                   # decay rows (key channels)
    u  =  beta_t * (v_t - S^T k_t)           # delta-rule error
    S  <- S + k_t u^T
    o_t = S^T (scale * q_t)

``recurrent_kda`` runs this token by token (the reference); ``chunk_kda`` is the chunked WY/UT
form (docs/k3.md §2.5) with a hand-written backward, for training-length sequences on CPU. Both follow
the contract of fla's naive references: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` (HV a multiple of H);
g ``[B, T, HV, K]``
already gated; beta ``[B, T, HV]`` post-sigmoid; states ``[B, HV, K, V]``; q/k are not
L2-normalised here. Math runs in fp32 (fp64 for fp64 inputs); ``o`` comes back in v's dtype.

Document masking: both take ``segments`` (``components.nn.segments.Segments`` of the ``[B, T]`` rows);
the state restarts from zero at every document start, so no document sees another. ``chunk_kda`` lays
each document out to start on a chunk boundary and resets the state entering such chunks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from components.nn.eager_island import eager_island
from components.nn.segments import Segments
from components.ops.kda_cpu import max_chunk_span, native_available, native_chunk_kda

__all__ = ["chunk_kda", "kda_gate", "l2norm", "recurrent_kda"]

KERNELS = ("auto", "native", "batched")


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    # fp32 math for half types; fp64 inputs stay fp64 so float64 tests can be tight
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


# the epsilon of KDA's q/k normalisation (inside the square root, as fla and HF have it)
L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x**2) + eps)`` over the last dim, computed in fp32, returned in x's dtype.

    eps sits inside the square root, added to the sum of squares (fla/HF convention), which is
    not what ``F.normalize`` does (``x / max(||x||, eps)``).
    """
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def kda_gate(
    f: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """Log-space decay gate ``g`` from the raw forget projection ``f`` ``[..., H, K]``.

    * ``lower_bound=None`` (Kimi Linear / fla default): ``g = -exp(A_log) * softplus(f + dt_bias)``,
      in ``(-inf, 0)``.
    * ``lower_bound=L`` (K3 uses L = -5): ``g = L * sigmoid(exp(A_log) * (f + dt_bias))``, in ``(L, 0)``.

    ``A_log`` has one entry per head ``[H]`` (None means exp(A_log) = 1), ``dt_bias`` one per
    (head, channel) ``[H * K]``. Computed and returned in fp32 (fp64 for fp64 ``f``, so float64
    checks of a whole layer stay exact).
    """
    H, K = f.shape[-2:]
    dt = torch.promote_types(f.dtype, torch.float32)
    x = f.to(dt)
    if dt_bias is not None:
        x = x + dt_bias.to(dt).view(H, K)
    a = A_log.to(dt).exp().view(H, 1) if A_log is not None else None
    if lower_bound is None:
        sp = F.softplus(x)
        return -sp if a is None else -a * sp
    return lower_bound * torch.sigmoid(x if a is None else a * x)


def _check_segments(segments: Segments | None, q: torch.Tensor, initial_state: torch.Tensor | None) -> None:
    if segments is None:
        return
    if tuple(segments.shape) != tuple(q.shape[:2]):
        raise ValueError(f"segments are {tuple(segments.shape)}, the inputs [B, T] = {tuple(q.shape[:2])}")
    if initial_state is not None:
        raise ValueError("segments describe whole documents, which start from a zero state: no initial_state")


def _expand_heads(q: torch.Tensor, k: torch.Tensor, hv: int) -> tuple[torch.Tensor, torch.Tensor]:
    # grouped value heads (HV = G * H): each q/k head serves G consecutive value heads
    h = q.shape[2]
    if hv == h:
        return q, k
    if hv % h:
        raise ValueError(f"value heads ({hv}) must be a multiple of q/k heads ({h})")
    return q.repeat_interleave(hv // h, dim=2), k.repeat_interleave(hv // h, dim=2)


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    segments: Segments | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA recurrence (docs/k3.md §2.4): the slow, obviously-correct reference.

    Differentiable through plain autograd. Returns ``(o [B, T, HV, V], S [B, HV, K, V] or None)``.
    ``segments``: the state is zeroed before every document's first token (no ``initial_state`` then).
    """
    _check_segments(segments, q, initial_state)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else scale
    dt = _compute_dtype(q, k, v, g, beta, initial_state)
    out_dtype = v.dtype
    q, k = _expand_heads(q, k, HV)
    q = q.to(dt) * scale  # [B, T, HV, K]
    k = k.to(dt)  # [B, T, HV, K]
    alpha = g.to(dt).exp()  # [B, T, HV, K] per-channel retention
    v = v.to(dt)  # [B, T, HV, V]
    beta = beta.to(dt)  # [B, T, HV]

    S = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.to(dt)  # [B, HV, K, V]
    if T == 0:
        return v.new_zeros(B, 0, HV, V, dtype=out_dtype), (S.clone() if output_final_state else None)
    outs = []
    # keep_t = 0 where a document starts: the state entering it is dropped
    keep = (~segments.starts).to(dt).unbind(1) if segments is not None else [None] * T  # T x [B]
    # unbind once: indexing x[:, t] inside the loop would make autograd scatter a full-size
    # gradient per step (quadratic in T)
    for q_t, k_t, v_t, a_t, b_t, keep_t in zip(
        q.unbind(1), k.unbind(1), v.unbind(1), alpha.unbind(1), beta.unbind(1), keep
    ):
        if keep_t is not None:
            S = S * keep_t[:, None, None, None]
        S = S * a_t.unsqueeze(-1)  # decay: rows are key channels
        pred = (k_t.unsqueeze(-2) @ S).squeeze(-2)  # [B, HV, V]  S^T k
        u = b_t.unsqueeze(-1) * (v_t - pred)  # [B, HV, V]
        S = S + k_t.unsqueeze(-1) * u.unsqueeze(-2)  # rank-1 write k u^T
        outs.append((q_t.unsqueeze(-2) @ S).squeeze(-2))  # [B, HV, V]  S^T q
    o = torch.stack(outs, dim=1)  # [B, T, HV, V]
    return o.to(out_dtype), (S if output_final_state else None)


# ----------------------------------------------------------------------------------------------
# chunked form
# ----------------------------------------------------------------------------------------------
#
# Per chunk of C tokens, with G the inclusive in-chunk cumsum of g and S the state entering the
# chunk (docs/k3.md §2.5; the scale is applied to the output, as o is linear in q):
#   A  = [q_r . (exp(G_r - G_c) * k_c)]_{c <= r}              query-key products   [C, C]
#   L  = [beta_r k_r . (exp(G_r - G_c) * k_c)]_{c < r}        key-key products     [C, C]
#   Tm = (I + L)^-1                                            UT transform
#   U  = Tm (beta * v - (beta * exp(G) * k) S)                 delta-rule errors    [C, V]
#   O  = (exp(G) * q) S + A U
#   S' = exp(G_C) * S + (exp(G_C - G) * k)^T U
# Everything but the S -> S' hand-off is batched over all chunks at once.
#
# Pairwise decays are factorised, exp(G_r - G_c) = exp(G_r - m) * exp(m - G_c), so A and L are
# plain matmuls. The chunk's "span" is its total log-decay -G_C. With m = 0 (chunk start) the
# factors are exp(G) in [exp(-span), 1] and exp(-G) in [1, exp(span)]; with m = G_C / 2 (middle
# of the range) both stay within exp(+-span / 2). fp32 limits: m = 0 up to span 60, where decays
# times data still sit far above the denormal range (denormals make CPU matmuls ~50x slower);
# the midpoint up to span 80, where the masked-out upper triangle still stays finite. Beyond
# that the chunk is halved, down to 16 tokens, where a gate bounded by -5 spans at most 80.
# Unbounded (softplus) gates that still span more over 16 tokens fall back to explicit pairwise
# decays, masked before exp.
# bf16 (compute_dtype=torch.bfloat16, for error measurements) has fp32's exponent range, hence its limits
_SPAN_REF0 = {torch.float32: 60.0, torch.float64: 300.0, torch.bfloat16: 60.0}
_SPAN_MID = {torch.float32: 80.0, torch.float64: 600.0, torch.bfloat16: 80.0}
# pairwise fallback: decay factors below exp(floor) are flushed to zero (no denormals)
_LOG_FLOOR = {torch.float32: -35.0, torch.float64: -300.0, torch.bfloat16: -35.0}
_MIN_CHUNK = 16


def _to_chunks(x: torch.Tensor, N: int, C: int, dt: torch.dtype, op: str = "copy", scale: float = 1.0) -> torch.Tensor:
    """[B, T, H, *D] -> fresh contiguous [N, B*H, C, *D] in dtype dt, zero-padded in time.

    op="cumsum" writes the in-chunk inclusive cumsum instead, op="scale" multiplies by scale;
    either way the layout change and the op share one pass.
    """
    B, T, H = x.shape[:3]
    rest = x.shape[3:]
    full = T // C
    out = x.new_empty(N, B, H, C, *rest, dtype=dt)
    o5 = out.movedim(0, 1).movedim(3, 2)  # [B, N, C, H, ...] view of out

    def put(dst: torch.Tensor, src: torch.Tensor) -> None:
        if op == "copy":
            dst.copy_(src)
        elif src.dtype != dt:  # convert first, then the op in place
            dst.copy_(src)
            if op == "cumsum":
                dst.cumsum_(2)
            else:
                dst.mul_(scale)
        elif op == "cumsum":
            torch.cumsum(src, dim=2, out=dst)
        else:
            torch.mul(src, scale, out=dst)

    if full:
        put(o5[:, :full], x[:, : full * C].unflatten(1, (full, C)))
    if full < N:  # ragged last chunk, padded with g = 0 (a flat cumsum) and zeros elsewhere
        tail = T - full * C
        put(o5[:, full:, :tail], x[:, full * C :].unsqueeze(1))
        if op == "cumsum":
            o5[:, full:, tail:] = o5[:, full:, tail - 1 : tail]
        else:
            o5[:, full:, tail:].zero_()
    return out.view(N, B * H, C, *rest)


def _from_chunks(x: torch.Tensor, B: int, T: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    # [N, B*H, C, *D] -> fresh [B, T, H, *D] in dtype, times scale (one pass)
    N, BH, C = x.shape[:3]
    rest = x.shape[3:]
    src = x.view(N, B, BH // B, C, *rest).movedim(0, 1).movedim(3, 2)  # [B, N, C, H, ...]
    out = x.new_empty(B, T, BH // B, *rest, dtype=dtype)
    full = T // C

    def put(dst: torch.Tensor, s: torch.Tensor) -> None:
        if scale == 1.0:
            dst.copy_(s)
        elif dtype == x.dtype:
            torch.mul(s, scale, out=dst)
        else:  # scale in the compute dtype, then round once
            dst.copy_(s * scale)

    if full:
        put(out[:, : full * C].unflatten(1, (full, C)), src[:, :full])
    if full * C < T:
        put(out[:, full * C :], src[:, full, : T - full * C])
    return out


def _exp_floored(x: torch.Tensor, floor: float) -> torch.Tensor:
    # exp(x) with results below exp(floor) flushed to exactly 0; x is a temporary
    return x.masked_fill_(x < floor, -math.inf).exp_()


def _unit_lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """``(I + L)^-1`` for strictly lower-triangular ``L [Z, C, C]`` (C a multiple of 16).

    16x16 diagonal blocks by forward substitution (a column sweep vectorised over all blocks),
    then block rows ``T[i, :i] = -T[i, i] L[i, :i] T[:i, :i]``. Substitution keeps the error at
    round-off level; a Neumann-type product would amplify it for strongly correlated keys.
    """
    Z, C, _ = L.shape
    SB = _MIN_CHUNK
    ns = C // SB
    # diagonal blocks with the batch moved innermost: [SB, SB, Z, ns], so each sweep step is
    # one long vectorised op
    Ld = torch.diagonal(L.unflatten(1, (ns, SB)).unflatten(3, (ns, SB)), dim1=1, dim2=3)
    Ld = Ld.permute(1, 2, 0, 3).contiguous()
    X = torch.zeros_like(Ld)
    X.diagonal(dim1=0, dim2=1).fill_(1.0)
    for j in range(SB - 1):
        # row j is final: rows below subtract L[r, j] * row j (its columns > j are still zero)
        X[j + 1 :, : j + 1].addcmul_(Ld[j + 1 :, j : j + 1], X[j : j + 1, : j + 1], value=-1.0)
    Tm = L.new_zeros(Z, C, C)
    torch.diagonal(Tm.view(Z, ns, SB, ns, SB), dim1=1, dim2=3).copy_(X.permute(2, 0, 1, 3))
    for i in range(1, ns):
        r, p = slice(i * SB, (i + 1) * SB), slice(0, i * SB)
        X = torch.bmm(L[:, r, p], Tm[:, p, p])  # [Z, SB, i*SB]
        Tm[:, r, p] = torch.bmm(Tm[:, r, r], X).neg_()
    return Tm


def _choose_chunking(g: torch.Tensor, chunk_size: int, dt: torch.dtype) -> tuple[int, torch.Tensor, str]:
    """Largest chunk (<= chunk_size) whose log-decay span a factorised form can take.

    Returns (C, G [N*B*H, C, K] in-chunk inclusive cumsum of g, mode in {"ref0", "mid", "pairwise"}).
    """
    T = g.shape[1]
    BH = g.shape[0] * g.shape[2]
    C = chunk_size
    while True:
        N = max(1, -(-T // C))
        G = _to_chunks(g, N, C, dt, op="cumsum").view(N * BH, C, -1)
        span = float(-G[:, -1].amin()) if G.numel() else 0.0  # G is non-increasing (g <= 0)
        if span <= _SPAN_REF0[dt]:
            return C, G, "ref0"
        if span <= _SPAN_MID[dt]:
            return C, G, "mid"
        if C <= _MIN_CHUNK:
            return C, G, "pairwise"
        C //= 2


def _intra_forward(mode: str, qc, kc, bc, G):
    """Per-chunk products, batched over all chunks (``Z`` = chunks x batch x heads).

    Returns ``AL [Z, 2C, C]`` (rows 0..C-1: A including the diagonal, rows C..2C-1: L strictly
    lower), the row factors ``QK [Z, 2C, K]`` they were built from (q side, then beta k side),
    the state-side factors ``qg = exp(G) q``, ``kgb = beta exp(G) k``, ``kd = exp(G_C - G) k``
    (each ``[Z, C, K]``), ``gam = exp(G_C) [Z, 1, K]`` and what the backward needs. Stacking
    the two sides along rows lets one matmul serve both.
    """
    Z, C, K = qc.shape
    QK = qc.new_empty(Z, 2 * C, K)
    if mode == "pairwise":
        floor = _LOG_FLOOR[G.dtype]
        kbc = kc * bc  # beta k
        x = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill_(
            torch.ones(C, C, dtype=torch.bool, device=G.device).triu(1)[..., None], -math.inf
        )
        D = _exp_floored(x, floor)  # [Z, C(r), C(c), K]: exp(G_r - G_c) for c <= r, else 0
        Dk = D * kc.unsqueeze(-3)  # D_rc k_c
        AL = torch.cat([torch.einsum("zrk,zrck->zrc", qc, Dk), torch.einsum("zrk,zrck->zrc", kbc, Dk)], 1)
        eG = _exp_floored(G.clone(), floor)
        ekd = _exp_floored(G[:, -1:] - G, floor)
        torch.mul(qc, eG, out=QK[:, :C])
        torch.mul(kbc, eG, out=QK[:, C:])
        kd = kc * ekd
        gam = eG[:, -1:]
        saved = (qc, kbc, D, Dk, eG, ekd)
    else:
        if mode == "mid":
            m = 0.5 * G[:, -1:]  # [Z, 1, K] middle of the chunk's log-decay range
            em = torch.sub(G, m).exp_()  # exp(G - m), within exp(+-span / 2)
            eh = m.exp()  # exp(m) = exp(G_C - m): takes a factor back to the chunk start / end
            gam = eh.square()
        else:
            em = G.exp()  # exp(G)
            eh = None
            gam = em[:, -1:]
        torch.mul(qc, em, out=QK[:, :C])  # q exp(G - m)
        torch.mul(kc, em, out=QK[:, C:]).mul_(bc)  # beta k exp(G - m)
        ki = kc / em  # k exp(m - G)
        AL = torch.bmm(QK, ki.transpose(-1, -2))  # [Z, 2C, C]
        kd = ki * (gam if eh is None else eh)
        saved = (em, ki, eh)
    AL[:, :C].tril_()
    AL[:, C:].tril_(-1)
    if mode == "mid":
        qg, kgb = QK[:, :C] * eh, QK[:, C:] * eh
    else:
        qg, kgb = QK[:, :C], QK[:, C:]
    return AL, QK, qg, kgb, kd, gam, saved


def _intra_backward(mode: str, dAL, dOR, Sin, U, dSout, QK, kc, bc, kd, gam, saved):
    """Grads through A, L and the state-side factors qg, kgb, kd.

    ``dAL = [dA; dL]`` (masked), ``dOR = [dO; -dR]`` (rows-stacked like AL) with
    R = beta (v - exp(G) k S). Returns ``(dq, dk)`` as (tensor, factor) pairs the caller finishes
    while writing the output layout, ``dbeta [Z, C]`` and ``dG [Z, C, K]`` without the explicit
    dependence on G_C (through gam and kd), which the caller adds.
    """
    C = dAL.shape[-1]
    SinT = Sin.transpose(-1, -2)
    if mode == "pairwise":
        qc, kbc, D, Dk, eG, ekd = saved
        dA, dL = dAL[:, :C], dAL[:, C:]
        dSt = torch.bmm(dOR, SinT)
        dqg, dkgb = dSt[:, :C], dSt[:, C:]
        dkd = torch.bmm(U, dSout.transpose(-1, -2))
        dq = torch.einsum("zrc,zrck->zrk", dA, Dk)
        dkb = torch.einsum("zrc,zrck->zrk", dL, Dk)  # grad of the beta k rows of L
        dkc = torch.einsum("zrc,zrck,zrk->zck", dA, D, qc) + torch.einsum("zrc,zrck,zrk->zck", dL, D, kbc)
        dG = dq * qc + dkb * kbc - dkc * kc  # exp(G_r - G_c): + on rows, - on columns
        dq += dqg * eG
        dkb += dkgb * eG
        dG += (dqg * qc + dkgb * kbc) * eG - dkd * kd
        dbeta = torch.einsum("zck,zck->zc", dkb, kc)
        dk = dkb * bc + dkc + dkd * ekd
        return (dq, None), (dk, None, None), dbeta, dG
    em, ki, eh = saved
    # rows of QK: from A / L (through ki) and from the state terms qg, kgb (= those rows * eh)
    Sh = SinT if eh is None else (Sin * eh.transpose(-1, -2)).transpose(-1, -2)
    dQK = torch.bmm(dAL, ki).baddbmm_(dOR, Sh)  # [Z, 2C, K]
    # ki: from A / L and from kd = ki * (gam or eh)
    dSf = dSout * (gam if eh is None else eh).transpose(-1, -2)
    dki = torch.bmm(dAL.transpose(-1, -2), QK).baddbmm_(U, dSf.transpose(-1, -2))  # [Z, C, K]
    # exp(G - m) on rows, exp(m - G) on ki; m is held fixed (it cancels in every product)
    dG = dQK[:, :C] * QK[:, :C]
    dG.addcmul_(dQK[:, C:], QK[:, C:]).addcmul_(dki, ki, value=-1.0)
    dkb = dQK[:, C:].mul_(em)  # grad of beta k
    dbeta = torch.einsum("zck,zck->zc", dkb, kc)
    # dq = dQK[0] * em, dk = dkb * beta + dki / em: finished by the caller, which writes them
    # straight into the output layout
    return (dQK[:, :C], em), (dkb, dki, em), dbeta, dG


class _ChunkKDA(torch.autograd.Function):
    """Chunked KDA with a hand-written backward.

    The forward keeps the per-chunk states and delta-rule errors; the backward runs the state
    hand-off in reverse (one short loop over chunks) and gets every other gradient from batched
    matmuls over all chunks, without an autograd graph of the intermediates.

    ``resets [B, T]`` (bool, or None): True at a chunk's first token zeroes the state entering that
    chunk (a document starts there); True only at multiples of ``chunk_size``.
    """

    @staticmethod
    def forward(
        ctx, q, k, v, g, beta, initial_state, scale, chunk_size, output_final_state, resets=None, compute_dtype=None
    ):
        B, T, H, K = q.shape
        V = v.shape[-1]
        dt = compute_dtype or _compute_dtype(q, k, v, g, beta, initial_state)
        BH = B * H
        C, G, mode = _choose_chunking(g, chunk_size, dt)  # G: [Z, C, K]
        N = G.shape[0] // BH
        Z = N * BH

        qc = _to_chunks(q, N, C, dt).view(Z, C, K)
        kc = _to_chunks(k, N, C, dt).view(Z, C, K)
        vc = _to_chunks(v, N, C, dt).view(Z, C, V)
        bc = _to_chunks(beta.unsqueeze(-1), N, C, dt).view(Z, C, 1)

        AL, QK, qg, kgb, kd, gam, saved = _intra_forward(mode, qc, kc, bc, G)
        A = AL[:, :C]  # [Z, C, C]
        Tm = _unit_lower_inverse(AL[:, C:])  # (I + L)^-1, [Z, C, C]
        # W = Tm kgb, U0 = Tm (beta v): the chunk's delta-rule errors are U = U0 - W S for the
        # state S entering it, and S' = gam S + kd^T U
        W = torch.bmm(Tm, kgb)  # [Z, C, K]
        U = torch.bmm(Tm, vc * bc).view(N, BH, C, V)  # U0 for now; the hand-off subtracts W S

        # keep[n] = 0 where a document starts at chunk n: the state entering it is zeroed
        keep = None
        if resets is not None:
            # the chunk size may have been halved: resets at multiples of chunk_size stay chunk starts
            keep = (~resets[:, ::C]).to(dt).t()  # [N, B]
            keep = keep[:, :, None].expand(N, B, H).reshape(N, BH, 1, 1)

        # sequential hand-off over chunks
        Sst = qc.new_empty(N + 1, BH, K, V)  # state entering each chunk, then the final one
        if initial_state is None:
            Sst[0].zero_()
        else:
            Sst[0].copy_(initial_state.reshape(BH, K, V))
        if keep is not None:
            Sst[0].mul_(keep[0])
        per_chunk = lambda x: x.unflatten(0, (N, BH)).unbind(0)  # noqa: E731
        steps = zip(
            per_chunk(W),
            per_chunk(gam.transpose(-1, -2)),
            per_chunk(kd.transpose(-1, -2)),
            U.unbind(0),
            Sst[:N].unbind(0),
            Sst[1:].unbind(0),
        )
        # in-place baddbmm_ / elementwise out= only: an out-of-place baddbmm copies its input
        # first and does not use the second core at these sizes
        for n, (W_n, gam_n, kdT_n, U_n, S_n, S_next) in enumerate(steps):
            U_n.baddbmm_(W_n, S_n, alpha=-1.0)  # [BH, C, V]
            torch.mul(S_n, gam_n, out=S_next)
            S_next.baddbmm_(kdT_n, U_n)
            if keep is not None and n + 1 < N:
                # stored as the next chunk's entering state; the final state is never reset
                S_next.mul_(keep[n + 1])

        Uz = U.view(Z, C, V)
        Sin = Sst[:N].view(Z, K, V)
        O = torch.bmm(A, Uz).baddbmm_(qg, Sin)  # [Z, C, V]
        o = _from_chunks(O.view(N, BH, C, V), B, T, v.dtype, scale)  # o is linear in q: scale here

        ctx.save_for_backward(kc, vc, bc, AL, QK, qg, kd, gam, Tm, W, Sst, U, *saved)
        ctx.mode = mode
        ctx.keep = keep
        ctx.meta = (B, T, H, K, V, C, N, dt, scale, initial_state is not None)
        ctx.in_dtypes = (
            q.dtype,
            k.dtype,
            v.dtype,
            g.dtype,
            beta.dtype,
            None if initial_state is None else initial_state.dtype,
        )
        final = Sst[N].view(B, H, K, V).clone() if output_final_state else None
        return o, final

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dfinal):
        kc, vc, bc, AL, QK, qg, kd, gam, Tm, W, Sst, U, *saved = ctx.saved_tensors
        B, T, H, K, V, C, N, dt, scale, has_init = ctx.meta
        BH, Z = B * H, N * B * H

        # dOR rows 0..C-1: dO (scale folded in), rows C..2C-1: -dR with R = beta (v - exp(G) k S)
        dOR = kc.new_empty(Z, 2 * C, V)
        dO = dOR[:, :C]
        dO.view(N, BH, C, V).copy_(_to_chunks(do, N, C, dt, op="scale", scale=scale))
        # -dU starts as -A^T dO; the hand-off adds -kd dS' chunk by chunk
        dUn = torch.baddbmm(dO, AL[:, :C].transpose(-1, -2), dO, beta=0.0, alpha=-1.0).view(N, BH, C, V)
        P = torch.bmm(qg.transpose(-1, -2), dO)  # [Z, K, V] readout's grad on the incoming state

        # reverse hand-off: dS[n] is the grad of the state entering chunk n
        dS = kc.new_empty(N + 1, BH, K, V)
        if dfinal is None:
            dS[N].zero_()
        else:
            dS[N].copy_(dfinal.reshape(BH, K, V))
        # dU = A^T dO + kd dS' and dS = P + gam dS' - W^T dU (U = U0 - W S); -dU is kept per chunk
        per_chunk = lambda x: x.unflatten(0, (N, BH)).unbind(0)  # noqa: E731
        steps = zip(
            per_chunk(kd),
            per_chunk(P),
            per_chunk(gam.transpose(-1, -2)),
            per_chunk(W.transpose(-1, -2)),
            dUn.unbind(0),
            dS[1:].unbind(0),
            dS[:N].unbind(0),
        )
        keep = ctx.keep
        for n, (kd_n, P_n, gam_n, WT_n, dUn_n, dS_next, dS_n) in reversed(list(enumerate(steps))):
            dUn_n.baddbmm_(kd_n, dS_next, alpha=-1.0)  # -dU   [BH, C, V]
            torch.addcmul(P_n, gam_n, dS_next, out=dS_n)
            dS_n.baddbmm_(WT_n, dUn_n)
            if keep is not None:
                # nothing flows through a zeroed hand-off: dS[n] becomes the grad of the state leaving
                # chunk n-1 (or of the initial state), zero where chunk n starts a document
                dS_n.mul_(keep[n])
        # U = Tm R with R = beta (v - exp(G) k S): -dR = Tm^T (-dU) (a bmm into a strided out=
        # would leave the fast path, hence the copy)
        dOR[:, C:] = torch.bmm(Tm.transpose(-1, -2), dUn.view(Z, C, V))

        Sin = Sst[:N].view(Z, K, V)
        dSout = dS[1:].view(Z, K, V)
        Uz = U.view(Z, C, V)
        UT = Uz.transpose(-1, -2)
        dAL = torch.bmm(dOR, UT)  # [Z, 2C, C] = [dA; dL]
        dAL[:, :C].tril_()
        dAL[:, C:].tril_(-1)
        dq, dk, dbeta, dG = _intra_backward(ctx.mode, dAL, dOR, Sin, Uz, dSout, QK, kc, bc, kd, gam, saved)
        # gam and kd carry exp(G_C) explicitly and S' scales with it: dG_C += sum_v dS' * S'
        # (before a reset Sst holds the zeroed state, not S', but dS' is zero there too)
        dG[:, -1] += torch.einsum("zkv,zkv->zk", dSout, Sst[1:].view(Z, K, V))
        dRn = dOR[:, C:]
        dbeta -= torch.einsum("zcv,zcv->zc", dRn, vc)
        # G is the inclusive cumsum of g: dg_r = sum_{r' >= r} dG_r'
        dg = torch.bmm(torch.ones(C, C, dtype=dt, device=dG.device).triu_().expand(Z, C, C), dG)

        q_dt, k_dt, v_dt, g_dt, b_dt, s_dt = ctx.in_dtypes
        chunked = lambda x: x.unflatten(0, (N, B, H))  # noqa: E731  [Z, C, D] -> [N, B, H, C, D]
        dq_out, dq_view = _chunk_output(B, H, K, N, C, q_dt, kc)
        if dq[1] is None:
            dq_view.copy_(chunked(dq[0]))
        else:
            torch.mul(chunked(dq[0]), chunked(dq[1]), out=dq_view)
        dk_out, dk_view = _chunk_output(B, H, K, N, C, k_dt, kc)
        dkb, dki, em = dk
        if dki is None:
            dk_view.copy_(chunked(dkb))
        else:
            torch.mul(chunked(dkb), chunked(bc), out=dk_view).addcdiv_(chunked(dki), chunked(em))
        dv_out, dv_view = _chunk_output(B, H, V, N, C, v_dt, kc)
        torch.mul(chunked(dRn), chunked(bc.neg()), out=dv_view)
        trim = lambda x: x if x.shape[1] == T else x[:, :T].contiguous()  # noqa: E731  drop the padding
        return (
            trim(dq_out),
            trim(dk_out),
            trim(dv_out),
            _from_chunks(dg.view(N, BH, C, K), B, T, g_dt),
            _from_chunks(dbeta.view(N, BH, C), B, T, b_dt),
            dS[0].view(B, H, K, V).to(s_dt) if has_init else None,
            None,
            None,
            None,
            None,
            None,
        )


def _chunk_output(B, H, D, N, C, dtype, like):
    # a fresh [B, N*C, H, D] buffer and its [N, B, H, C, D] view, so a chunk-layout result can be
    # written into the output layout by the op that produces it
    out = like.new_empty(B, N * C, H, D, dtype=dtype)
    return out, out.view(B, N, C, H, D).permute(1, 0, 3, 2, 4)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    segments: Segments | None = None,
    compute_dtype: torch.dtype | None = None,
    kernel: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA (WY / UT form, docs/k3.md §2.5); same contract and result as ``recurrent_kda``.

    ``chunk_size`` (a power of two >= 16) is the largest state hand-off granularity. Chunks are
    halved while some chunk's total log-decay exceeds 80 (fp32), i.e. never for gates whose
    mean per-step log-decay stays above -1.25 at the default 64; gates pinned at the K3 bound
    -5 run on 16-token chunks (about 2-3x slower), and softplus gates decaying harder still
    take an exact but slower pairwise path. T need not be a multiple of the chunk (zero padding:
    k = 0, beta = 0, g = 0 leave the state untouched). g must be <= 0, as everywhere in KDA.
    Gradients come from a hand-written backward that reuses the forward's per-chunk states.

    ``segments``: documents restart from a zero state (no ``initial_state`` then). Each row's
    documents are laid out back to back, each padded (k = 0, beta = 0, g = 0, v = 0, q = 0) to a
    multiple of an alignment <= ``chunk_size`` (``Segments.packing``: halved while the padding would
    grow the row by more than half), and the kernel zeroes the state entering every chunk that starts
    a document. The final state is the one after each row's last document.

    ``compute_dtype``: the dtype the chunked form computes in instead of fp32 (fp64 for fp64 inputs); bf16
    measures what bf16 arithmetic costs this algorithm (the tolerances of benchmarks/gpu_check.py).

    ``kernel``: ``batched`` (every step one PyTorch op over all chunks: any device), ``native`` (one native CPU
    kernel per (batch, head) pair, ``components/ops/kda_cpu.py``: CPU tensors, fp32 or fp64 compute, chunks
    whose log-decay spans its midpoint factorisation takes, at most halved to 16 tokens) or ``auto`` (native
    where it applies, batched elsewhere).
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    if chunk_size < _MIN_CHUNK or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= {_MIN_CHUNK}, got {chunk_size}")
    _check_segments(segments, q, initial_state)
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else scale
    if T == 0:
        S = None
        if output_final_state:
            dt = _compute_dtype(q, k, v, g, beta, initial_state)
            S = q.new_zeros(B, HV, K, V, dtype=dt) if initial_state is None else initial_state.to(dt).clone()
        return v.new_zeros(B, 0, HV, V), S
    q, k = _expand_heads(q, k, HV)
    o, final = _chunk_kda_apply(
        q, k, v, g, beta, initial_state, float(scale), chunk_size, output_final_state, segments, compute_dtype, kernel
    )
    return o, (final if output_final_state else None)


def _native_chunk(q, k, v, g, beta, initial_state, chunk_size, compute_dtype, kernel) -> int | None:
    """The chunk size the native kernel runs these inputs at, or None where the batched form runs them
    (``kernel="native"`` raises instead, naming why)."""
    if kernel == "batched":
        return None
    dt = _compute_dtype(q, k, v, g, beta, initial_state)
    why = None
    if q.device.type != "cpu":
        why = f"the inputs are on {q.device.type}, not the CPU"
    elif compute_dtype not in (None, dt):
        why = f"compute_dtype={compute_dtype} (it computes in {dt})"
    elif any(t.dtype not in (torch.bfloat16, torch.float32, torch.float64) for t in (q, k, v)):
        why = f"q/k/v are {q.dtype}/{k.dtype}/{v.dtype} (bf16, fp32 or fp64 only)"
    elif not native_available():
        why = "it could not be built on this machine"
    chunk = chunk_size
    if why is None:
        # the native kernel always factorises about the chunk midpoint: the batched form's "mid" limit
        gc, limit = g.to(dt).contiguous(), _SPAN_MID[dt]
        span = max_chunk_span(gc, chunk)
        while span > limit and chunk > _MIN_CHUNK:
            chunk //= 2
            span = max_chunk_span(gc, chunk)
        if span > limit:
            why = f"some {chunk}-token chunk decays by more than {limit:g} (log), beyond its factorisation"
    if why is None:
        return chunk
    if kernel == "native":
        raise ValueError(f"chunk_kda(kernel='native'): not applicable: {why}")
    return None


def _run_chunked(q, k, v, g, beta, initial_state, scale, chunk_size, output_final_state, resets, compute_dtype, kernel):
    chunk = _native_chunk(q, k, v, g, beta, initial_state, chunk_size, compute_dtype, kernel)
    if chunk is None:
        return _ChunkKDA.apply(
            q, k, v, g, beta, initial_state, scale, chunk_size, output_final_state, resets, compute_dtype
        )
    dt = _compute_dtype(q, k, v, g, beta, initial_state)
    # one dtype for q, k, v: theirs where they agree (bf16 stays bf16), the compute dtype where they do not
    io = q.dtype if q.dtype == k.dtype == v.dtype and dt != torch.float64 else dt
    o, final = native_chunk_kda(
        q.to(io), k.to(io), v.to(io), g.to(dt), beta.to(dt), scale, chunk, initial_state, resets
    )
    return o.to(v.dtype), (final.clone() if output_final_state else None)


@eager_island
def _chunk_kda_apply(
    q,
    k,
    v,
    g,
    beta,
    initial_state,
    scale,
    chunk_size,
    output_final_state,
    segments=None,
    compute_dtype=None,
    kernel="auto",
):
    # An opaque island inside a compiled region: the chunk size is chosen from the data (one host read of
    # the largest chunk log-decay), the hand-written backward loops over chunks, and every op inside is
    # already a batched matmul or a fused in-place update, so tracing it would gain nothing. With
    # segments the document layout (another host read, sizes from the data) is made here too, so a
    # compiled layer sees the same shapes whatever the documents.
    if segments is None:
        return _run_chunked(
            q, k, v, g, beta, initial_state, scale, chunk_size, output_final_state, None, compute_dtype, kernel
        )
    T = q.shape[1]
    packing = segments.packing(chunk_size, _MIN_CHUNK)
    packed = [packing.pack(x) for x in (q, k, v, g, beta)]  # [B, length, ...], zeros between documents
    o, final = _run_chunked(
        *packed, initial_state, scale, packing.align, output_final_state, packing.starts, compute_dtype, kernel
    )
    return packing.unpack(o, T), final
