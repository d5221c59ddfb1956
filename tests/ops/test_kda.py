"""KDA core ops (docs/k3.md §2): chunked form vs token recurrence vs fla's naive references,
the decay gates and the q/k L2 norm."""

import warnings

import pytest
import torch
import torch.nn.functional as F

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # fla warns that Triton is unavailable on CPU
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

from components.ops.kda import _choose_chunking, chunk_kda, kda_gate, l2norm, recurrent_kda

LB = -5.0  # K3 gate lower bound


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _inputs(B=2, T=33, H=2, K=16, V=8, gate="lb", dtype=torch.float32, seed=0, init=False, HV=None, grad=False):
    """Layer-like random inputs: L2-normalised q/k, post-sigmoid beta, gated log-decays g."""
    HV = H if HV is None else HV
    gen = _gen(seed)
    d = torch.float64

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=d)

    q = l2norm(rnd(B, T, H, K))
    k = l2norm(rnd(B, T, H, K))
    v = rnd(B, T, HV, V)
    beta = torch.sigmoid(rnd(B, T, HV))
    f = rnd(B, T, HV, K)
    A_log = torch.log(torch.empty(HV, dtype=d).uniform_(1, 16, generator=gen))
    dt_bias = rnd(HV * K)
    if gate == "lb":  # K3 lower-bound form, in (-5, 0)
        g = kda_gate(f, A_log, dt_bias, lower_bound=LB).to(d)
    elif gate == "bound":  # every step at the bound itself
        g = torch.full((B, T, HV, K), LB, dtype=d)
    elif gate == "softplus":  # Kimi Linear form, unbounded below
        g = kda_gate(f, A_log, dt_bias).to(d)
    elif gate == "mild":  # slow decays: 64-token chunks referenced to their start
        g = -0.3 * torch.rand(B, T, HV, K, generator=gen, dtype=d)
    elif gate == "mid":  # ~1.1 per step: 64-token chunks referenced to their midpoint
        g = -1.0 - 0.2 * torch.rand(B, T, HV, K, generator=gen, dtype=d)
    elif gate == "huge":  # softplus gates with huge decays: needs the pairwise fallback
        g = kda_gate(f + 3.0, A_log + 2.0, dt_bias).to(d)
    else:
        raise ValueError(gate)
    S0 = rnd(B, HV, K, V) if init else None
    xs = [x.to(dtype) for x in (q, k, v, g, beta)] + [None if S0 is None else S0.to(dtype)]
    if grad:
        xs = [None if x is None else x.requires_grad_() for x in xs]
    return xs


def _close(a, b, atol, rtol=0.0):
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


@pytest.mark.parametrize("gate", ["lb", "bound", "softplus"])
@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("T", [1, 17, 64, 130])
@pytest.mark.parametrize("kernel", ["auto", "batched"])  # auto: the native CPU kernel where it applies
def test_chunk_matches_recurrent_and_fla(kernel, T, chunk_size, init, gate):
    q, k, v, g, beta, S0 = _inputs(T=T, gate=gate, init=init, seed=T + chunk_size)
    o_ref, S_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o_rec, S_rec = recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o_chk, S_chk = chunk_kda(
        q, k, v, g, beta, initial_state=S0, output_final_state=True, chunk_size=chunk_size, kernel=kernel
    )
    assert o_chk.shape == o_ref.shape and o_chk.dtype == v.dtype
    assert S_chk.shape == S_ref.shape and S_chk.dtype == torch.float32
    _close(o_rec, o_ref, 1e-5)
    _close(S_rec, S_ref, 1e-5)
    _close(o_chk, o_ref, 1e-5)
    _close(S_chk, S_ref, 1e-5)


def test_matches_fla_naive_chunk():
    q, k, v, g, beta, S0 = _inputs(T=128, gate="lb", init=True, seed=3)
    o_ref, S_ref = naive_chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o, S = chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    _close(o, o_ref, 1e-5)
    _close(S, S_ref, 1e-5)


