"""Kimi Delta Attention (KDA) core ops in pure PyTorch (K3 spec section 2).

Per head, with state ``S`` of shape ``[K, V]`` (key channels first), per-channel log-decay
``g_t <= 0`` and write strength ``beta_t``:

    S  <- Diag(exp(g_t)) S                   # decay rows (key channels)
    u  =  beta_t * (v_t - S^T k_t)           # delta-rule error
    S  <- S + k_t u^T
    o_t = S^T (scale * q_t)

``recurrent_kda`` runs this token by token (the reference); ``chunk_kda`` is the chunked WY/UT
form (spec 2.5) with a hand-written backward. Both follow the contract of fla's naive
references: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` (HV a multiple of H); g ``[B, T, HV, K]``
already gated; beta ``[B, T, HV]`` post-sigmoid; states ``[B, HV, K, V]``; q/k are not
L2-normalised here. Math runs in fp32 (fp64 for fp64 inputs); ``o`` comes back in v's dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["chunk_kda", "kda_gate", "l2norm", "recurrent_kda"]

# Sub-block size for the factorised intra-chunk products: within 16 tokens a gate bounded by
# -5 per step moves the cumulative log-decay by at most 80, so exp(+-40) around the block's
# midpoint stays far from fp32 overflow (spec 2.3).
_SUB = 16

# exp() factors whose log is below this are flushed to zero. A dropped factor is a decay
# smaller than exp(floor) (negligible next to fp32 round-off), and keeping products of two
# kept factors above ~exp(-70) keeps CPU matmuls clear of denormals, which run ~50x slower.
_LOG_FLOOR = {torch.float32: -35.0, torch.float64: -300.0}
# Largest |G - midpoint| inside a sub-block for which the factorised diagonal blocks are used;
# beyond it (softplus gates with huge decays) those blocks fall back to explicit pairwise decays.
_HALF_SPAN = {torch.float32: 40.0, torch.float64: 300.0}


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    # fp32 math for half types; fp64 inputs stay fp64 so float64 tests can be tight
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
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
    """Log-space decay gate ``g`` from the raw forget projection ``f`` ``[..., H, K]`` (fp32 out).

    * ``lower_bound=None`` (Kimi Linear / fla default): ``g = -exp(A_log) * softplus(f + dt_bias)``,
      in ``(-inf, 0)``.
    * ``lower_bound=L`` (K3 uses L = -5): ``g = L * sigmoid(exp(A_log) * (f + dt_bias))``, in ``(L, 0)``.

    ``A_log`` has one entry per head ``[H]`` (None means exp(A_log) = 1), ``dt_bias`` one per
    (head, channel) ``[H * K]``.
    """
    H, K = f.shape[-2:]
    x = f.float()
    if dt_bias is not None:
        x = x + dt_bias.float().view(H, K)
    a = A_log.float().exp().view(H, 1) if A_log is not None else None
    if lower_bound is None:
        sp = F.softplus(x)
        return -sp if a is None else -a * sp
    return lower_bound * torch.sigmoid(x if a is None else a * x)


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA recurrence (spec 2.4): the slow, obviously-correct reference.

    Differentiable through plain autograd. Returns ``(o [B, T, HV, V], S [B, HV, K, V] or None)``.
    """
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
    outs = []
    # unbind once: indexing x[:, t] inside the loop would make autograd scatter a full-size
    # gradient per step (quadratic in T)
    for q_t, k_t, v_t, a_t, b_t in zip(q.unbind(1), k.unbind(1), v.unbind(1), alpha.unbind(1), beta.unbind(1)):
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
# Per chunk of C tokens, with G the inclusive in-chunk cumsum of g, S the state entering the
# chunk and the scale folded into q (spec 2.5):
#   A  = [q_r . (exp(G_r - G_c) * k_c)]_{c <= r}              query-key products   [C, C]
#   L  = [beta_r k_r . (exp(G_r - G_c) * k_c)]_{c < r}        key-key products     [C, C]
#   Tm = (I + L)^-1                                            UT transform
#   U  = Tm (beta * v - (beta * exp(G) * k) S)                 delta-rule errors    [C, V]
#   O  = (exp(G) * q) S + A U
#   S' = exp(G_C) * S + (exp(G_C - G) * k)^T U
# Everything except the S -> S' hand-off is batched over all chunks at once.

