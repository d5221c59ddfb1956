"""AttnRes read (docs/k3.md §7.1 / 7.3 / 10.10 item 10): closed-form cases, loop reference, fla parity, grads."""

import warnings

import pytest
import torch

from components.ops.attnres import _read_fla, attnres_read, attnres_read_reference

K3_EPS = 1e-5
D = 32

TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.float64: dict(rtol=1e-12, atol=1e-12),
}


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _inputs(S, lead, dtype=torch.float32, d=D, seed=0, grad=False):
    """Random sources [S, *lead, d] with per-source scales, plus a random query and gain [d]."""
    g = _gen(seed)
    scales = torch.linspace(0.5, 3.0, S, dtype=torch.float64).view(S, *([1] * (len(lead) + 1)))
    u = (torch.randn(S, *lead, d, generator=g, dtype=torch.float64) * scales).to(dtype)  # [S, *lead, d]
    pdt = torch.float64 if dtype == torch.float64 else torch.float32  # parameters stay fp32 for half sources
    q = (0.3 * torch.randn(d, generator=g, dtype=torch.float64)).to(pdt)
    gain = (1.0 + 0.2 * torch.randn(d, generator=g, dtype=torch.float64)).to(pdt)
    if grad:
        u.requires_grad_(True)
        q.requires_grad_(True)
        gain.requires_grad_(True)
    return u, q, gain


def _naive_attnres():
    pytest.importorskip("einops")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fla warns that triton falls back to CPU here
        naive = pytest.importorskip("fla.ops.attnres.naive")
    return naive.naive_attnres


# ---------------------------------------------------------------- closed-form cases (10.10 item 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("as_list", [False, True])
def test_zero_query_gives_mean_of_sources(dtype, as_list):
    u, _, gain = _inputs(5, (2, 3), dtype)  # any gain: a zero query kills every score
    q = torch.zeros(D, dtype=dtype)
    out, w = attnres_read(list(u) if as_list else u, q, gain, return_weights=True)
    torch.testing.assert_close(w, torch.full_like(w, 1 / 5), rtol=0, atol=1e-7)
    torch.testing.assert_close(out, u.mean(dim=0), **TOL[dtype])


@pytest.mark.parametrize("target", [0, 2, 3])
def test_large_aligned_query_returns_that_raw_source(target):
    S, B, T = 4, 2, 3
    g = _gen(1)
    v = torch.randn(D, generator=g)  # one direction for the target source at every token
    mags = 1.0 + 4.0 * torch.rand(B, T, 1, generator=g)  # [B, T, 1] distinct magnitudes: output must be raw
    sources = [torch.randn(B, T, D, generator=g) for _ in range(S)]  # other sources: random directions
    sources[target] = mags * v  # [B, T, d]
    gain = 0.5 + torch.rand(D, generator=g)

    k_t = v / v.pow(2).mean().sqrt()  # normalised target source
    # directions must be distinct, or the read cannot single the target out
    for i, s in enumerate(sources):
        if i != target:
            cos = torch.nn.functional.cosine_similarity(s, k_t.expand_as(s), dim=-1)
            assert cos.max() < 0.9
    # gain * query = alpha * k_t: the folded query points along the normalised target
    q = 10.0 * k_t / gain

    out, w = attnres_read(sources, q, gain, eps=K3_EPS, return_weights=True)
    torch.testing.assert_close(w[target], torch.ones(B, T))
    torch.testing.assert_close(out, sources[target])
    assert not torch.allclose(out, k_t.expand_as(out))  # raw, not normalised


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_sum_to_one_with_shape_S_lead(dtype):
    u, q, gain = _inputs(6, (2, 5), dtype)
    out, w = attnres_read(u, q, gain, return_weights=True)
    assert out.shape == (2, 5, D) and out.dtype == dtype
    assert w.shape == (6, 2, 5) and w.dtype == torch.float32
    assert (w >= 0).all()
    torch.testing.assert_close(w.sum(dim=0), torch.ones(2, 5))


def test_single_source_is_identity():
    u, q, gain = _inputs(1, (3, 4))
    out, w = attnres_read(u, q, gain, return_weights=True)
    assert torch.equal(out, u[0])
    assert torch.equal(w, torch.ones(1, 3, 4))


# ---------------------------------------------------------------- loop reference and fla's naive_attnres


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("S", [1, 2, 5, 9])
@pytest.mark.parametrize("lead", [(), (7,), (2, 5)])
@pytest.mark.parametrize("as_list", [False, True])
def test_matches_loop_reference(dtype, S, lead, as_list):
    u, q, gain = _inputs(S, lead, dtype, seed=S)
    out = attnres_read(list(u) if as_list else u, q, gain, eps=K3_EPS)
    ref = attnres_read_reference(list(u), q, gain, eps=K3_EPS)
    assert out.shape == (*lead, D) and out.dtype == dtype
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("S", [1, 3, 9])
def test_matches_fla_naive_attnres(S):
    naive_attnres = _naive_attnres()
    u, q, gain = _inputs(S, (2, 6), seed=10 + S)
    out, w = attnres_read(u, q, gain, eps=K3_EPS, return_weights=True)
    o_fla, p_fla = naive_attnres(q, list(u), gain, rms_eps=K3_EPS, scale=1.0, return_weights=True)
    torch.testing.assert_close(out, o_fla, **TOL[torch.float32])
    torch.testing.assert_close(w, p_fla, **TOL[torch.float32])


