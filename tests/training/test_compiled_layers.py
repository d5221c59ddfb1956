"""The fast path for models with eager islands (K3: chunked KDA, routed FFNs) -- each decoder layer compiled
around its islands -- trains like the eager reference: same losses over three steps and the same
gradients, on a tiny K3 in fp32."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from benchmarks.train_step import train_setup
from runtime.compile import has_cpp_compiler
from tests.helpers import compose_root

pytestmark = pytest.mark.skipif(not has_cpp_compiler(), reason="TorchInductor's CPU back-end needs a C++ compiler")


@pytest.mark.parametrize(
    "backend",
    [
        # Dynamo's graphs, breaks around the eager islands and AOT autograd, without kernel generation: seconds
        "aot_eager",
        # what the trainer runs (Inductor's generated CPU kernels): about a minute of compilation
        pytest.param("inductor", marks=pytest.mark.slow),
    ],
)
def test_layer_compiled_k3_matches_eager(backend):
    # two layers of k3_tiny's plan: KDA with the dense FFN, then MLA with Stable LatentMoE, QB and block AttnRes
    overrides = ["experiment=k3_tiny", "model.n_layers=2", "data.seq_len=32"]
    ids = [torch.randint(0, 257, (2, 33), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    runs = {}
    torch._dynamo.reset()
    for mode in ("off", "layers"):
        model, step = train_setup(
            compose_root(*overrides), torch.device("cpu"), mode, precision="fp32", compile_backend=backend
        )
        losses = [float(step(ids[0]))]
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}  # the first step's
        losses += [float(step(b)) for b in ids[1:]]
        runs[mode] = (losses, grads)
    compiled_layers = [layer for layer in model.layers if getattr(layer, "_compiled_call_impl", None) is not None]
    assert len(compiled_layers) == len(model.layers)
    # the residual scheme's final read and the output norm run as one more compiled region
    assert hasattr(model.residual.__dict__.get("finish"), "_torchdynamo_orig_callable")
    frames = torch._dynamo.utils.counters["frames"]
    assert frames["ok"] > 0  # dynamo compiled frames (it did not silently run everything eagerly)
    # fp32 both ways: only the order of fused floating-point operations differs
    assert runs["layers"][0][0] == pytest.approx(runs["off"][0][0], abs=1e-5)
    # later steps: Muon's bf16 Newton-Schulz turns round-off differences of the gradients into ~1e-4 ones
    assert runs["layers"][0][1:] == pytest.approx(runs["off"][0][1:], abs=2e-3)
    assert runs["layers"][1].keys() == runs["off"][1].keys()
    for name, ref in runs["off"][1].items():
        torch.testing.assert_close(runs["layers"][1][name], ref, atol=1e-5, rtol=1e-3, msg=name)


@pytest.mark.slow
def test_kda_short_convolution_compiled_form_equals_conv1d():
    """Inside a compiled layer the causal depthwise convolution is written as shifted multiply-adds; it must
    equal the conv1d form, with and without a cached prefix, and pass the same cache on."""
    from components.mixers.kda import causal_depthwise_conv

    gen = torch.Generator().manual_seed(0)
    x, w = (
        torch.randn(2, 9, 6, generator=gen, dtype=torch.float64),
        torch.randn(6, 1, 4, generator=gen, dtype=torch.float64),
    )
    prefix = torch.randn(2, 3, 6, generator=gen, dtype=torch.float64)
    compiled = torch.compile(causal_depthwise_conv, dynamic=False)
    for pre in (None, prefix):
        y_ref, cache_ref = causal_depthwise_conv(x, w, pre)
        y, cache = compiled(x, w, pre)
        torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(cache, cache_ref, rtol=0, atol=0)
