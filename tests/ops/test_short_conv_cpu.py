"""KDA's native q/k/v prologue (components/ops/short_conv_cpu.py) against its reference composition:
``causal_depthwise_conv`` (shifted multiply-adds, SiLU) followed by ``l2norm`` per head."""

import pytest
import torch

import components.mixers.kda as kda_mixer
from components.mixers.kda import KDAConfig, KimiDeltaAttention, causal_depthwise_conv
from components.nn.build_context import BuildContext
from components.nn.segments import Segments
from components.ops.kda import L2NORM_EPS, l2norm
from components.ops.native_build import build_cpu_extension
from components.ops.short_conv_cpu import native_available, short_conv_silu_norm
from tests.helpers import assert_same_bits_on_one_and_two_threads

pytestmark = pytest.mark.skipif(not native_available(), reason="the native short-convolution op could not be built")


def reference(x, weight, segments, head_dim):
    y, _ = causal_depthwise_conv(x, weight, None, segments)  # silu(conv), [B, T, P]
    if head_dim:
        B, T, P = y.shape
        y = l2norm(y.view(B, T, P // head_dim, head_dim)).view(B, T, P)
    return y


def _case(B=2, T=150, P=24, W=4, dtype=torch.float64, documents=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, P, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    weight = torch.randn(P, 1, W, generator=gen, dtype=torch.float64).to(torch.promote_types(dtype, torch.float32))
    weight.requires_grad_()
    dout = torch.randn(B, T, P, generator=gen, dtype=torch.float64).to(dtype)
    segments = None
    if documents:
        starts = torch.rand(B, T, generator=gen) < 0.06
        segments = Segments(torch.cumsum(starts.long(), dim=1))
    return x, weight, dout, segments


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("head_dim", [0, 8])
@pytest.mark.parametrize("T", [3, 64, 150])
def test_native_equals_the_reference_in_float64(T, head_dim, documents):
    # values and both grads; T = 3 is shorter than the kernel, 150 crosses tiles of 64 tokens; documents cut the
    # window inside tiles and at their edges
    x, weight, dout, segments = _case(T=T, documents=documents, seed=T)
    ids = None if segments is None else segments.ids
    got = short_conv_silu_norm(x, weight, ids, head_dim, L2NORM_EPS)
    ref = reference(x, weight, segments, head_dim)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-13)
    for name, a, b in zip(
        ("x", "weight"), torch.autograd.grad(got, (x, weight), dout), torch.autograd.grad(ref, (x, weight), dout)
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)


def test_gradcheck():
    x, weight, _, segments = _case(B=1, T=9, P=8, documents=True, seed=3)
    assert torch.autograd.gradcheck(lambda x, w: short_conv_silu_norm(x, w, segments.ids, 4, L2NORM_EPS), (x, weight))


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-6), (torch.bfloat16, 8e-3)])
def test_low_precision_stays_near_the_float64_result(dtype, atol):
    # computed in fp32 and rounded once: within one rounding of the output dtype of the exact result
    x, weight, dout, _ = _case(dtype=dtype, seed=5)
    exact_x = x.detach().double().requires_grad_()
    exact_w = weight.detach().double().requires_grad_()
    got = short_conv_silu_norm(x, weight, None, 8, L2NORM_EPS)
    ref = reference(exact_x, exact_w, None, 8)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=atol)
    dx, dw = torch.autograd.grad(got, (x, weight), dout)
    rx, rw = torch.autograd.grad(ref, (exact_x, exact_w), dout.double())
    assert dx.dtype == dtype and dw.dtype == weight.dtype
    torch.testing.assert_close(dx.double(), rx, rtol=0, atol=16 * atol)
    torch.testing.assert_close(dw.double(), rw, rtol=2 * atol, atol=16 * atol)


def test_results_do_not_depend_on_the_thread_count():
    # the taps' gradient is summed per tile of tokens, then over tiles in order: the same bits on any thread count
    x, weight, dout, segments = _case(B=3, T=200, P=32, dtype=torch.float32, documents=True, seed=7)

    def run():
        y = short_conv_silu_norm(x, weight, segments.ids, 8, L2NORM_EPS)
        return (y, *torch.autograd.grad(y, (x, weight), dout))

    assert_same_bits_on_one_and_two_threads(run)


def test_compiles_into_the_graph_without_a_break():
    # the fake-tensor rule and the autograd formula let a compiled graph hold the op whole, forward and backward
    x, weight, dout, _ = _case(B=1, T=40, P=16, dtype=torch.float32, seed=9)
    fn = torch.compile(
        lambda x, w: short_conv_silu_norm(x, w, None, 8, L2NORM_EPS), backend="aot_eager", fullgraph=True
    )
    got = fn(x, weight)
    ref = reference(x, weight, None, 8)
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-6)
    for a, b in zip(torch.autograd.grad(got, (x, weight), dout), torch.autograd.grad(ref, (x, weight), dout)):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)


@pytest.mark.parametrize("documents", [False, True])
def test_kda_layer_is_the_same_with_the_reference_prologue(monkeypatch, documents):
    # the whole layer (whole windows on the CPU take the native op) against the layer on the reference prologue
    torch.manual_seed(0)
    layer = KimiDeltaAttention(KDAConfig(n_heads=3, head_dim=8, backend="torch"), BuildContext(32)).double()
    x = torch.randn(2, 70, 32, dtype=torch.float64, requires_grad=True)
    segments = Segments(torch.cumsum((torch.rand(2, 70) < 0.05).long(), dim=1)) if documents else None

    def run():
        y = layer(x, segments=segments)
        params = [x, layer.q_conv1d.weight, layer.k_conv1d.weight, layer.v_conv1d.weight, layer.q_proj.weight]
        return (y, *torch.autograd.grad(y.square().sum(), params))

    native = run()
    monkeypatch.setattr(kda_mixer, "short_conv_native_available", lambda: False)
    ref = run()
    for a, b in zip(native, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_the_switch_turns_a_kernel_off_without_building_it(tmp_path, monkeypatch):
    source = tmp_path / "never_built_cpu.cpp"
    source.write_text("this is not C++")
    monkeypatch.setenv("K3_TEST_NEVER_BUILT", "0")
    assert build_cpu_extension(source, "K3_TEST_NEVER_BUILT") is False
