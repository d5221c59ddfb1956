"""Grouped expert dispatch == the loop reference (forward and gradients), capacity, K3 state-dict mapping."""

import pytest
import torch

from components.ffn.experts import RoutedExperts, capacity, experts_reference, grouped_mm_supported
from components.ffn.glu_activation import glu_activation

SITU = glu_activation("situ_glu", beta=4.0, linear_beta=25.0)
# fp32: a few ulps of gradients up to ~25 (dispatch and loop round differently; exp and tanh vectorise per slice)
TOL = {torch.float32: dict(rtol=1e-5, atol=5e-6), torch.float64: dict(rtol=1e-12, atol=1e-12)}


def _routing(N, E, k, seed, skip=()):
    """Random distinct top-k expert ids per token (never any of ``skip``) and positive weights."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(E) if e not in skip])
    perm = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(N)])  # [N, k]
    w = torch.rand(N, k, generator=g, dtype=torch.float32) + 0.1
    return perm, w


def _case(E, k, N, dtype, d=16, m=32, seed=0, skip=()):
    torch.manual_seed(seed)
    ex = RoutedExperts(E, d, m, SITU, init_std=0.3).to(dtype)
    x = torch.randn(N, d, dtype=dtype, requires_grad=True)
    idx, w = _routing(N, E, k, seed + 1, skip)
    w.requires_grad_(True)
    return ex, x, idx, w


def _fwd_bwd(fn, ex, x, w, seed=7):
    out = fn()
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    grads = torch.autograd.grad(out, (x, w, ex.w1, ex.w2, ex.w3), g)
    return out, grads


HAS_GROUPED_MM = grouped_mm_supported(torch.randn(2, 16), torch.randn(4, 32, 16).transpose(-2, -1))
needs_grouped_mm = pytest.mark.skipif(
    not HAS_GROUPED_MM, reason="torch.nn.functional.grouped_mm does not run on CPU here"
)
GROUPED = pytest.param("grouped_mm", marks=needs_grouped_mm)

CASES = [  # (E, k, N, experts that receive no tokens)
    (4, 1, 16, ()),
    (8, 2, 33, (0, 5)),
    (16, 4, 7, ()),  # more experts than pairs: many empty
    (6, 6, 5, ()),  # k = E
    (8, 3, 1, ()),  # a single token
]


@pytest.mark.parametrize("E,k,N,skip", CASES)
@pytest.mark.parametrize(
    "backend,dtype",
    [
        pytest.param("grouped_mm", torch.float32, marks=needs_grouped_mm),
        ("padded_bmm", torch.float32),
        ("padded_bmm", torch.float64),
        ("blocked", torch.float32),
        ("blocked", torch.float64),
    ],
)
def test_dispatch_matches_loop_reference(E, k, N, skip, backend, dtype):
    ex, x, idx, w = _case(E, k, N, dtype, skip=skip)
    ex.dispatch = backend
    out, grads = _fwd_bwd(lambda: ex(x, idx, w), ex, x, w)
    ref, ref_grads = _fwd_bwd(lambda: experts_reference(x, idx, w, ex.w1, ex.w2, ex.w3, SITU), ex, x, w)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **TOL[dtype])
    for name, a, b in zip(("x", "weights", "w1", "w2", "w3"), grads, ref_grads):
        torch.testing.assert_close(a, b, **TOL[dtype], msg=lambda s: f"grad {name}: {s}")
    for e in skip:  # experts without tokens get exactly zero gradient
        assert grads[2][e].abs().max() == 0 and grads[3][e].abs().max() == 0


@pytest.mark.parametrize("backend", [GROUPED, "padded_bmm", "blocked"])
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_capacity_dispatch_matches_reference(backend, factor):
    E, k, N = 4, 2, 24
    ex, x, idx, w = _case(E, k, N, torch.float32, seed=3)
    idx[:12, 0] = 0  # overload expert 0
    idx[:12, 1] = 1
    ex.capacity_factor = factor
    ex.dispatch = backend
    out, grads = _fwd_bwd(lambda: ex(x, idx, w), ex, x, w)
    ref, ref_grads = _fwd_bwd(lambda: experts_reference(x, idx, w, ex.w1, ex.w2, ex.w3, SITU, factor), ex, x, w)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **TOL[torch.float32])
    if factor < 1.0:
        dropless, _ = _fwd_bwd(lambda: experts_reference(x, idx, w, ex.w1, ex.w2, ex.w3, SITU), ex, x, w)
        assert not torch.allclose(out, dropless)  # some pairs were dropped


def test_capacity_formula():
    assert capacity(100, 2, 8, None) is None
    assert capacity(100, 2, 8, 1.0) == 25
    assert capacity(100, 2, 8, 1.1) == 28
    assert capacity(3, 1, 64, 1.0) == 1


def test_auto_backend_and_grouped_mm_eligibility():
    ex32 = RoutedExperts(4, 16, 32, SITU)
    assert grouped_mm_supported(torch.randn(3, 16), ex32.w1.transpose(-2, -1)) == HAS_GROUPED_MM
    assert not grouped_mm_supported(torch.randn(3, 16).double(), ex32.w1.double().transpose(-2, -1))
    odd = RoutedExperts(4, 6, 10, SITU)  # rows not 16-byte aligned in fp32
    assert not grouped_mm_supported(torch.randn(3, 6), odd.w1.transpose(-2, -1))
    x = torch.randn(9, 6)
    idx, w = _routing(9, 4, 2, 0)
    torch.testing.assert_close(
        odd(x, idx, w), experts_reference(x, idx, w, odd.w1, odd.w2, odd.w3, SITU), **TOL[torch.float32]
    )


def test_bf16_grouped_dispatch_close_to_fp32():
    ex, x, idx, w = _case(8, 2, 40, torch.float32)
    ref = ex(x, idx, w)
    ex_bf = RoutedExperts(8, 16, 32, SITU).to(torch.bfloat16)
    ex_bf.load_state_dict(ex.state_dict())
    out = ex_bf(x.bfloat16(), idx, w)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)


@needs_grouped_mm
def test_sum_backward_through_grouped_mm():
    """``out.sum()`` sends a stride-0 gradient, which grouped_mm's backward refuses unless made dense."""
    ex, x, idx, w = _case(4, 2, 8, torch.float32)
    ex.dispatch = "grouped_mm"
    ex(x, idx, w).sum().backward()
    assert x.grad is not None and ex.w2.grad is not None


