"""The native AttnRes read (components/ops/attnres_cpu.py) against the plain loop (``attnres_read_reference``)
and the PyTorch read."""

import pytest
import torch

import components.ops.attnres as attnres_ops
from components.nn.rmsnorm import rms_norm
from components.ops.attnres import _read_torch, attnres_read, attnres_read_and_norm, attnres_read_reference
from components.ops.attnres_cpu import attnres_read_native, native_available
from tests.helpers import assert_same_bits_on_one_and_two_threads

pytestmark = pytest.mark.skipif(not native_available(), reason="the native AttnRes read could not be built here")


def _case(S, shape=(2, 37, 24), dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    d = shape[-1]
    # sources of very different scales, so the softmax is far from uniform
    sources = [
        (torch.randn(shape, generator=gen, dtype=torch.float64) * 3.0**i).to(dtype).requires_grad_() for i in range(S)
    ]
    query = torch.randn(d, generator=gen, dtype=torch.float64).float().to(torch.promote_types(dtype, torch.float32))
    gain = (1 + 0.3 * torch.randn(d, generator=gen, dtype=torch.float64)).to(query.dtype)
    dout = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return sources, query.requires_grad_(), gain.requires_grad_(), dout


@pytest.mark.parametrize("S", [1, 2, 5])
def test_native_equals_the_reference_in_float64(S):
    # values and the grads of every source, the query and the key-norm gain; 37 x 2 tokens cross tiles of 64
    sources, query, gain, dout = _case(S, seed=S)
    got = attnres_read_native(sources, query, gain, 1e-5)
    ref = attnres_read_reference(sources, query, gain, 1e-5)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-13)
    inputs = [*sources, query, gain]
    for i, (a, b) in enumerate(zip(torch.autograd.grad(got, inputs, dout), torch.autograd.grad(ref, inputs, dout))):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=f"input {i}")


def test_gradcheck():
    sources, query, gain, _ = _case(3, shape=(5, 6), seed=4)
    assert torch.autograd.gradcheck(
        lambda *xs: attnres_read_native(list(xs[:3]), xs[3], xs[4], 1e-5), (*sources, query, gain)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_is_as_accurate_as_the_pytorch_read(dtype):
    # both compute in fp32: against the fp64 result, the native op's error (output and every grad) is at most
    # the PyTorch read's, give or take a factor of two
    sources, query, gain, dout = _case(4, dtype=dtype, seed=7)
    inputs = [*sources, query, gain]
    exact_inputs = [x.detach().double().requires_grad_() for x in inputs]
    exact = attnres_read_reference(exact_inputs[:4], exact_inputs[4], exact_inputs[5], 1e-5)
    exact_grads = torch.autograd.grad(exact, exact_inputs, dout.double())
    got = attnres_read_native(sources, query, gain, 1e-5)
    ref, _ = _read_torch(None, sources, query, gain, 1e-5, dtype)
    assert got.dtype == dtype

    def error(a, b):
        return (a.double() - b).abs().max().item()

    assert error(got, exact) <= 2 * error(ref, exact) + 1e-7
    got_grads = torch.autograd.grad(got, inputs, dout)
    ref_grads = torch.autograd.grad(ref, inputs, dout)
    for i, (a, b, e) in enumerate(zip(got_grads, ref_grads, exact_grads)):
        assert a.dtype == b.dtype
        assert error(a, e) <= 2 * error(b, e) + 1e-6 * e.abs().max().item(), f"input {i}"


def test_attnres_read_takes_the_native_op_on_the_cpu(monkeypatch):
    # the torch back-end runs the native op for CPU reads without weights, stacked or listed sources
    sources, query, gain, _ = _case(3, seed=2)
    calls = []
    native = attnres_ops.attnres_read_native
    monkeypatch.setattr(attnres_ops, "attnres_read_native", lambda *a: calls.append(1) or native(*a))
    listed = attnres_read(sources, query, gain, backend="torch")
    stacked = attnres_read(torch.stack(sources), query, gain, backend="torch")
    _, weights = attnres_read(sources, query, gain, return_weights=True, backend="torch")
    assert len(calls) == 2
    torch.testing.assert_close(listed, stacked, rtol=0, atol=0)
    assert weights.shape == (3, 2, 37)


def test_results_do_not_depend_on_the_thread_count():
    sources, query, gain, dout = _case(3, shape=(3, 200, 32), dtype=torch.float32, seed=9)

    def run():
        y = attnres_read_native(sources, query, gain, 1e-5)
        return (y, *torch.autograd.grad(y, [*sources, query, gain], dout))

    assert_same_bits_on_one_and_two_threads(run)


def test_compiles_into_the_graph_without_a_break():
    sources, query, gain, dout = _case(2, shape=(40, 16), dtype=torch.float32, seed=11)
    fn = torch.compile(
        lambda *xs: attnres_read_native(list(xs[:2]), xs[2], xs[3], 1e-5), backend="aot_eager", fullgraph=True
    )
    got = fn(*sources, query, gain)
    ref = attnres_read_reference(sources, query, gain, 1e-5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    inputs = [*sources, query, gain]
    for a, b in zip(torch.autograd.grad(got, inputs, dout), torch.autograd.grad(ref, inputs, dout)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5)


def _norm_reference(sources, query, gain, out_gain, read=attnres_read_reference):
    return rms_norm(read(sources, query, gain, 1e-5), out_gain, 1e-6)


@pytest.mark.parametrize("S", [1, 4])
def test_read_and_norm_equal_the_composition_in_float64(S):
    sources, query, gain, dout = _case(S, seed=20 + S)
    out_gain = (1 + 0.2 * torch.randn(query.shape, dtype=torch.float64)).requires_grad_()
    got = attnres_read_and_norm(sources, query, gain, 1e-5, out_gain, 1e-6)
    ref = _norm_reference(sources, query, gain, out_gain)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-13)
    inputs = [*sources, query, gain, out_gain]
    for i, (a, b) in enumerate(zip(torch.autograd.grad(got, inputs, dout), torch.autograd.grad(ref, inputs, dout))):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11, msg=f"input {i}")


