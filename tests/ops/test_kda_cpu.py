"""KDA's native CPU kernel (components/ops/kda_cpu.py) against the token recurrence and the batched form."""

import pytest
import torch

import components.ops.kda as kda_ops
from components.nn.segments import Segments
from components.ops.kda import _choose_chunking, chunk_kda, recurrent_kda
from components.ops.kda_cpu import max_chunk_span, native_available
from tests.ops.test_kda import _inputs

pytestmark = pytest.mark.skipif(not native_available(), reason="the native KDA kernel could not be built here")


def _grads(out, xs, seed=0):
    """Grads of a random projection of (o, final state) w.r.t. every input that is not None."""
    o, S = out
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
    ws = torch.randn(S.shape, generator=gen, dtype=torch.float64).to(S.dtype)
    return torch.autograd.grad((o.float() * w.float()).sum() + (S * ws).sum(), [x for x in xs if x is not None])


@pytest.mark.parametrize(
    "T, chunk_size, gate, init",
    [(1, 16, "lb", True), (17, 16, "lb", True), (130, 64, "lb", False), (96, 32, "mid", True), (70, 64, "bound", True)],
)
def test_native_equals_the_recurrence_in_float64(T, chunk_size, gate, init):
    # values, final state and every input's grad (the initial state's too), ragged last chunks included
    xs = _inputs(T=T, K=32, V=16, gate=gate, dtype=torch.float64, init=init, seed=T, grad=True)
    q, k, v, g, beta, S0 = xs
    ref = recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    got = chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, chunk_size=chunk_size, kernel="native")
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=1e-12)
    for name, a, b in zip("q k v g beta S0".split(), _grads(got, xs), _grads(ref, xs)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_equals_the_batched_form(dtype):
    # the two fast forms of the trainer's inputs (bf16 q/k/v, fp32 g and beta): same values and grads
    q, k, v, g, beta, _ = _inputs(B=3, T=200, H=2, K=64, V=64, gate="lb", seed=1)
    base = [q.to(dtype), k.to(dtype), v.to(dtype), g, beta]
    runs = {}
    for kernel in ("native", "batched"):
        xs = [x.clone().requires_grad_() for x in base]
        out = chunk_kda(*xs, output_final_state=True, kernel=kernel)
        runs[kernel] = (out, _grads(out, xs))
    (o_n, S_n), grads_n = runs["native"]
    (o_b, S_b), grads_b = runs["batched"]
    assert o_n.dtype == o_b.dtype == dtype and S_n.dtype == S_b.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of each output apart
    torch.testing.assert_close(o_n.float(), o_b.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(S_n, S_b, rtol=1e-5, atol=1e-5)
    for name, a, b in zip("q k v g beta".split(), grads_n, grads_b):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_native_documents_equal_the_recurrence(chunk_size):
    # document starts reset the state (a chunk halved below the alignment still resets at its start)
    T = 130
    ids = torch.zeros(2, T, dtype=torch.long)
    for row, starts in enumerate([[5, 7, 40, 113], [70]]):
        for c in starts:
            ids[row, c:] += 1
    segments = Segments(ids)
    xs = _inputs(T=T, K=16, V=8, gate="mid", dtype=torch.float64, seed=chunk_size, grad=True)[:5]
    got = chunk_kda(*xs, chunk_size=chunk_size, output_final_state=True, segments=segments, kernel="native")
    ref = recurrent_kda(*xs, output_final_state=True, segments=segments)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=1e-12)
    for name, a, b in zip("q k v g beta".split(), _grads(got, xs), _grads(ref, xs)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11, msg=name)


def test_results_do_not_depend_on_the_thread_count():
    # (batch, head) pairs are independent: one thread or two give the same bits
    xs = _inputs(B=4, T=100, H=3, K=16, V=16, gate="lb", seed=3)[:5]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = chunk_kda(*xs, output_final_state=True, kernel="native")
        torch.set_num_threads(2)
        two = chunk_kda(*xs, output_final_state=True, kernel="native")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_max_chunk_span_is_the_batched_forms_span():
    for gate, chunk in [("lb", 64), ("bound", 16), ("mild", 32)]:
        g = _inputs(T=77, gate=gate, seed=2)[3]
        _, G, _ = _choose_chunking(g, chunk, torch.float32)  # in-chunk cumsum at the largest fitting chunk
        C = G.shape[1]
        assert max_chunk_span(g, C) == pytest.approx(float(-G[:, -1].amin()), rel=1e-5)


def test_auto_halves_chunks_and_takes_the_batched_form_beyond_the_factorisation():
    # K3's bound gate (-5 per step) spans 80 over 16 tokens: native at 16-token chunks
    q, k, v, g, beta, _ = _inputs(T=40, gate="bound", seed=4)
    assert kda_ops._native_chunk(q, k, v, g, beta, None, 64, None, "auto") == 16
    # softplus gates decaying harder still need the batched form's pairwise path
    q, k, v, g, beta, _ = _inputs(T=40, gate="huge", seed=4)
    assert kda_ops._native_chunk(q, k, v, g, beta, None, 64, None, "auto") is None
    with pytest.raises(ValueError, match="decays by more than 80"):
        chunk_kda(q, k, v, g, beta, kernel="native")
    ref = recurrent_kda(q, k, v, g, beta)[0]
    torch.testing.assert_close(chunk_kda(q, k, v, g, beta)[0], ref, rtol=1e-5, atol=1e-5)


def test_native_refuses_what_it_cannot_run(monkeypatch):
    q, k, v, g, beta, _ = _inputs(T=20, seed=5)
    with pytest.raises(ValueError, match="kernel must be one of auto, native, batched"):
        chunk_kda(q, k, v, g, beta, kernel="fast")
    with pytest.raises(ValueError, match="compute_dtype"):
        chunk_kda(q, k, v, g, beta, kernel="native", compute_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16, fp32 or fp64 only"):
        chunk_kda(q.half(), k.half(), v.half(), g, beta, kernel="native")
    # a machine where the kernel cannot be built: auto runs the batched form, native says why
    monkeypatch.setattr(kda_ops, "native_available", lambda: False)
    with pytest.raises(ValueError, match="could not be built"):
        chunk_kda(q, k, v, g, beta, kernel="native")
    torch.testing.assert_close(chunk_kda(q, k, v, g, beta)[0], chunk_kda(q, k, v, g, beta, kernel="batched")[0])


def test_inputs_are_untouched():
    xs = _inputs(T=50, gate="lb", init=True, seed=6)
    before = [x.clone() for x in xs]
    chunk_kda(*xs[:5], initial_state=xs[5], output_final_state=True, kernel="native")
    for x, y in zip(xs, before):
        assert torch.equal(x, y)
