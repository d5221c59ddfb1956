"""SiTU-GLU forward+backward timing: PyTorch reference vs its exp form vs fused Triton kernel vs SwiGLU.

    PYTHONPATH=. python benchmarks/situ_glu.py [--rows 8192 --cols 3072 --dtype bf16 --iters 50 --compile]

``situ_exp`` is what the ``torch`` back-end runs (``situ_glu_exp_form``: exponentials of non-positive
arguments, a hand-written backward); ``--compile`` times every PyTorch candidate through ``torch.compile``, as
compiled layers run them (one fused pass forward, one backward).

Candidates are timed interleaved (one call of each per round, order rotated every
round) so clock/thermal drift hits all of them alike; medians are reported with
ratios. The Triton path needs CUDA; on CPU only the PyTorch paths are timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable without PYTHONPATH

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import time_interleaved as _time_interleaved  # noqa: E402

from components.ops.activations import (  # noqa: E402
    SITU_BETA,
    SITU_LINEAR_BETA,
    situ_glu_exp_form,
    situ_glu_reference,
    swiglu,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_rounds(
    fns: dict[str, Callable[[], None]], iters: int, warmup: int, device: torch.device
) -> dict[str, list[float]]:
    """Seconds per call of each fn over interleaved rounds (benchmarks/timing.py)."""
    return _time_interleaved(fns, iters, warmup=warmup, sync=lambda: _sync(device))


def make_fwd_bwd(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], gate, up, grad_z) -> Callable[[], None]:
    def step() -> None:
        gate.grad = up.grad = None
        fn(gate, up).backward(grad_z)

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--cols", type=int, default=3072)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--iters", type=int, default=None, help="timed rounds (default: 50 on CUDA, 5 on CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds (default: 5 on CUDA, 1 on CPU)")
    p.add_argument("--compile", action="store_true", help="time the PyTorch candidates through torch.compile")
    args = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_cuda = device.type == "cuda"
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if on_cuda else torch.float32)
    iters = args.iters or (50 if on_cuda else 5)
    warmup = args.warmup if args.warmup is not None else (5 if on_cuda else 1)

    torch.manual_seed(0)
    shape = (args.rows, args.cols)  # [tokens, expert intermediate]
    gate = (torch.randn(shape, device=device) * 4).to(dtype).requires_grad_()
    up = (torch.randn(shape, device=device) * 40).to(dtype).requires_grad_()
    grad_z = torch.randn(shape, device=device).to(dtype)

    wrap = torch.compile if args.compile else (lambda f: f)
    fns = {
        "situ_ref": make_fwd_bwd(
            wrap(lambda g, u: situ_glu_reference(g, u, SITU_BETA, SITU_LINEAR_BETA)), gate, up, grad_z
        ),
        "situ_exp": make_fwd_bwd(
            wrap(lambda g, u: situ_glu_exp_form(g, u, SITU_BETA, SITU_LINEAR_BETA)), gate, up, grad_z
        ),
        "swiglu": make_fwd_bwd(wrap(swiglu), gate, up, grad_z),
    }
    triton_note = None
    if on_cuda:
        from components.ops.triton.situ_glu import HAS_TRITON, situ_glu_triton  # GPU-only: triton

        if HAS_TRITON:
            fns["situ_triton"] = make_fwd_bwd(
                lambda g, u: situ_glu_triton(g, u, SITU_BETA, SITU_LINEAR_BETA), gate, up, grad_z
            )
        else:
            triton_note = "triton is not installed: Triton path skipped"
    else:
        triton_note = "no CUDA device: the Triton path needs CUDA, timing the PyTorch paths only"

    print(
        f"SiTU-GLU fwd+bwd, shape {list(shape)}, {dtype}, {device}, {iters} interleaved rounds"
        + (", compiled" if args.compile else ", eager")
    )
    if triton_note:
        print(triton_note)
    times = time_rounds(fns, iters, warmup, device)
    med = {name: statistics.median(ts) for name, ts in times.items()}

    # fwd+bwd touches gate, up, grad_z (read) and z, grad_gate, grad_up (write) at minimum
    min_bytes = 6 * gate.numel() * gate.element_size()
    print(
        f"{'candidate':<12} {'median ms':>10} {'min ms':>8} {'GB/s (6 tensors)':>17} {'/ situ_ref':>11} {'/ swiglu':>9}"
    )
    for name, t in med.items():
        print(
            f"{name:<12} {t * 1e3:>10.3f} {min(times[name]) * 1e3:>8.3f} {min_bytes / t / 1e9:>17.1f} "
            f"{t / med['situ_ref']:>11.3f} {t / med['swiglu']:>9.3f}"
        )
    print(f"exp form vs reference: {med['situ_ref'] / med['situ_exp']:.2f}x")
    if "situ_triton" in med:
        print(
            f"speedup of Triton over reference: {med['situ_ref'] / med['situ_triton']:.2f}x; "
            f"Triton SiTU-GLU vs PyTorch SwiGLU: {med['situ_triton'] / med['swiglu']:.2f}x the time"
        )


if __name__ == "__main__":
    main()
