"""GLU-family activations: closed-form oracles (docs/k3.md §10.1 SITU-1/2), bounds and
small-input behaviour (§10.10 item 8), fp32 computation for low-precision
inputs, and the fused Triton SiTU-GLU kernel against the PyTorch reference.

The Triton checks run in a subprocess with TRITON_INTERPRET=1 (the interpreter
mode is fixed when triton kernels are defined, so it cannot be switched on
inside an already-running test process). Running this file as a script prints
those checks' results as JSON.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from components.ffn.glu_activation import GLU_ACTIVATIONS, glu_activation
from components.ops.activations import (
    situ_glu,
    situ_glu_exp_form,
    situ_glu_reference,
    swiglu,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
HAS_TRITON = importlib.util.find_spec("triton") is not None

SITU_1_A = [-2.0, 0.0, 2.0, 8.0]
SITU_1_B = 3.0
SITU_1 = {
    "situ_glu": [-0.658, 0.000, 4.861, 11.509],
    "glu": [0.358, 1.500, 2.642, 2.999],
    "swiglu": [-0.715, 0.000, 5.285, 23.992],
}


# ---------------------------------------------------------------- oracles


@pytest.mark.parametrize("name", sorted(SITU_1))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_situ_1_table(name, dtype):
    a = torch.tensor(SITU_1_A, dtype=dtype)
    b = torch.full_like(a, SITU_1_B)
    z = GLU_ACTIVATIONS[name].fn(a, b)
    assert z.dtype == dtype
    # table values are rounded to 3 decimals
    torch.testing.assert_close(z, torch.tensor(SITU_1[name], dtype=dtype), rtol=0, atol=5e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_situ_2_large_equal_inputs(dtype):
    a = torch.tensor([40.0], dtype=dtype)
    torch.testing.assert_close(swiglu(a, a), torch.tensor([1600.0], dtype=dtype))
    tol = 1e-5 if dtype == torch.float32 else 1e-6
    torch.testing.assert_close(situ_glu(a, a), torch.tensor([92.166855], dtype=dtype), rtol=0, atol=tol * 100)


def test_beta_defaults_and_fallback():
    a = torch.linspace(-6, 6, 25, dtype=torch.float64)
    b = torch.linspace(-60, 60, 25, dtype=torch.float64)
    expected = 4 * torch.tanh(a / 4) * torch.sigmoid(a) * 25 * torch.tanh(b / 25)
    torch.testing.assert_close(situ_glu(a, b), expected)
    # beta None / 0 -> 1.0 (reference `beta or 1.0`)
    beta1 = torch.tanh(a) * torch.sigmoid(a) * 25 * torch.tanh(b / 25)
    torch.testing.assert_close(situ_glu(a, b, beta=None), beta1)
    torch.testing.assert_close(situ_glu(a, b, beta=0), beta1)
    # linear_beta None -> up branch uncapped
    torch.testing.assert_close(situ_glu(a, b, linear_beta=None), 4 * torch.tanh(a / 4) * torch.sigmoid(a) * b)
    with pytest.raises(ValueError):
        situ_glu(a, b, linear_beta=0.0)


def test_glu_activation_lookup():
    a, b = torch.randn(4, 6), torch.randn(4, 6)
    for name, entry in GLU_ACTIVATIONS.items():
        torch.testing.assert_close(glu_activation(name)(a, b), entry.fn(a, b))
    torch.testing.assert_close(
        glu_activation("situ_glu", beta=2.0, linear_beta=None)(a, b),
        situ_glu_reference(a, b, beta=2.0, linear_beta=None),
    )
    with pytest.raises(ValueError, match="swiglu"):
        glu_activation("geglu")
    with pytest.raises(TypeError):
        glu_activation("swiglu", beta=2.0)


def test_shape_mismatch_rejected():
    with pytest.raises(ValueError):
        situ_glu(torch.randn(3, 4), torch.randn(3, 5))


# ---------------------------------------------------------------- properties (§10.10 item 8)


def test_bounded_for_huge_inputs_fp32():
    # every sign combination of magnitudes up to 1e4
    mags = torch.tensor([0.0, 1e-3, 1.0, 4.0, 25.0, 100.0, 1e3, 1e4])
    vals = torch.cat([-mags, mags])
    a, b = torch.meshgrid(vals, vals, indexing="ij")
    a, b = a.requires_grad_(), b.requires_grad_()
    z = situ_glu(a, b)
    z.sum().backward()
    assert torch.isfinite(z).all() and torch.isfinite(a.grad).all() and torch.isfinite(b.grad).all()
    # the bound is strict mathematically; fp32 rounds tanh and sigmoid to exactly 1 here
    assert z.abs().max() <= 100.0
    # SwiGLU has no such bound
    assert swiglu(a, b).abs().max() > 1e7


def test_strictly_bounded_fp64():
    torch.manual_seed(0)
    a = torch.randn(10_000, dtype=torch.float64) * 20
    b = torch.randn(10_000, dtype=torch.float64) * 100
    assert situ_glu(a, b).abs().max() < 100.0
    # the gate branch alone is bounded by beta
    assert situ_glu(a, torch.ones_like(a), linear_beta=None).abs().max() < 4.0


def test_first_order_equal_to_swiglu_near_zero():
    # SiTU(a) - a sigma(a) = (4 tanh(a/4) - a) sigma(a) = O(a^3), same for the up cap
    b = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    for eps in (1e-1, 1e-2, 1e-3):
        a = torch.full_like(b, eps)
        diff = (situ_glu(a, eps * b) - swiglu(a, eps * b)).abs()
        assert (diff <= eps**3).all(), (eps, diff)
    # gradients at a = 0: d/da = sigma(0) * up-branch, d/db = 0. Exact with the up
    # branch uncapped; with the cap, equal up to O(b^3) for small b
    a0 = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    for lb, scale, tol in ((None, 1.0, 1e-12), (25.0, 1e-2, 1e-6)):
        b0 = (scale * b).requires_grad_()
        ga, gb = torch.autograd.grad(situ_glu(a0, b0, linear_beta=lb).sum(), (a0, b0))
        sa, sb = torch.autograd.grad(swiglu(a0, b0).sum(), (a0, b0))
        torch.testing.assert_close(ga, sa, rtol=0, atol=tol)
        torch.testing.assert_close(gb, sb, rtol=0, atol=tol)


@pytest.mark.parametrize("name", sorted(GLU_ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_computed_in_fp32(name, dtype):
    torch.manual_seed(0)
    fn = GLU_ACTIVATIONS[name].fn
    a = (torch.randn(64, 33) * 4).to(dtype)
    b = (torch.randn(64, 33) * 40).to(dtype)
    z = fn(a, b)
    assert z.dtype == dtype
    # exactly one rounding: the fp32 result of the same (rounded) inputs, cast once
    torch.testing.assert_close(z, fn(a.float(), b.float()).to(dtype), rtol=0, atol=0)


def test_low_precision_grads_match_fp32_path():
    torch.manual_seed(0)
    a = (torch.randn(256) * 4).bfloat16().requires_grad_()
    b = (torch.randn(256) * 40).bfloat16().requires_grad_()
    situ_glu(a, b).float().sum().backward()
    a32, b32 = a.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    situ_glu(a32, b32).sum().backward()
    torch.testing.assert_close(a.grad, a32.grad.bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(b.grad, b32.grad.bfloat16(), rtol=0, atol=0)


def test_reference_gradcheck_fp64():
    torch.manual_seed(0)
    a = (torch.randn(20, dtype=torch.float64) * 5).requires_grad_()
    b = (torch.randn(20, dtype=torch.float64) * 50).requires_grad_()
    for lb in (25.0, None):
        assert torch.autograd.gradcheck(lambda x, y: situ_glu_reference(x, y, 4.0, lb), (a, b))


def test_cpu_tensors_use_the_exp_form_by_default():
    from components.ops import activations, backend

    assert backend.resolve("situ_glu", "auto", torch.device("cpu"), applies=lambda: True) == "torch"
    a, b = torch.randn(7), torch.randn(7)
    assert torch.equal(activations.situ_glu(a, b), activations.situ_glu_exp_form(a, b))


# extremes on both sides of zero: signed zeros, tiny, where tanh and sigmoid saturate, beyond exp's range
EXTREMES = [0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5, 30.0, -30.0, 88.0, -88.0, 200.0, -200.0, 1e4, -1e4, 1e30, -1e30]


@pytest.mark.parametrize("beta", [4.0, 1.0, 2.5])  # 4: K3's, where one exp serves both gate factors
@pytest.mark.parametrize("linear_beta", [25.0, None])
def test_exp_form_equals_the_reference_in_fp64(beta, linear_beta):
    gen = torch.Generator().manual_seed(0)
    a = torch.cat([torch.randn(4000, generator=gen, dtype=torch.float64) * 6, torch.tensor(EXTREMES).double()])
    b = torch.cat([torch.randn(4000, generator=gen, dtype=torch.float64) * 60, torch.tensor(EXTREMES[::-1]).double()])
    a.requires_grad_(), b.requires_grad_()
    w = torch.randn(a.shape, generator=gen, dtype=torch.float64)
    want = situ_glu_reference(a, b, beta, linear_beta)
    got = situ_glu_exp_form(a, b, beta, linear_beta)
    scale = want.abs().clamp(min=1.0)
    torch.testing.assert_close(got / scale, want / scale, rtol=0, atol=1e-14)
    for x, y in zip(torch.autograd.grad((got * w).sum(), (a, b)), torch.autograd.grad((want * w).sum(), (a, b))):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_exp_form_gradcheck_and_fp32_extremes():
    gen = torch.Generator().manual_seed(1)
    a = (torch.randn(20, generator=gen, dtype=torch.float64) * 5).requires_grad_()
    b = (torch.randn(20, generator=gen, dtype=torch.float64) * 50).requires_grad_()
    for beta, lb in ((4.0, 25.0), (2.5, None)):
        assert torch.autograd.gradcheck(lambda x, y: situ_glu_exp_form(x, y, beta, lb), (a, b))
    x = torch.tensor(EXTREMES + [float("inf"), float("-inf")], requires_grad=True)
    z = situ_glu_exp_form(x, x.detach().flip(0).requires_grad_())
    z.sum().backward()
    assert torch.isfinite(z).all() and torch.isfinite(x.grad).all()
    torch.testing.assert_close(z, situ_glu_reference(x.detach(), x.detach().flip(0)), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- Triton kernel (interpreter, subprocess)

# (shape, dtype, linear_beta, block); the shapes are non-multiples of the block except (1024,)
TRITON_CASES = [
    ((1,), "float32", 25.0, 1024),
    ((1024,), "float32", 25.0, 1024),
    ((3, 1000), "float32", 25.0, 1024),
    ((3, 1000), "float32", None, 1024),
    ((2, 5, 257), "float32", 25.0, 128),
    ((2, 5, 257), "float32", None, 128),
    ((3, 1000), "bfloat16", 25.0, 1024),
    ((3, 1000), "bfloat16", None, 1024),
    ((2, 5, 257), "bfloat16", 25.0, 128),
    ((7, 33), "float16", 25.0, 128),
]
TOLS = {
    "float32": dict(rtol=1e-5, atol=1e-5),
    "bfloat16": dict(rtol=1.6e-2, atol=1e-4),
    "float16": dict(rtol=2e-3, atol=1e-4),
}


def _case_id(case) -> str:
    shape, dtype, lb, block = case
    return f"{'x'.join(map(str, shape))}-{dtype}-lb{lb}-B{block}"


def _compare(name, got, want, dtype) -> str | None:
    try:
        torch.testing.assert_close(got, want, **TOLS[dtype])
    except AssertionError as e:
        return f"{name}: {e}"
    return None


def _triton_checks() -> dict[str, list[str]]:
    """Run every Triton comparison; returns {check id: [failure messages]}."""
    from components.ops.triton.situ_glu import SituGluTriton

    results: dict[str, list[str]] = {}
    for seed, case in enumerate(TRITON_CASES):
        shape, dtype_name, lb, block = case
        dtype = getattr(torch, dtype_name)
        gen = torch.Generator().manual_seed(seed)
        # spread covers the caps (4, 25) and the saturated regions
        g = (torch.randn(shape, generator=gen) * 4).to(dtype)
        u = (torch.randn(shape, generator=gen) * 40).to(dtype)
        dz = torch.randn(shape, generator=gen).to(dtype)
        g1, u1 = g.clone().requires_grad_(), u.clone().requires_grad_()
        g2, u2 = g.clone().requires_grad_(), u.clone().requires_grad_()
        z1 = SituGluTriton.apply(g1, u1, 4.0, lb, block)
        z1.backward(dz)
        z2 = situ_glu_reference(g2, u2, 4.0, lb)
        z2.backward(dz)
        errs = [
            e
            for e in (
                None if z1.dtype == dtype and z1.shape == z2.shape else f"bad output {z1.dtype} {z1.shape}",
                _compare("z", z1, z2, dtype_name),
                _compare("grad_gate", g1.grad, g2.grad, dtype_name),
                _compare("grad_up", u1.grad, u2.grad, dtype_name),
            )
            if e
        ]
        results[_case_id(case)] = errs

    torch.manual_seed(0)
    errs = []
    # realistic layout: gate/up are non-contiguous halves of one projection output
    x = (torch.randn(6, 2, 2 * 300) * 10).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    dz = torch.randn(6, 2, 300)
    situ_glu(*x.chunk(2, dim=-1), backend="triton").backward(dz)
    situ_glu_reference(*x_ref.chunk(2, dim=-1)).backward(dz)
    errs += [e for e in [_compare("chunked grad", x.grad, x_ref.grad, "float32")] if e]
    # dispatch with beta None -> 1.0 and a grad_z in another dtype than the inputs
    g = torch.randn(500).bfloat16().requires_grad_()
    z = situ_glu(g, g.detach() * 3, beta=None, backend="triton")
    g_ref = g.detach().clone().requires_grad_()
    z_ref = situ_glu_reference(g_ref, g_ref.detach() * 3, beta=1.0)
    errs += [e for e in [_compare("beta None", z, z_ref, "bfloat16")] if e]
    z.float().sum().backward()
    z_ref.float().sum().backward()
    errs += [e for e in [_compare("beta None grad", g.grad, g_ref.grad, "bfloat16")] if e]
    results["dispatch"] = errs

    errs = []
    # huge inputs: no NaN/inf in z or grads, |z| <= 100, agreement with the reference
    mags = torch.tensor([0.0, 1e-6, 1e-3, 0.1, 0.125, 1.0, 4.0, 25.0, 88.0, 100.0, 1e3, 1e4])
    vals = torch.cat([-mags, mags])
    a, b = (t.reshape(-1) for t in torch.meshgrid(vals, vals, indexing="ij"))
    for lb in (25.0, None):
        a1, b1 = a.clone().requires_grad_(), b.clone().requires_grad_()
        a2, b2 = a.clone().requires_grad_(), b.clone().requires_grad_()
        z1 = SituGluTriton.apply(a1, b1, 4.0, lb, 128)
        z1.sum().backward()
        z2 = situ_glu_reference(a2, b2, 4.0, lb)
        z2.sum().backward()
        for name, t in (("z", z1), ("grad_gate", a1.grad), ("grad_up", b1.grad)):
            if not torch.isfinite(t).all():
                errs.append(f"lb={lb}: non-finite {name}")
        if lb is not None and z1.abs().max() > 100.0:
            errs.append(f"|z| = {z1.abs().max().item()} > 100")
        # the uncapped up branch reaches |z| ~ 4e4: compare relative to that scale
        scale = 1.0 if lb is not None else 4e4
        for name, x1, x2 in (("z", z1, z2), ("grad_gate", a1.grad, a2.grad), ("grad_up", b1.grad, b2.grad)):
            try:
                torch.testing.assert_close(x1, x2, rtol=1e-5, atol=1e-5 * scale)
            except AssertionError as e:
                errs.append(f"huge lb={lb} {name}: {e}")
    results["huge_inputs"] = errs

    # tiny inputs: relative accuracy where tanh(y) = (1 - e^-2y) / (1 + e^-2y) would cancel
    small = torch.logspace(-8, 0, 33)
    a = torch.cat([-small, small])
    z1 = SituGluTriton.apply(a, a * 4, 4.0, 25.0, 128)
    z2 = situ_glu_reference(a, a * 4, 4.0, 25.0)
    errs = [e for e in [_compare("small z (relative)", z1, z2, "float32")] if e]
    try:
        torch.testing.assert_close(z1, z2, rtol=1e-5, atol=0)
    except AssertionError as e:
        errs.append(f"small inputs: {e}")
    results["small_inputs"] = errs

    # empty input: no launch, right shape
    e = SituGluTriton.apply(torch.empty(0, 4), torch.empty(0, 4), 4.0, 25.0, 1024)
    results["empty"] = [] if e.shape == (0, 4) else [f"empty shape {e.shape}"]
    return results


def _run_python(code_or_args: list[str], env_extra: dict[str, str], timeout: float = 120):
    env = dict(os.environ)
    env.update(env_extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, *code_or_args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def triton_results() -> dict[str, list[str]]:
    if not HAS_TRITON:
        pytest.skip("triton not installed")
    proc = _run_python([str(Path(__file__).resolve())], {"TRITON_INTERPRET": "1"})
    if proc.returncode != 0:
        pytest.fail(f"Triton interpreter subprocess failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "check", [_case_id(c) for c in TRITON_CASES] + ["dispatch", "huge_inputs", "small_inputs", "empty"]
)
def test_triton_kernel_matches_reference(triton_results, check):
    assert check in triton_results
    assert not triton_results[check], "\n".join(triton_results[check])


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lb", [25.0, None])
def test_triton_kernel_compiled_on_cuda(dtype, lb):
    # the compiled (non-interpreted) kernel, reached through auto-dispatch
    torch.manual_seed(0)
    shape = (3, 5000)
    g = (torch.randn(shape, device="cuda") * 4).to(dtype)
    u = (torch.randn(shape, device="cuda") * 40).to(dtype)
    dz = torch.randn(shape, device="cuda").to(dtype)
    g1, u1 = g.clone().requires_grad_(), u.clone().requires_grad_()
    g2, u2 = g.clone().requires_grad_(), u.clone().requires_grad_()
    z1 = situ_glu(g1, u1, linear_beta=lb)
    assert "k3_situ_glu_triton" in type(z1.grad_fn).__name__  # the kernel's custom op
    z1.backward(dz)
    z2 = situ_glu_reference(g2, u2, linear_beta=lb)
    z2.backward(dz)
    tols = TOLS["float32" if dtype == torch.float32 else "bfloat16"]
    torch.testing.assert_close(z1, z2, **tols)
    torch.testing.assert_close(g1.grad, g2.grad, **tols)
    torch.testing.assert_close(u1.grad, u2.grad, **tols)


def test_imports_and_falls_back_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch\n"
        "from components.ops import activations as A\n"
        "from components.ops.triton import situ_glu as K\n"
        "assert not K.HAS_TRITON\n"
        "a = torch.tensor([2.0]); b = torch.tensor([3.0])\n"
        "assert abs(A.situ_glu(a, b).item() - 4.861) < 1e-3\n"
        "try:\n"
        "    A.situ_glu(a, b, backend='triton')\n"
        "except RuntimeError as e:\n"
        "    assert 'triton' in str(e)\n"
        "else:\n"
        "    raise AssertionError('backend=triton without triton did not raise')\n"
        "print('ok')\n"
    )
    proc = _run_python(["-c", code], {})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-4000:]


if __name__ == "__main__":
    # run by `triton_results` with TRITON_INTERPRET=1 set; last stdout line is the JSON result
    print(json.dumps(_triton_checks()))