@pytest.mark.parametrize(
    "gate, chunk, mode",
    [("mild", 64, "ref0"), ("mid", 64, "mid"), ("lb", None, None), ("bound", 16, "mid"), ("huge", 16, "pairwise")],
)
def test_every_path_matches_recurrence(gate, chunk, mode):
    # each numerical path of the batched form (and its chunk halving) against the recurrence, with grads
    xs = _inputs(T=70, K=32, gate=gate, init=True, seed=5, grad=True)
    q, k, v, g, beta, S0 = xs
    C, _, got = _choose_chunking(g.detach(), 64, torch.float32)
    if chunk is None:  # strong mean decay: 64-token chunks are halved until they fit
        assert C < 64
    else:
        assert (C, got) == (chunk, mode)
    o1, S1 = recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o2, S2 = chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, kernel="batched")
    _close(o2, o1, 1e-5)
    _close(S2, S1, 1e-5)
    w, ws = torch.randn_like(o1), torch.randn_like(S1)
    g1 = torch.autograd.grad((o1 * w).sum() + (S1 * ws).sum(), xs)
    g2 = torch.autograd.grad((o2 * w).sum() + (S2 * ws).sum(), xs)
    for name, a, b in zip("q k v g beta S0".split(), g2, g1):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("gate", ["lb", "bound", "softplus"])
@pytest.mark.parametrize("T, chunk_size", [(17, 16), (130, 64), (96, 32)])
@pytest.mark.parametrize("kernel", ["auto", "batched"])
def test_float64_agreement_with_grads(kernel, T, chunk_size, gate):
    xs = _inputs(T=T, gate=gate, dtype=torch.float64, init=True, seed=7, grad=True)
    q, k, v, g, beta, S0 = xs
    o1, S1 = recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o2, S2 = chunk_kda(
        q, k, v, g, beta, initial_state=S0, output_final_state=True, chunk_size=chunk_size, kernel=kernel
    )
    assert o2.dtype == torch.float64 and S2.dtype == torch.float64
    _close(o2, o1, 1e-10)
    _close(S2, S1, 1e-10)
    w, ws = torch.randn_like(o1), torch.randn_like(S1)
    g1 = torch.autograd.grad((o1 * w).sum() + (S1 * ws).sum(), xs)
    g2 = torch.autograd.grad((o2 * w).sum() + (S2 * ws).sum(), xs)
    for a, b in zip(g2, g1):
        _close(a, b, 1e-10)


@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("T", [17, 130])
def test_gradients_match_recurrent_fp32(T, init):
    xs = _inputs(T=T, gate="lb", init=init, seed=11, grad=True)
    q, k, v, g, beta, S0 = xs
    o1, S1 = recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o2, S2 = chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    w, ws = torch.randn_like(o1), torch.randn_like(S1)
    inputs = [x for x in xs if x is not None]
    g1 = torch.autograd.grad((o1 * w).sum() + (S1 * ws).sum(), inputs)
    g2 = torch.autograd.grad((o2 * w).sum() + (S2 * ws).sum(), inputs)
    for a, b in zip(g2, g1):
        _close(a, b, atol=2e-5, rtol=1e-4)


def test_grad_without_final_state_and_loss_on_state_only():
    xs = _inputs(T=40, gate="lb", init=True, seed=2, grad=True)
    q, k, v, g, beta, S0 = xs
    (o1, _), (o2, _) = recurrent_kda(q, k, v, g, beta, initial_state=S0), chunk_kda(q, k, v, g, beta, initial_state=S0)
    for a, b in zip(torch.autograd.grad(o2.square().sum(), xs), torch.autograd.grad(o1.square().sum(), xs)):
        _close(a, b, atol=2e-5, rtol=1e-4)
    _, S1 = recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    _, S2 = chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    grads = [torch.autograd.grad(S.sum(), xs, allow_unused=True, materialize_grads=True) for S in (S2, S1)]
    for a, b in zip(*grads):  # q does not reach the state: zero grad from both
        _close(a, b, atol=2e-5, rtol=1e-4)


def test_grouped_value_heads_match_fla():
    # HV = 2 H: each q/k head serves two value heads (fla's GVA contract)
    q, k, v, g, beta, S0 = _inputs(T=50, H=2, HV=4, gate="lb", init=True, seed=4)
    o_ref, S_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    for fn in (recurrent_kda, chunk_kda):
        o, S = fn(q, k, v, g, beta, initial_state=S0, output_final_state=True)
        _close(o, o_ref, 1e-5)
        _close(S, S_ref, 1e-5)


def test_scale_and_bf16_inputs():
    q, k, v, g, beta, S0 = _inputs(T=48, gate="lb", init=True, seed=6)
    o_ref, _ = naive_recurrent_kda(q, k, v, g, beta, scale=0.3, initial_state=S0)
    o, _ = chunk_kda(q, k, v, g, beta, scale=0.3, initial_state=S0)
    _close(o, o_ref, 1e-5)
    half = [x.bfloat16() for x in (q, k, v, g, beta)]
    o_h, S_h = chunk_kda(*half, initial_state=S0, output_final_state=True)
    o_f, _ = recurrent_kda(*[x.float() for x in half], initial_state=S0)
    assert o_h.dtype == torch.bfloat16 and S_h.dtype == torch.float32
    _close(o_h.float(), o_f, atol=2e-2, rtol=1e-2)