# Pairwise decays exp(G_r - G_c) are factorised as exp(G_r - m) * exp(m - G_c) with m the middle
# of the chunk's log-decay range, so each factor stays within exp(+-_MAX_EXP). That needs the
# chunk's total log-decay (its "span") to be at most 2 * _MAX_EXP; chunks are halved (down to
# 16 tokens, where a gate bounded by -5 spans at most 80) until it is. In fp32 40 keeps even the
# masked-out upper-triangle products finite and every kept decay above exp(-80), clear of
# denormals (they make CPU matmuls ~50x slower).
_MAX_EXP = {torch.float32: 40.0, torch.float64: 300.0}
# Softplus gates are unbounded: if a 16-token chunk still spans more, the decays are formed
# pairwise (masked before exp) and factors below exp(_LOG_FLOOR) are flushed to zero.
_LOG_FLOOR = {torch.float32: -35.0, torch.float64: -300.0}
_MIN_CHUNK = 16


def _to_chunks(x: torch.Tensor, N: int, C: int, dt: torch.dtype) -> torch.Tensor:
    # [B, T, H, *D] -> fresh contiguous [N, B*H, C, *D] in dtype dt, zero-padded in time
    B, T, H = x.shape[:3]
    rest = x.shape[3:]
    full = T // C
    out = x.new_empty(N, B, H, C, *rest, dtype=dt)
    o5 = out.movedim(0, 1).movedim(3, 2)  # [B, N, C, H, ...] view of out
    if full:
        o5[:, :full].copy_(x[:, : full * C].unflatten(1, (full, C)))
    if full < N:  # ragged last chunk
        tail = T - full * C
        o5[:, full, :tail].copy_(x[:, full * C :])
        o5[:, full, tail:].zero_()
    return out.view(N, B * H, C, *rest)


