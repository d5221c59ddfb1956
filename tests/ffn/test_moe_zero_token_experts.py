"""Experts that receive zero tokens get exactly zero weight gradients on every dispatch back-end, and ``auto``
does not pick grouped_mm on Blackwell-class GPUs (compute capability 10.x), where torch's grouped GEMM has
open reports of wrong gradients for such experts (pytorch/pytorch#172439, #193633)."""

from __future__ import annotations

import pytest
import torch

from components.ffn import experts as experts_mod
from components.ffn.experts import DISPATCH_CHOICES, RoutedExperts, auto_dispatch, grouped_mm_supported
from components.ffn.glu_activation import glu_activation

SITU = glu_activation("situ_glu", beta=4.0, linear_beta=25.0)
E, D, M = 8, 16, 32  # fp32 with widths a multiple of 4: grouped_mm runs on the CPU in torch 2.13


def assert_fp32_close(actual: torch.Tensor, expected: torch.Tensor, msg=None) -> None:
    """fp32 round-off: a few ulps of the tensor's largest entry (sums of products reach 25 here, and the
    back-ends sum in different orders, which also differ with the CPU's vector width)."""
    atol = 1e-6 * max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=atol, msg=msg)


HAS_GROUPED_MM = grouped_mm_supported(torch.randn(2, D), torch.randn(E, M, D).transpose(-2, -1))

# (name, [N, k] expert ids): which experts receive nothing varies -- the first, the last, runs of them,
# all but one -- so empty groups sit at the start, middle and end of grouped_mm's offsets
ROUTINGS = {
    "middle_empty": torch.tensor(
        [[0, 2], [3, 5], [2, 0], [6, 3], [5, 6], [0, 3], [2, 6], [5, 0], [3, 2], [6, 5]]
    ),  # 1, 4, 7 empty
    "ends_empty": torch.tensor([[1, 2], [3, 4], [5, 6], [2, 1], [4, 3], [6, 5], [1, 6]]),  # 0 and 7 empty
    "one_expert_busy": torch.tensor([[3], [3], [3], [3], [3]]),  # all but expert 3 empty
    "more_experts_than_pairs": torch.tensor([[7, 0], [0, 7]]),  # 1..6 empty
}


def _backends():
    for b in DISPATCH_CHOICES:
        marks = (
            pytest.mark.skipif(not HAS_GROUPED_MM, reason="grouped_mm does not run on this CPU build")
            if b == "grouped_mm"
            else ()
        )
        yield pytest.param(b, marks=marks)


def _run(dispatch, indices, capacity_factor, seed=0):
    """Forward + backward of one expert block under ``dispatch``; the same weights, inputs and output
    gradient for every back-end. Returns the output and the gradients of x, router weights, w1, w2, w3."""
    torch.manual_seed(seed)
    ex = RoutedExperts(E, D, M, SITU, init_std=0.3, capacity_factor=capacity_factor, dispatch=dispatch)
    N, k = indices.shape
    x = torch.randn(N, D, requires_grad=True)
    w = (torch.rand(N, k) + 0.1).requires_grad_(True)
    out = ex(x, indices, w)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    out.backward(g)
    return out.detach(), (x.grad, w.grad, ex.w1.grad, ex.w2.grad, ex.w3.grad)


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "capacity"])
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("dispatch", list(_backends()))
def test_experts_without_tokens_get_exactly_zero_gradient(dispatch, routing, capacity_factor):
    indices = ROUTINGS[routing]
    unused = sorted(set(range(E)) - set(indices.flatten().tolist()))
    used = sorted(set(indices.flatten().tolist()))
    assert unused, "the routing must leave some expert without tokens"

    out, grads = _run(dispatch, indices, capacity_factor)
    ref_out, ref_grads = _run("loop", indices, capacity_factor)

    for name, grad in zip(("w1", "w2", "w3"), grads[2:]):
        for e in unused:
            assert torch.equal(grad[e], torch.zeros_like(grad[e])), (
                f"{dispatch}: expert {e} got no tokens but a non-zero {name} gradient"
            )
    assert_fp32_close(out, ref_out)
    for name, a, b in zip(("x", "weights", "w1", "w2", "w3"), grads, ref_grads):
        if name in ("w1", "w2", "w3"):
            a, b = a[used], b[used]
        assert_fp32_close(a, b, msg=lambda s, name=name: f"{dispatch}: grad {name}: {s}")
    for name, grad in zip(("w1", "w2", "w3"), grads[2:]):  # the used experts did learn something
        assert all(grad[e].abs().max() > 0 for e in used), f"{dispatch}: a used expert got a zero {name} gradient"


class _CudaLike:
    """The attributes the back-end choice reads from a tensor (dtype, device, shape, element size,
    transpose), on a CUDA device this CPU-only machine does not have."""

    def __init__(self, shape, dtype=torch.bfloat16, device="cuda:0"):
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.device = torch.device(device)

    def element_size(self):
        return torch.empty((), dtype=self.dtype).element_size()

    def transpose(self, a, b):
        s = list(self.shape)
        s[a], s[b] = s[b], s[a]
        return _CudaLike(s, self.dtype, str(self.device))


@pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm"), reason="this torch has no grouped_mm")
@pytest.mark.parametrize(
    "capability,expected",
    [
        ((8, 0), "grouped_mm"),
        ((9, 0), "grouped_mm"),
        ((10, 0), "blocked"),
        ((10, 3), "blocked"),
        ((12, 0), "blocked"),
        ((7, 5), "blocked"),
    ],
)
def test_auto_avoids_grouped_mm_on_blackwell(monkeypatch, capability, expected):
    asked = []

    def capability_of(device=None):
        asked.append(device)
        return capability

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability_of)
    z, w1 = _CudaLike((64, 128)), _CudaLike((E, 256, 128))  # bf16, aligned, few experts: grouped_mm would run
    assert auto_dispatch(z, w1) == expected
    assert asked and all(torch.device(d).index == 0 for d in asked)  # the tokens' own device is asked

    # the module's choice goes through the same decision; an explicit grouped_mm is still honoured
    ex = RoutedExperts(E, 128, 256, SITU, dispatch="auto")
    assert ex._backend(z, w1) == expected
    ex.dispatch = "grouped_mm"
    assert ex._backend(z, w1) == "grouped_mm"
    ex.dispatch = "padded_bmm"
    assert ex._backend(z, w1) == "padded_bmm"


def test_auto_on_cpu_is_unchanged():
    z, w1 = torch.randn(4, D), torch.randn(E, M, D)
    assert auto_dispatch(z, w1) == ("grouped_mm" if HAS_GROUPED_MM else "blocked")
    assert auto_dispatch(z.double(), w1.double()) == "blocked"
    assert experts_mod._GROUPED_MM_UNTRUSTED_CAPABILITY == (10, 0)


@pytest.mark.parametrize(
    "dtype,expected", [(torch.bfloat16, "blocked"), (torch.float32, "grouped_mm" if HAS_GROUPED_MM else "blocked")]
)
def test_auto_on_cpu_takes_blocked_products_in_bf16(dtype, expected):
    """grouped_mm on the CPU is a product per expert: in bf16 the blocked batched products are the faster ones."""
    z, w1 = torch.zeros(64, 128, dtype=dtype), torch.zeros(E, 256, 128, dtype=dtype)
    assert auto_dispatch(z, w1) == expected
