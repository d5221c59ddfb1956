"""The ``blocked`` expert dispatch: static shapes whatever the routing, bounded padding, exact against the
loop reference under any routing, and traced into a compiled graph without breaks."""

import pytest
import torch
import torch._dynamo

from components.ffn.experts import RoutedExperts, block_plan, block_rows, experts_reference, num_blocks
from components.ffn.glu_activation import glu_activation

SITU = glu_activation("situ_glu", beta=4.0, linear_beta=25.0)


def _balanced(N, E, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])  # [N, k]


def _all_to_first(N, E, k):
    return torch.arange(k).expand(N, k).clone()  # every token picks experts 0..k-1


@pytest.mark.parametrize("cap", [None, 5])
def test_plan_shapes_do_not_depend_on_the_routing(cap):
    N, E, k, block = 96, 8, 2, 16
    plans = [block_plan(r, E, cap, block) for r in (_balanced(N, E, k), _all_to_first(N, E, k))]
    nb = num_blocks(N * k, E, block, cap)
    for plan in plans:
        assert plan.rows.shape == (N * k,) and plan.block_expert.shape == (nb,)
    # every kept pair has its own row inside its expert's blocks, in token order; dropped pairs share the sink
    for routing, plan in zip((_balanced(N, E, k), _all_to_first(N, E, k)), plans):
        flat = routing.reshape(-1)
        kept = plan.rows < nb * block
        assert plan.rows[kept].unique().numel() == int(kept.sum())
        assert torch.equal(plan.block_expert[plan.rows[kept] // block], flat[kept])
        for e in range(E):
            r = plan.rows[kept & (flat == e)]
            assert torch.equal(r, r.sort().values)
        if cap is None:
            assert bool(kept.all())
        else:
            assert int((~kept).sum()) == int((torch.bincount(flat, minlength=E) - cap).clamp(min=0).sum())


def test_block_rows_bounds_the_padding():
    for pairs, E in [(32768, 32), (64, 4), (10, 8), (1 << 20, 384)]:
        b = block_rows(pairs, E)
        assert b & (b - 1) == 0 and 16 <= b <= 256
        if pairs >= 64 * E:
            assert E * b <= pairs // 4 + E * 16  # padding within a quarter of the pairs


@pytest.mark.parametrize("routing", ["balanced", "all_to_first"])
@pytest.mark.parametrize("cap_factor", [None, 0.75])
def test_blocked_matches_loop_under_any_routing(routing, cap_factor):
    torch.manual_seed(0)
    N, E, k, d, m = 70, 8, 3, 16, 32
    ex = RoutedExperts(E, d, m, SITU, init_std=0.3, capacity_factor=cap_factor, dispatch="blocked").double()
    x = torch.randn(N, d, dtype=torch.float64, requires_grad=True)
    idx = _balanced(N, E, k) if routing == "balanced" else _all_to_first(N, E, k)
    w = torch.rand(N, k, dtype=torch.float64, requires_grad=True)
    g = torch.randn(N, d, dtype=torch.float64)
    params = (x, w, ex.w1, ex.w2, ex.w3)
    out = ex(x, idx, w)
    grads = torch.autograd.grad(out, params, g)
    ref = experts_reference(x, idx, w, ex.w1, ex.w2, ex.w3, SITU, cap_factor)
    ref_grads = torch.autograd.grad(ref, params, g)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("x", "weights", "w1", "w2", "w3"), grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda s, name=name: f"grad {name}: {s}")


def test_blocked_compiles_without_graph_breaks_and_matches_eager():
    torch.manual_seed(0)
    N, E, k, d, m = 64, 8, 2, 16, 32
    ex = RoutedExperts(E, d, m, SITU, init_std=0.3, dispatch="blocked")
    x = torch.randn(N, d, requires_grad=True)
    w = torch.rand(N, k)

    def f(x, idx, w):
        return ex(x, idx, w)

    explained = torch._dynamo.explain(f)(x, _balanced(N, E, k), w)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=False)
    for idx in (_balanced(N, E, k, seed=1), _all_to_first(N, E, k)):  # a new routing is not a new shape
        out = compiled(x, idx, w)
        (gx,) = torch.autograd.grad(out.square().sum(), x)
        ref = f(x, idx, w)
        (rx,) = torch.autograd.grad(ref.square().sum(), x)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(gx, rx, rtol=1e-5, atol=1e-6)