def test_k3_per_expert_state_dict_round_trip():
    ex = RoutedExperts(3, 8, 4, SITU)
    sd = ex.per_expert_state_dict(prefix="experts.")
    assert set(sd) == {f"experts.{i}.{n}.weight" for i in range(3) for n in ("w1", "w2", "w3")}
    assert sd["experts.2.w1.weight"].shape == (4, 8) and sd["experts.2.w2.weight"].shape == (8, 4)
    other = RoutedExperts(3, 8, 4, SITU, init_std=1.0)
    other.load_per_expert_state_dict({k: v.clone() for k, v in sd.items()}, prefix="experts.")
    for n in ("w1", "w2", "w3"):
        assert torch.equal(getattr(other, n), getattr(ex, n))


@needs_grouped_mm
def test_dropless_bf16_grouped_mm_traces_without_graph_breaks():
    """Dropless in bf16 only the group offsets are data: the plan and the grouped products trace into the
    compiled layer (no eager island), and the compiled result is the eager one."""
    import torch._dynamo

    ex, x, idx, w = _case(8, 2, 40, torch.float32)
    ex = ex.to(torch.bfloat16)
    ex.dispatch = "grouped_mm"
    xb = x.detach().bfloat16().requires_grad_(True)

    def f(x, idx, w):
        return ex(x, idx, w)

    explained = torch._dynamo.explain(f)(xb, idx, w)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    out = torch.compile(f, backend="aot_eager", fullgraph=True)(xb, idx, w)
    torch.testing.assert_close(out, f(xb, idx, w), rtol=0, atol=0)
