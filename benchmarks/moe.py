"""Routed-expert forward+backward timing: grouped dispatch (grouped_mm, padded bmm) vs the per-expert loop.

    PYTHONPATH=. python benchmarks/moe.py [--iters 10 --dtype fp32 --device cpu]

For each size the candidates are timed interleaved (one call of each per round, order rotated every
round) so clock/thermal drift hits all of them alike; medians are printed with ratios to the loop
reference. Routing is random top-k with mildly uneven expert loads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable without PYTHONPATH

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import medians  # noqa: E402
from timing import time_interleaved as _time_interleaved  # noqa: E402
from components.ffn.experts import RoutedExperts, experts_reference, grouped_mm_supported  # noqa: E402
from components.ops.activations import glu_activation  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# (tokens, experts, top_k, d_in, hidden m)
SIZES = [(512, 8, 2, 256, 256), (2048, 16, 2, 256, 512), (4096, 64, 4, 128, 256)]


def time_interleaved(fns: dict[str, Callable[[], None]], iters: int, warmup: int, device: torch.device) -> dict[str, float]:
    """Median seconds per call of each fn, interleaved (benchmarks/timing.py)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    return medians(_time_interleaved(fns, iters, warmup=warmup, sync=sync))


def routing(N: int, E: int, k: int, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, E, generator=g) + torch.linspace(0, 1.5, E)  # uneven loads
    w, idx = torch.sigmoid(logits).topk(k, dim=1)
    return idx.to(device), (w / w.sum(1, keepdim=True)).to(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    act = glu_activation("situ_glu", beta=4.0, linear_beta=25.0)
    print(f"torch {torch.__version__}, {device}, {args.dtype}, threads {torch.get_num_threads()}, median of {args.iters}")
    print(f"{'tokens':>6} {'E':>4} {'k':>2} {'d':>5} {'m':>5} | {'loop ms':>9} {'grouped_mm ms':>13} {'padded_bmm ms':>13} | {'loop/grouped':>12} {'loop/padded':>11}")
    for N, E, k, d, m in SIZES:
        torch.manual_seed(0)
        ex = RoutedExperts(E, d, m, act, init_std=0.05).to(device=device, dtype=dtype)
        x = torch.randn(N, d, device=device, dtype=dtype, requires_grad=True)
        idx, w = routing(N, E, k, device)
        gy = torch.randn(N, d, device=device, dtype=dtype)

        def run(backend: str) -> Callable[[], None]:
            def step() -> None:
                x.grad = None
                for prm in ex.parameters():
                    prm.grad = None
                if backend == "loop":
                    y = experts_reference(x, idx, w, ex.w1, ex.w2, ex.w3, act)
                else:
                    ex.dispatch = backend
                    y = ex(x, idx, w)
                y.backward(gy)

            return step

        fns = {"loop": run("loop"), "padded_bmm": run("padded_bmm")}
        if grouped_mm_supported(x, ex.w1.transpose(-2, -1)):
            fns["grouped_mm"] = run("grouped_mm")
        t = time_interleaved(fns, args.iters, args.warmup, device)
        tg = t.get("grouped_mm", float("nan"))
        print(
            f"{N:>6} {E:>4} {k:>2} {d:>5} {m:>5} | {1e3 * t['loop']:>9.2f} {1e3 * tg:>13.2f} {1e3 * t['padded_bmm']:>13.2f} | "
            f"{t['loop'] / tg:>12.2f} {t['loop'] / t['padded_bmm']:>11.2f}"
        )


if __name__ == "__main__":
    main()
