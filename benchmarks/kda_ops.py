"""KDA core forward+backward timing: chunked form vs token recurrence vs causal SDPA (CPU).

    PYTHONPATH=. python benchmarks/kda_ops.py [--quick] [--T 512 1024 2048 4096] [--gate init|bound]

One run measures everything: per sequence length the three candidates are timed interleaved
(one call each per round, order rotated every round) and medians are reported, with the ratios
recurrent / chunk and chunk / sdpa. Shapes: B=1, H=4, K=V=64, fp32. Each call is a full
forward plus backward against a fixed random output gradient, grads reset to None before it.

Gates: ``init`` draws the K3 lower-bound gate (-5 * sigmoid(f + dt_bias), A_log = 0) with fla's
dt_bias init, i.e. per-step log-decays of roughly -0.5 .. 0; ``bound`` pins every step at -5,
the slowest case for the chunked form (it then works on 16-token chunks). The recurrence is slow
at long T: ``--quick`` times it on fewer rounds.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable without PYTHONPATH
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import medians, time_interleaved  # noqa: E402

from components.ops.kda import _choose_chunking, chunk_kda, kda_gate, l2norm, recurrent_kda  # noqa: E402

B, H, K, V = 1, 4, 64, 64


def make_inputs(T: int, gate: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    q = l2norm(torch.randn(B, T, H, K, generator=gen))
    k = l2norm(torch.randn(B, T, H, K, generator=gen))
    v = torch.randn(B, T, H, V, generator=gen)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    if gate == "bound":
        g = torch.full((B, T, H, K), -5.0)
    else:
        dt = torch.exp(torch.empty(H * K).uniform_(-6.907, -2.303, generator=gen))  # fla dt init
        dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        f = torch.randn(B, T, H, K, generator=gen)
        g = kda_gate(f, torch.zeros(H), dt_bias, lower_bound=-5.0)
    return {n: x.requires_grad_() for n, x in dict(q=q, k=k, v=v, g=g, beta=beta).items()}


def kda_step(fn: Callable, x: dict[str, torch.Tensor], do: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        for t in x.values():
            t.grad = None
        o, _ = fn(x["q"], x["k"], x["v"], x["g"], x["beta"])
        o.backward(do)

    return step


def sdpa_step(T: int, gen: torch.Generator) -> Callable[[], None]:
    qkv = [torch.randn(B, H, T, K, generator=gen).requires_grad_() for _ in range(3)]
    do = torch.randn(B, H, T, V, generator=gen)

    def step() -> None:
        for t in qkv:
            t.grad = None
        F.scaled_dot_product_attention(*qkv, is_causal=True).backward(do)

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--repeats", type=int, default=7, help="timed rounds for chunk and sdpa")
    p.add_argument("--rec-repeats", type=int, default=None, help="timed calls of the recurrence (default: --repeats)")
    p.add_argument("--quick", action="store_true", help="time the recurrence on 2 rounds (1 at T >= 4096)")
    p.add_argument("--gate", choices=["init", "bound"], default="init")
    p.add_argument("--chunk-size", type=int, default=64)
    args = p.parse_args()

    print(f"KDA fwd+bwd, B={B} H={H} K=V={K} fp32, CPU threads={torch.get_num_threads()}, gates={args.gate}")
    print(
        f"{'T':>6} {'chunk ms':>10} {'recur ms':>10} {'sdpa ms':>10} {'recur/chunk':>12} {'chunk/sdpa':>11}  chunk path"
    )
    for T in args.T:
        gen = torch.Generator().manual_seed(T)
        x = make_inputs(T, args.gate, gen)
        do = torch.randn(B, T, H, V, generator=gen)
        chunk = lambda *a: chunk_kda(*a, chunk_size=args.chunk_size)  # noqa: E731
        fns = {"chunk": kda_step(chunk, x, do), "recur": kda_step(recurrent_kda, x, do), "sdpa": sdpa_step(T, gen)}
        rec_n = args.rec_repeats or args.repeats
        if args.quick:
            rec_n = 1 if T >= 4096 else 2
        times = time_interleaved(fns, {"chunk": args.repeats, "recur": rec_n, "sdpa": args.repeats})
        m = {n: 1e3 * s for n, s in medians(times).items()}
        C, _, mode = _choose_chunking(x["g"].detach(), args.chunk_size, torch.float32)
        print(
            f"{T:>6} {m['chunk']:>10.2f} {m['recur']:>10.1f} {m['sdpa']:>10.2f} "
            f"{m['recur'] / m['chunk']:>11.1f}x {m['chunk'] / m['sdpa']:>10.2f}x  C={C} {mode}"
        )


if __name__ == "__main__":
    main()