def test_inputs_untouched_and_zero_length():
    q, k, v, g, beta, S0 = _inputs(T=1, H=1, B=1, gate="lb", init=True, seed=8)  # B*H = 1: views are easy
    before = [x.clone() for x in (q, k, v, g, beta, S0)]
    chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, chunk_size=16)
    for x, y in zip((q, k, v, g, beta, S0), before):
        assert torch.equal(x, y)
    q, k, v, g, beta, S0 = _inputs(T=0, gate="lb", init=True)
    for fn in (recurrent_kda, chunk_kda):
        o, S = fn(q, k, v, g, beta, initial_state=S0, output_final_state=True)
        assert o.shape == (2, 0, 2, 8)
        _close(S, S0, 0.0)


def test_chunk_size_must_be_power_of_two():
    q, k, v, g, beta, _ = _inputs(T=8)
    for bad in (8, 48, 100):
        with pytest.raises(ValueError):
            chunk_kda(q, k, v, g, beta, chunk_size=bad)


# ------------------------------------------------------------------------------------ gates


def _gate_params(H=3, K=8, seed=0):
    gen = _gen(seed)
    f = 2.0 * torch.randn(4, 5, H, K, generator=gen)
    A_log = torch.log(torch.empty(H).uniform_(1, 16, generator=gen))
    dt = torch.exp(torch.empty(H * K).uniform_(-6.9, -2.3, generator=gen))  # fla's dt init range
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    return f, A_log, dt_bias


def test_softplus_gate_matches_fla():
    f, A_log, dt_bias = _gate_params()
    g = kda_gate(f, A_log, dt_bias)
    assert g.dtype == torch.float32
    _close(g, naive_kda_gate(f, A_log, dt_bias), 1e-6, 1e-6)
    _close(kda_gate(f, A_log, None), naive_kda_gate(f, A_log, None), 1e-6, 1e-6)
    assert (g < 0).all()


def test_lower_bound_gate_matches_fla_and_stays_in_range():
    f, A_log, dt_bias = _gate_params(seed=1)
    g = kda_gate(f, A_log, dt_bias, lower_bound=LB)
    _close(g, naive_kda_lowerbound_gate(f, A_log, dt_bias, lower_bound=LB), 1e-6, 1e-6)
    _close(
        kda_gate(f, None, dt_bias, lower_bound=LB), naive_kda_lowerbound_gate(f, None, dt_bias, lower_bound=LB), 1e-6
    )
    assert ((g >= LB) & (g <= 0)).all()  # (L, 0) mathematically; fp32 saturates at the ends
    mid = kda_gate(torch.randn(4, 5, 3, 8, generator=_gen(2)), torch.zeros(3), None, lower_bound=LB)
    assert ((mid > LB) & (mid < 0)).all()
    # saturation reaches the bound from above and 0 from below, never beyond
    sat = kda_gate(torch.tensor([[[-60.0, 60.0]]]), torch.zeros(1), None, lower_bound=LB)
    assert LB <= sat.min() and sat.max() <= 0
    _close(sat, torch.tensor([[[0.0, LB]]]), 1e-6)
    # half precision in, fp32 out; fp64 stays fp64
    assert kda_gate(f.bfloat16(), A_log, dt_bias, lower_bound=LB).dtype == torch.float32
    g64 = kda_gate(f.double(), A_log, dt_bias, lower_bound=LB)
    assert g64.dtype == torch.float64
    _close(g64, LB * torch.sigmoid(A_log.double().exp().view(3, 1) * (f.double() + dt_bias.double().view(3, 8))), 1e-15)


# ---------------------------------------------------------------------------------- l2 norm


def test_l2norm_eps_inside_sqrt():
    x = torch.randn(3, 4, 32, generator=_gen(0))
    y = l2norm(x)
    _close(y, x / torch.sqrt(x.square().sum(-1, keepdim=True) + 1e-6), 1e-7, 1e-6)
    _close(y.norm(dim=-1), torch.ones(3, 4), 1e-5)
    tiny = torch.full((1, 4), 1e-4)  # ||x|| = 2e-4: eps dominates the sum, unlike F.normalize
    assert l2norm(tiny).norm() < 0.5 * F.normalize(tiny, dim=-1, eps=1e-6).norm()
    _close(l2norm(tiny, eps=1e-6), tiny / (4e-8 + 1e-6) ** 0.5, 1e-7)
    assert l2norm(x.bfloat16()).dtype == torch.bfloat16