def _from_chunks(x: torch.Tensor, B: int, T: int, dtype: torch.dtype) -> torch.Tensor:
    # [N, B*H, C, *D] -> [B, T, H, *D]
    N, BH, C = x.shape[:3]
    x = x.reshape(N, B, BH // B, C, *x.shape[3:]).movedim(0, 1).movedim(3, 2)  # [B, N, C, H, ...]
    return x.reshape(B, N * C, *x.shape[3:])[:, :T].to(dtype)


def _exp_floored(x: torch.Tensor, floor: float) -> torch.Tensor:
    # exp(x) with results below exp(floor) flushed to exactly 0; x is a temporary
    return x.masked_fill_(x < floor, -math.inf).exp_()


def _tril_mask(C: int, diagonal: int, device: torch.device) -> torch.Tensor:
    # True strictly above the kept triangle (what masked_fill_ clears)
    return torch.ones(C, C, dtype=torch.bool, device=device).triu(diagonal + 1)


def _unit_lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """``(I + L)^-1`` for strictly lower-triangular ``L [Z, C, C]`` (C a power of two).

    Recursive doubling on the block-triangular inverse: with the inverses of the two diagonal
    halves known, the lower-left block of ``[[A, 0], [B, D]]^-1`` is ``-D^-1 B A^-1``.
    """
    Z, C, _ = L.shape
    Tm = torch.zeros_like(L)
    Tm.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    s = 1
    while s < C:
        nb = C // (2 * s)
        # [Z, nb, 2s, 2s] views of the diagonal 2s-blocks
        Tv = torch.diagonal(Tm.view(Z, nb, 2 * s, nb, 2 * s), dim1=1, dim2=3).permute(0, 3, 1, 2)
        Lv = torch.diagonal(L.view(Z, nb, 2 * s, nb, 2 * s), dim1=1, dim2=3).permute(0, 3, 1, 2)
        Tv[..., s:, :s] = -(Tv[..., s:, s:] @ Lv[..., s:, :s] @ Tv[..., :s, :s])
        s *= 2
    return Tm


class _Factorised:
    """In-chunk products through exp(G - m) and exp(m - G), m = G_C / 2 per chunk and channel.

    m cancels in every product, so it is held constant in the backward; the whole-chunk decay
    exp(G_C) = exp(m)^2 is what carries the real dependence on G_C.
    """

    @staticmethod
    def forward(qc, kc, bc, G):
        # qc, kc, G: [Z, C, K]; bc: [Z, C, 1]
        C = G.shape[-2]
        m = 0.5 * G[:, -1:]  # [Z, 1, K]
        em = torch.sub(G, m).exp_()  # exp(G - m), within exp(+-span/2)
        ehalf = m.exp()  # exp(m) = exp(G_C - m)
        qm = qc * em
        kmb = (kc * em).mul_(bc)
        ki = kc / em  # k exp(m - G)
        A = torch.bmm(qm, ki.transpose(-1, -2)).masked_fill_(_tril_mask(C, 0, G.device), 0)  # [Z, C, C]
        L = torch.bmm(kmb, ki.transpose(-1, -2)).masked_fill_(_tril_mask(C, -1, G.device), 0)
        qg = qm * ehalf  # q exp(G)
        kgb = kmb * ehalf  # beta k exp(G)
        kd = ki * ehalf  # k exp(G_C - G)
        gam = ehalf.square()  # exp(G_C), [Z, 1, K]
        return A, L, qg, kgb, kd, gam, (qm, kmb, ki, em, ehalf)

    @staticmethod
    def backward(dA, dL, dqg, dkgb, dkd, dgam, qc, kc, bc, kd, gam, saved):
        qm, kmb, ki, em, ehalf = saved
        dqm = torch.bmm(dA, ki).addcmul_(dqg, ehalf)
        dkmb = torch.bmm(dL, ki).addcmul_(dkgb, ehalf)
        dki = torch.bmm(dA.transpose(-1, -2), qm).baddbmm_(dL.transpose(-1, -2), kmb).addcmul_(dkd, ehalf)
        dq = dqm * em
        t = dkmb.mul_(em)  # grad of beta * k
        dbeta = (t * kc).sum(-1)  # [Z, C]
        dk = (t * bc).addcdiv_(dki, em)
        dG = (dq * qc).addcmul_(t, kc * bc).addcmul_(dki, ki, value=-1.0)
        dG[:, -1] += (dkd * kd).sum(-2) + (dgam * gam).squeeze(-2)
        return dq, dk, dbeta, dG


class _Pairwise:
    """In-chunk products from explicit pairwise decays [Z, C, C, K] (masked before exp).

    Only used for 16-token chunks whose log-decay spans more than 2 * _MAX_EXP (softplus gates
    with huge decays), where the factorised form would overflow.
    """

    @staticmethod
    def forward(qc, kc, bc, G):
        C = G.shape[-2]
        floor = _LOG_FLOOR[G.dtype]
        x = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill_(_tril_mask(C, 0, G.device)[..., None], -math.inf)
        D = _exp_floored(x, floor)  # [Z, C(r), C(c), K], exp(G_r - G_c) for c <= r
        kbc = kc * bc
        Dk = D * kc.unsqueeze(-3)  # D_rc * k_c
        A = torch.einsum("zrk,zrck->zrc", qc, Dk)
        L = torch.einsum("zrk,zrck->zrc", kbc, Dk).masked_fill_(_tril_mask(C, -1, G.device), 0)
        eG = _exp_floored(G.clone(), floor)
        ekd = _exp_floored(G[:, -1:] - G, floor)
        qg = qc * eG
        kgb = kbc * eG
        kd = kc * ekd
        gam = eG[:, -1:]
        return A, L, qg, kgb, kd, gam, (D, Dk, kbc, eG, ekd)

    @staticmethod
    def backward(dA, dL, dqg, dkgb, dkd, dgam, qc, kc, bc, kd, gam, saved):
        D, Dk, kbc, eG, ekd = saved
        dq = torch.einsum("zrc,zrck->zrk", dA, Dk)  # intra-chunk part
        dkb = torch.einsum("zrc,zrck->zrk", dL, Dk)  # grad of the beta k rows of L
        dkc = torch.einsum("zrc,zrck,zrk->zck", dA, D, qc) + torch.einsum("zrc,zrck,zrk->zck", dL, D, kbc)
        dG = dq * qc + dkb * kbc - dkc * kc  # exp(G_r - G_c): + on rows, - on columns
        dq += dqg * eG
        dkb += dkgb * eG  # kgb = (beta k) exp(G)
        dG += dqg * qc * eG + dkgb * kbc * eG - dkd * kd
        dbeta = (dkb * kc).sum(-1)
        dk = dkb * bc + dkc + dkd * ekd
        dG[:, -1] += (dkd * kd).sum(-2) + (dgam * gam).squeeze(-2)
        return dq, dk, dbeta, dG


class _ChunkKDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, chunk_size, output_final_state):
        B, T, H, K = q.shape
        V = v.shape[-1]
        dt = _compute_dtype(q, k, v, g, beta, initial_state)
        BH = B * H

        # largest chunk (<= chunk_size) whose log-decay span the factorised form can take
        C = chunk_size
        while True:
            N = max(1, -(-T // C))
            G = _to_chunks(g, N, C, dt).cumsum_(-2)  # [N, BH, C, K] inclusive in-chunk log-decay
            span_ok = bool((G[:, :, -1].amin() if G.numel() else 0.0) >= -2 * _MAX_EXP[dt])
            if span_ok or C <= _MIN_CHUNK:
                break
            C //= 2
        path = _Factorised if span_ok else _Pairwise
        Z = N * BH

        qc = _to_chunks(q, N, C, dt).mul_(scale).view(Z, C, K)
        kc = _to_chunks(k, N, C, dt).view(Z, C, K)
        vc = _to_chunks(v, N, C, dt).view(Z, C, V)
        bc = _to_chunks(beta.unsqueeze(-1), N, C, dt).view(Z, C, 1)

        A, L, qg, kgb, kd, gam, saved = path.forward(qc, kc, bc, G.view(Z, C, K))
        Tm = _unit_lower_inverse(L)  # [Z, C, C]
        vb = vc * bc

        # sequential hand-off over chunks
        Sst = qc.new_empty(N + 1, BH, K, V)  # state entering each chunk, then the final one
        if initial_state is None:
            Sst[0].zero_()
        else:
            Sst[0].copy_(initial_state.reshape(BH, K, V))
        U = qc.new_empty(N, BH, C, V)
        steps = zip(
            vb.view(N, BH, C, V).unbind(0),
            kgb.view(N, BH, C, K).unbind(0),
            Tm.view(N, BH, C, C).unbind(0),
            gam.view(N, BH, K, 1).unbind(0) if False else gam.view(N, BH, 1, K).transpose(-1, -2).unbind(0),
            kd.view(N, BH, C, K).transpose(-1, -2).unbind(0),
            U.unbind(0),
            Sst[:N].unbind(0),
            Sst[1:].unbind(0),
        )
        for vb_n, kgb_n, Tm_n, gam_n, kdT_n, U_n, S_n, S_next in steps:
            R = torch.baddbmm(vb_n, kgb_n, S_n, alpha=-1.0)  # beta (v - exp(G) k S)   [BH, C, V]
            torch.bmm(Tm_n, R, out=U_n)  # [BH, C, V]
            torch.mul(S_n, gam_n, out=S_next)
            S_next.baddbmm_(kdT_n, U_n)

        Uz = U.view(Z, C, V)
        O = torch.bmm(A, Uz).baddbmm_(qg, Sst[:N].view(Z, K, V))  # [Z, C, V]
        o = _from_chunks(O.view(N, BH, C, V), B, T, v.dtype)

        ctx.save_for_backward(qc, kc, vc, bc, qg, kgb, kd, gam, A, Tm, Sst, U, *saved)
        ctx.n_saved = len(saved)
        ctx.path = path
        ctx.meta = (B, T, H, K, V, C, N, dt, scale, initial_state is not None)
        ctx.in_dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype,
                         None if initial_state is None else initial_state.dtype)
        final = Sst[N].view(B, H, K, V).clone() if output_final_state else None
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        qc, kc, vc, bc, qg, kgb, kd, gam, A, Tm, Sst, U, *saved = ctx.saved_tensors
        B, T, H, K, V, C, N, dt, scale, has_init = ctx.meta
        BH, Z = B * H, N * B * H

        dO = _to_chunks(do, N, C, dt).view(Z, C, V)
        Sin = Sst[:N].view(Z, K, V)
        Uz = U.view(Z, C, V)
        AtdO = torch.bmm(A.transpose(-1, -2), dO)  # [Z, C, V]
        P = torch.bmm(qg.transpose(-1, -2), dO)  # [Z, K, V] readout's grad on the incoming state

        # reverse hand-off: dS[n] is the grad of the state entering chunk n
        dS = qc.new_empty(N + 1, BH, K, V)
        if dfinal is None:
            dS[N].zero_()
        else:
            dS[N].copy_(dfinal.reshape(BH, K, V))
        dR = qc.new_empty(N, BH, C, V)  # grad of R = beta (v - exp(G) k S)
        steps = zip(
            AtdO.view(N, BH, C, V).unbind(0),
            kd.view(N, BH, C, K).unbind(0),
            Tm.view(N, BH, C, C).transpose(-1, -2).unbind(0),
            P.view(N, BH, K, V).unbind(0),
            gam.view(N, BH, 1, K).transpose(-1, -2).unbind(0),
            kgb.view(N, BH, C, K).transpose(-1, -2).unbind(0),
            dR.unbind(0),
            dS[1:].unbind(0),
            dS[:N].unbind(0),
        )
        for AtdO_n, kd_n, TmT_n, P_n, gam_n, kgbT_n, dR_n, dS_next, dS_n in reversed(list(steps)):
            dU = torch.baddbmm(AtdO_n, kd_n, dS_next)  # [BH, C, V]
            torch.bmm(TmT_n, dU, out=dR_n)
            torch.addcmul(P_n, gam_n, dS_next, out=dS_n)
            dS_n.baddbmm_(kgbT_n, dR_n, alpha=-1.0)

        dRz = dR.view(Z, C, V)
        dSout = dS[1:].view(Z, K, V)
        UT = Uz.transpose(-1, -2)
        dA = torch.bmm(dO, UT).masked_fill_(_tril_mask(C, 0, qc.device), 0)  # [Z, C, C]
        dL = torch.baddbmm(A, dRz, UT, beta=0.0, alpha=-1.0).masked_fill_(_tril_mask(C, -1, qc.device), 0)
        dqg = torch.bmm(dO, Sin.transpose(-1, -2))  # [Z, C, K]
        dkgb = torch.baddbmm(qg, dRz, Sin.transpose(-1, -2), beta=0.0, alpha=-1.0)
        dkd = torch.bmm(Uz, dSout.transpose(-1, -2))
        dgam = (dSout * Sin).sum(-1).unsqueeze(-2)  # [Z, 1, K]

        dq, dk, dbeta, dG = ctx.path.backward(dA, dL, dqg, dkgb, dkd, dgam, qc, kc, bc, kd, gam, saved)
        dv = dRz * bc
        dbeta += (dRz * vc).sum(-1)
        # G is the inclusive cumsum of g: dg_r = sum_{r' >= r} dG_r'
        dg = dG.flip(-2).cumsum(-2).flip(-2)
        dq *= scale

        q_dt, k_dt, v_dt, g_dt, b_dt, s_dt = ctx.in_dtypes
        shp = (N, BH, C)
        return (
            _from_chunks(dq.view(*shp, K), B, T, q_dt),
            _from_chunks(dk.view(*shp, K), B, T, k_dt),
            _from_chunks(dv.view(*shp, V), B, T, v_dt),
            _from_chunks(dg.view(*shp, K), B, T, g_dt),
            _from_chunks(dbeta.view(*shp), B, T, b_dt),
            dS[0].view(B, H, K, V).to(s_dt) if has_init else None,
            None,
            None,
            None,
        )


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA (WY / UT form, spec 2.5); same contract and result as ``recurrent_kda``.

    ``chunk_size`` (a power of two >= 16) is the largest state hand-off granularity; chunks are
    halved while a chunk's total log-decay would overflow the factorised products (never for
    gates whose per-step log-decay stays above -1.25 at the default 64). T need not be a
    multiple of it (zero padding: k = 0, beta = 0, g = 0 leave the state untouched). Gradients
    come from a hand-written backward that reuses the forward's per-chunk states.
    """
    if chunk_size < _MIN_CHUNK or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= {_MIN_CHUNK}, got {chunk_size}")
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    q, k = _expand_heads(q, k, v.shape[2])
    o, final = _ChunkKDA.apply(q, k, v, g, beta, initial_state, float(scale), chunk_size, output_final_state)
    return o, (final if output_final_state else None)
