"""fla's KDA kernels run by Triton's interpreter on a CPU (tests/reference/triton_shims.py), at tiny sizes: the
bounded-gate path the mixer takes for K3's gate (``safe_gate=True``, gate >= -5 per step) gives the result of
fla's general path, in fp32 and in bf16, with and without documents, forward and backward.

"The same result" at working precision: the two paths differ from each other by no more than they differ
from the exact (fp64) result of the torch chunked form (in bf16 by far less: they round alike)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def interpreted() -> list[dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, __file__], cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["float32", "bfloat16", "float32 varlen", "bfloat16 varlen"])
def test_bounded_gate_path_equals_the_general_path(interpreted, case):
    (result,) = [r for r in interpreted if r["case"] == case]
    assert result["safe_vs_general"] <= max(result["safe_vs_exact"], result["general_vs_exact"]), result
    assert result["safe_vs_exact"] < (2e-5 if case.startswith("float32") else 5e-2), result  # sane at all


def _relative(a: dict, b: dict) -> float:
    return max(float((a[n].double() - b[n].double()).norm() / b[n].double().norm()) for n in b)


def main() -> None:
    import torch

    from tests.reference.triton_shims import install_triton_cpu_shims

    install_triton_cpu_shims()
    torch.set_num_threads(1)
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    from components.nn.segments import Segments
    from components.ops.kda import chunk_kda, kda_gate, l2norm

    torch.manual_seed(0)
    B, T, H, K = 2, 96, 2, 16  # two chunks of 64, the second ragged
    x = {
        "q": l2norm(torch.randn(B, T, H, K)),
        "k": l2norm(torch.randn(B, T, H, K)),
        "v": torch.randn(B, T, H, K),
        "g": kda_gate(torch.randn(B, T, H, K), torch.zeros(H), None, lower_bound=-5.0),  # K3's gate, in (-5, 0)
        "beta": torch.sigmoid(torch.randn(B, T, H)),
    }
    do = torch.randn(B, T, H, K)
    starts = torch.zeros(B, T, dtype=torch.long)
    starts[0, 40] = starts[1, 7] = starts[1, 70] = 1
    segments = Segments(starts.cumsum(1))

    def run(fn, dtype):
        xs = {n: (t.to(dtype) if n in ("q", "k", "v") else t).detach().clone().requires_grad_() for n, t in x.items()}
        o = fn(**xs)
        o.backward(do.to(o.dtype))
        return {"out": o.detach(), **{f"d{n}": t.grad for n, t in xs.items()}}

    def fla(safe_gate, varlen):
        def f(q, k, v, g, beta):
            if not varlen:
                return fla_chunk_kda(q, k, v, g, beta, safe_gate=safe_gate)[0]
            flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]
            return fla_chunk_kda(*flat, cu_seqlens=segments.cu_seqlens(), safe_gate=safe_gate)[0].view(B, T, H, K)

        return f

    results = []
    for varlen in (False, True):
        for dtype in (torch.float32, torch.bfloat16):
            seg = segments if varlen else None
            exact = run(lambda q, k, v, g, beta: chunk_kda(q, k, v, g, beta, segments=seg)[0], torch.float64)
            # the exact result on the values fla sees (bf16-rounded q/k/v)
            if dtype == torch.bfloat16:
                rounded = {n: (t.bfloat16().double() if n in ("q", "k", "v") else t.double()) for n, t in x.items()}
                xs = {n: t.requires_grad_() for n, t in rounded.items()}
                o = chunk_kda(**xs, segments=seg)[0]
                o.backward(do.double())
                exact = {"out": o.detach(), **{f"d{n}": t.grad for n, t in xs.items()}}
            safe, general = run(fla(True, varlen), dtype), run(fla(False, varlen), dtype)
            results.append(
                {
                    "case": str(dtype).replace("torch.", "") + (" varlen" if varlen else ""),
                    "safe_vs_general": _relative(safe, general),
                    "safe_vs_exact": _relative(safe, exact),
                    "general_vs_exact": _relative(general, exact),
                }
            )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