@pytest.mark.parametrize("S", [1, 4])
def test_fla_adapter_wiring_on_cpu(monkeypatch, S):
    # the fla path's plumbing (unbind, flattening, eps, scale, weights layout, the custom ops' autograd) with
    # fla's two launches replaced by torch functions of the same signatures (tests/kernel_fakes.py)
    from tests.kernel_fakes import torch_kernels

    launches = torch_kernels(monkeypatch)
    u, q, gain = _inputs(S, (3, 5), seed=3, grad=True)
    gy = torch.randn(3, 5, D, generator=_gen(1))
    out, w = attnres_read(u, q, gain, eps=K3_EPS, return_weights=True)
    ref_grads = torch.autograd.grad((out * gy).sum(), [u, q, gain])
    for stacked, srcs in ((u, None), (None, list(u))):
        o, p = _read_fla(stacked, srcs, q, gain, K3_EPS, True)
        torch.testing.assert_close(o, out, **TOL[torch.float32])
        torch.testing.assert_close(p, w, **TOL[torch.float32])
        assert not p.requires_grad  # the weights are a diagnostic
        for a, b in zip(torch.autograd.grad((o * gy).sum(), [u, q, gain]), ref_grads):
            torch.testing.assert_close(a, b, **TOL[torch.float32])
    assert launches["attnres"] > 0


def test_fla_custom_ops_are_consistent(monkeypatch):
    # schema, shape functions and autograd registration of the kernel's ops (what torch.compile relies on)
    from tests.kernel_fakes import torch_kernels

    torch_kernels(monkeypatch)
    u, q, gain = _inputs(3, (2, 4), seed=5)
    srcs = [x.reshape(-1, D).requires_grad_(True) for x in u]
    torch.library.opcheck(
        torch.ops.k3.attnres_read_fla, (q.requires_grad_(True), gain.requires_grad_(True), srcs, K3_EPS)
    )


def test_fla_kernels_are_looked_up_where_fla_has_them():
    # the fla-core functions the fla path launches, with the signatures it calls them with
    import inspect

    pytest.importorskip("fla.ops.attnres.fused")
    from components.ops.attnres import _fla_kernels

    forward, backward, _ = _fla_kernels()
    assert {"q", "residuals", "res", "w", "ow", "eps", "scale", "checkpoint_level"} <= set(
        inspect.signature(forward).parameters
    )
    assert {"do", "o_pre", "rstd", "logit", "lse"} <= set(inspect.signature(backward).parameters)


def test_bf16_input_uses_fp32_math():
    u, q, gain = _inputs(5, (4, 8), seed=7)
    u16 = u.to(torch.bfloat16)
    out, w = attnres_read(u16, q, gain, return_weights=True)
    assert out.dtype == torch.bfloat16 and w.dtype == torch.float32
    ref32 = attnres_read_reference(list(u16.float()), q, gain)  # same bf16 values, fp32 math
    torch.testing.assert_close(out, ref32.to(torch.bfloat16), rtol=2**-7, atol=0)
    _, w32 = attnres_read(u16.float(), q, gain, return_weights=True)
    torch.testing.assert_close(w, w32, **TOL[torch.float32])


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize("as_list", [False, True])
@pytest.mark.parametrize("S", [1, 4])
def test_grads_match_loop_reference(as_list, S):
    u, q, gain = _inputs(S, (2, 3), torch.float64, seed=20 + S, grad=True)
    upstream = torch.randn(2, 3, D, generator=_gen(5), dtype=torch.float64)

    srcs = [x.detach().clone().requires_grad_(True) for x in u] if as_list else None
    out = attnres_read(srcs if as_list else u, q, gain)
    grads = torch.autograd.grad((out * upstream).sum(), [*(srcs if as_list else [u]), q, gain])
    g_src = torch.stack(grads[:-2]) if as_list else grads[0]

    u_ref = u.detach().clone().requires_grad_(True)
    q_ref = q.detach().clone().requires_grad_(True)
    gain_ref = gain.detach().clone().requires_grad_(True)
    ref = attnres_read_reference(list(u_ref), q_ref, gain_ref)
    r_src, r_q, r_gain = torch.autograd.grad((ref * upstream).sum(), [u_ref, q_ref, gain_ref])

    for a, b in ((g_src, r_src), (grads[-2], r_q), (grads[-1], r_gain)):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, **TOL[torch.float64])
    if S > 1:
        assert r_q.abs().sum() > 0 and r_gain.abs().sum() > 0