def test_read_and_norm_round_as_the_bf16_composition():
    # bf16 sources: the read is rounded to bf16 before the norm and the normalised value again before the gain,
    # as components/nn/rmsnorm.py does; the result is in fp32
    sources, query, gain, dout = _case(3, dtype=torch.bfloat16, seed=30)
    out_gain = (1 + 0.2 * torch.randn(query.shape)).requires_grad_()
    got = attnres_read_and_norm(sources, query, gain, 1e-5, out_gain, 1e-6)
    ref = rms_norm(attnres_read_native(sources, query, gain, 1e-5), out_gain, 1e-6)
    assert got.dtype == ref.dtype == torch.float32
    # the same two roundings: equal but where fp32 sums round a bf16 value to its neighbour
    close = torch.isclose(got, ref, rtol=0, atol=1e-6)
    assert close.float().mean() > 0.99
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)
    inputs = [*sources, query, gain, out_gain]
    for a, b in zip(torch.autograd.grad(got, inputs, dout), torch.autograd.grad(ref, inputs, dout)):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * b.abs().max().item())


def test_block_attnres_fuses_each_read_with_its_norm_on_the_cpu(monkeypatch):
    # a whole model's step: the same loss and grads with the fused op as with the read and norm apart
    import components.residual.attnres as residual_module
    from components.model import Decoder
    from runtime.compose import compose_root

    root = compose_root(["model=tiny", "residual=block_attnres", "mixer=gqa", "ffn=dense"])
    torch.manual_seed(0)
    model = Decoder(root.decoder_config()).double()
    ids = torch.randint(0, model.embed.weight.shape[0], (2, 33))
    calls = []
    fused = residual_module.attnres_read_and_norm
    monkeypatch.setattr(residual_module, "attnres_read_and_norm", lambda *a: calls.append(1) or fused(*a))

    def run():
        loss = model(ids).square().mean()
        return (loss, *torch.autograd.grad(loss, list(model.parameters())))

    got = run()
    assert calls  # the fused op ran
    monkeypatch.setattr(residual_module, "fused_norm_applies", lambda *a: False)
    calls.clear()
    ref = run()
    assert not calls
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