def test_gradcheck():
    u, q, gain = _inputs(3, (2,), torch.float64, d=6, seed=4, grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: attnres_read(a, b, c), (u, q, gain))


def test_bf16_grads_flow():
    u, q, gain = _inputs(4, (3, 4), seed=8)
    u16 = u.to(torch.bfloat16).requires_grad_(True)
    q.requires_grad_(True)
    gain.requires_grad_(True)
    attnres_read(u16, q, gain).float().square().sum().backward()
    assert u16.grad.dtype == torch.bfloat16 and q.grad.dtype == torch.float32
    u32 = u16.detach().float().requires_grad_(True)
    q2, gain2 = q.detach().clone().requires_grad_(True), gain.detach().clone().requires_grad_(True)
    attnres_read_reference(list(u32), q2, gain2).square().sum().backward()
    torch.testing.assert_close(u16.grad.float(), u32.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(q.grad, q2.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gain.grad, gain2.grad, rtol=2e-2, atol=2e-2)


def test_backward_keeps_no_upcast_copy_of_sources():
    # the only [.., d]-sized tensors autograd keeps are the caller's own sources
    srcs = [x.requires_grad_(True) for x in _inputs(5, (4, 8), torch.bfloat16)[0].unbind(0)]
    q = torch.randn(D, requires_grad=True)
    gain = torch.ones(D, requires_grad=True)
    src_storage = {s.untyped_storage().data_ptr() for s in srcs}
    extra = []

    def pack(t):
        if t.shape[-1:] == (D,) and t.dim() > 1 and t.untyped_storage().data_ptr() not in src_storage:
            extra.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attnres_read(srcs, q, gain)
    assert extra == []


# ---------------------------------------------------------------- backends and argument checks


def test_fla_backend_on_cpu_raises_clear_error():
    u, q, gain = _inputs(3, (2,))
    with pytest.raises(RuntimeError, match="needs CUDA"):
        attnres_read(u, q, gain, backend="fla")


def test_auto_backend_on_cpu_is_torch():
    u, q, gain = _inputs(3, (2, 4))
    assert torch.equal(attnres_read(u, q, gain, backend="auto"), attnres_read(u, q, gain))


def test_bad_arguments():
    u, q, gain = _inputs(3, (2,))
    with pytest.raises(ValueError, match="backend"):
        attnres_read(u, q, gain, backend="cuda")
    with pytest.raises(ValueError, match="at least one"):
        attnres_read([], q, gain)
    with pytest.raises(ValueError, match="query"):
        attnres_read(u, q[:-1], gain)
    with pytest.raises(ValueError, match="share"):
        attnres_read([u[0], u[1].double()], q, gain)
    # a Linear(d, 1) weight [1, d] is accepted as the query
    torch.testing.assert_close(attnres_read(u, q.view(1, D), gain), attnres_read(u, q, gain))


# ---------------------------------------------------------------- fused kernel (GPU only)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(5, 2, 64, 256), (9, 1, 7, 64)])  # S=9: more sources than fla's 8-slot table
@pytest.mark.parametrize("as_list", [False, True])
def test_fla_backend_matches_torch_on_cuda(shape, as_list):
    pytest.importorskip("fla.ops.attnres.fused")
    S, B, T, d = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    u = torch.randn(S, B, T, d, device="cuda", generator=g).to(torch.bfloat16)  # [S, B, T, d]
    q = 0.3 * torch.randn(d, device="cuda", generator=g)
    gain = 1.0 + 0.2 * torch.randn(d, device="cuda", generator=g)
    upstream = torch.randn(B, T, d, device="cuda", generator=g).to(torch.bfloat16)

    results = {}
    for backend in ("torch", "fla"):
        u_ = u.clone().requires_grad_(True)
        q_ = q.clone().requires_grad_(True)
        gain_ = gain.clone().requires_grad_(True)
        out, w = attnres_read(list(u_) if as_list else u_, q_, gain_, eps=K3_EPS, return_weights=True, backend=backend)
        (out.float() * upstream.float()).sum().backward()
        results[backend] = (out, w, u_.grad, q_.grad, gain_.grad)

    for name, a, b in zip(("out", "weights", "d_sources", "d_query", "d_gain"), results["fla"], results["torch"]):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        scale = b.float().abs().max().clamp_min(1.0)
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * scale.item(), msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_backend_rejects_unaligned_rows_and_auto_falls_back():
    u = torch.randn(3, 2, 5, 20, device="cuda", dtype=torch.bfloat16)  # 20 * 2 bytes per row
    q, gain = torch.randn(20, device="cuda"), torch.ones(20, device="cuda")
    with pytest.raises(ValueError, match="16 bytes"):
        attnres_read(u, q, gain, backend="fla")
    assert torch.equal(attnres_read(u, q, gain, backend="auto"), attnres_read(u, q, gain))
