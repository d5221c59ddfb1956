"""MoE cost, measured side by side: expert dispatch backends, whole MoE FFN forms against a dense FFN of
the same active FLOPs, and each balancer's per-step update.

    PYTHONPATH=. python benchmarks/moe.py [--iters 10 --dtype fp32 --device cpu] [--only experts|forms|balancers]

1. experts: routed-expert forward+backward, each grouped dispatch (grouped_mm, blocked, padded bmm) vs the
   per-expert loop (random top-k routing with mildly uneven loads).
2. forms: forward+backward of ``moe``, ``latent_moe`` and ``stable_latent_moe`` (router, dispatch, latent
   projections, no shared experts), each against a dense SiTU-GLU FFN whose hidden width gives the same
   parameters per token (default 4096 tokens, d 512, 64 experts top-4 of width 256; ``--form-size``).
   Target: grouped MoE <= 1.3x dense.
3. products: the floor under any dispatch, one expert matrix product as grouped_mm / bmm vs one dense
   product of the same FLOPs.
4. balancers: one optimizer-step update of each balancer (statistics -> loss term or bias) after a
   forward of the same layer, against that forward+backward.

Candidates are timed interleaved (one call of each per round, order rotated every round) so clock and
thermal drift hits all of them alike; medians are printed with ratios.
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

from components.balancers.aux_loss import AuxLossConfig  # noqa: E402
from components.balancers.none import NoBalancerConfig  # noqa: E402
from components.balancers.qb import QBConfig  # noqa: E402
from components.balancers.signsgd import SignSGDConfig  # noqa: E402
from components.ffn.dense import DenseFFNConfig  # noqa: E402
from components.ffn.experts import RoutedExperts, experts_reference, grouped_mm_supported  # noqa: E402
from components.ffn.glu_activation import glu_activation  # noqa: E402
from components.ffn.moe import LatentMoEConfig, MoEFFNConfig, StableLatentMoEConfig  # noqa: E402
from components.nn.build_context import BuildContext
from components.registry import BALANCERS, FFNS  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# (tokens, experts, top_k, d_in, hidden m)
SIZES = [(512, 8, 2, 256, 256), (2048, 16, 2, 256, 512), (4096, 64, 4, 128, 256)]
# FFN-form comparison: tokens, d_model, experts, top_k, expert hidden m
FORM_SIZE = "4096,512,64,4,256"
FORMS = {"moe": MoEFFNConfig, "latent_moe": LatentMoEConfig, "stable_latent_moe": StableLatentMoEConfig}
BALANCER_CONFIGS = {
    "none": NoBalancerConfig(),
    "aux_loss": AuxLossConfig(),
    "signsgd": SignSGDConfig(),
    "qb": QBConfig(),
    "qb-exact": QBConfig(estimator="exact"),
}


def time_interleaved(
    fns: dict[str, Callable[[], None]], iters: int, warmup: int, device: torch.device
) -> dict[str, float]:
    """Median seconds per call of each fn, interleaved (benchmarks/timing.py)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    return medians(_time_interleaved(fns, iters, warmup=warmup, sync=sync))


def routing(N: int, E: int, k: int, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, E, generator=g) + torch.linspace(0, 1.5, E)  # uneven loads
    w, idx = torch.sigmoid(logits).topk(k, dim=1)
    return idx.to(device), (w / w.sum(1, keepdim=True)).to(device)


def fwd_bwd(module: torch.nn.Module, x: torch.Tensor, gy: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        x.grad = None
        for prm in module.parameters():
            prm.grad = None
        module(x).backward(gy)

    return step


def bench_experts(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    act = glu_activation("situ_glu", beta=4.0, linear_beta=25.0)
    print("\n[experts] routed experts forward+backward")
    backends = ("grouped_mm", "blocked", "padded_bmm")
    print(
        f"{'tokens':>6} {'E':>4} {'k':>2} {'d':>5} {'m':>5} | {'loop ms':>9} "
        + " ".join(f"{b + ' ms':>13}" for b in backends)
        + " | "
        + " ".join(f"{'loop/' + b:>16}" for b in backends)
    )
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

        fns = {b: run(b) for b in ("loop", "blocked", "padded_bmm")}
        if grouped_mm_supported(x, ex.w1.transpose(-2, -1)):
            fns["grouped_mm"] = run("grouped_mm")
        t = time_interleaved(fns, args.iters, args.warmup, device)
        ms = {b: t.get(b, float("nan")) for b in backends}
        print(
            f"{N:>6} {E:>4} {k:>2} {d:>5} {m:>5} | {1e3 * t['loop']:>9.2f} "
            + " ".join(f"{1e3 * ms[b]:>13.2f}" for b in backends)
            + " | "
            + " ".join(f"{t['loop'] / ms[b]:>16.2f}" for b in backends)
        )


def form_size(args: argparse.Namespace) -> tuple[int, int, int, int, int]:
    """(tokens, d_model, experts, top_k, expert hidden m)."""
    return tuple(int(v) for v in args.form_size.split(","))  # type: ignore[return-value]


def build_forms(
    size: tuple[int, int, int, int, int], device: torch.device, dtype: torch.dtype
) -> dict[str, torch.nn.Module]:
    """The three MoE forms (no shared experts), each with a dense FFN of the same parameters per token
    (``dense=<form>``); the latent forms multiply fewer weights per token, so each gets its own."""
    N, d, E, k, m = size
    modules = {}
    for name, cls in FORMS.items():
        cfg = cls(num_experts=E, top_k=k, expert_hidden_dim=m, num_shared_experts=0)
        modules[name] = FFNS.build(cfg, BuildContext(d))
        hidden = round(modules[name].active_params() / (3 * d))
        modules[f"dense={name}"] = FFNS.build(DenseFFNConfig(hidden_dim=hidden), BuildContext(d))
    return {n: mod.to(device=device, dtype=dtype) for n, mod in modules.items()}


def bench_forms(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    N, d, E, k, m = form_size(args)
    torch.manual_seed(0)
    modules = build_forms(form_size(args), device, dtype)
    active = {n: mod.active_params() for n, mod in modules.items()}
    x = torch.randn(1, N, d, device=device, dtype=dtype, requires_grad=True)
    gy = torch.randn(1, N, d, device=device, dtype=dtype)
    if args.compile:
        modules = {n: torch.compile(mod, dynamic=False) for n, mod in modules.items()}
    t = time_interleaved({n: fwd_bwd(mod, x, gy) for n, mod in modules.items()}, args.iters, args.warmup, device)
    mode = "compiled" if args.compile else "eager"
    print(
        f"\n[forms] FFN forward+backward ({mode}, {args.dtype}), {N} tokens, d={d}, {E} experts top-{k}, m={m}, "
        "no shared experts"
    )
    print(f"{'ffn':>18} | {'active params':>13} | {'ms':>8} | {'dense ms':>8} | {'/ dense':>7}")
    for n in FORMS:
        dense = f"dense={n}"
        print(f"{n:>18} | {active[n]:>13,} | {1e3 * t[n]:>8.2f} | {1e3 * t[dense]:>8.2f} | {t[n] / t[dense]:>7.2f}")


def bench_products(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    """The floor under any dispatch: one expert matrix product (fwd+bwd) over all routed rows, as torch's
    grouped product, as a batched product of equal groups, and as one dense product of the same FLOPs."""
    N, d, E, k, m = form_size(args)
    rows = N * k // E
    x = torch.randn(E * rows, d, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(E, m, d, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(E * rows, m, device=device, dtype=dtype)
    offs = torch.arange(1, E + 1, device=device, dtype=torch.int32) * rows
    xd = torch.randn(N, d, device=device, dtype=dtype, requires_grad=True)
    wd = torch.randn(k * m, d, device=device, dtype=dtype, requires_grad=True)
    gd = torch.randn(N, k * m, device=device, dtype=dtype)
    fns = {
        "dense mm": lambda: (xd @ wd.T).backward(gd),
        "bmm": lambda: torch.bmm(x.view(E, rows, d), w.transpose(1, 2)).backward(g.view(E, rows, m)),
    }
    if grouped_mm_supported(x, w.transpose(-2, -1)):
        fns["grouped_mm"] = lambda: torch.nn.functional.grouped_mm(x, w.transpose(-2, -1), offs=offs).backward(g)
    t = time_interleaved(fns, args.iters, args.warmup, device)
    print(
        f"\n[products] one expert matrix fwd+bwd: {E} groups of {rows} x {d} -> {m} "
        f"vs dense {N} x {d} -> {k * m} (same FLOPs)"
    )
    for n in fns:
        print(f"{n:>12} | {1e3 * t[n]:>8.2f} ms | {t[n] / t['dense mm']:>5.2f}x dense")


def bench_balancers(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    N, d, E, k, m = form_size(args)
    torch.manual_seed(0)
    layer = FFNS.build(
        StableLatentMoEConfig(num_experts=E, top_k=k, expert_hidden_dim=m, num_shared_experts=0), BuildContext(d)
    )
    layer = layer.to(device=device, dtype=dtype)
    x = torch.randn(1, N, d, device=device, dtype=dtype)
    gy = torch.randn(1, N, d, device=device, dtype=dtype)

    def train_step() -> None:
        xg = x.detach().requires_grad_()
        layer(xg).backward(gy)

    def forward_only() -> None:
        with torch.no_grad():
            layer(x)

    fns = {"fwd+bwd": train_step, "forward": forward_only}
    for name, cfg in BALANCER_CONFIGS.items():
        bal = BALANCERS.build(cfg)
        bal.attach(layer)

        def update(bal=bal) -> None:
            bal.attach(layer)  # this balancer's statistics mode (they differ between estimators)
            with torch.no_grad():
                layer(x)
            aux = bal.aux_loss(layer)
            if aux is not None:
                aux.detach()
            bal.step(layer)

        fns[name] = update
    t = time_interleaved(fns, args.iters, args.warmup, device)
    t_fwd = t["forward"]
    print(
        f"\n[balancers] stable_latent_moe layer, {N} tokens, {E} experts top-{k}: (forward + update) - forward, "
        "against forward+backward"
    )
    print(f"{'balancer':>10} | {'update ms':>9} | {'/ fwd+bwd':>9}")
    for name in BALANCER_CONFIGS:
        cost = max(0.0, t[name] - t_fwd)
        print(f"{name:>10} | {1e3 * cost:>9.2f} | {cost / t['fwd+bwd']:>9.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--only", choices=["experts", "products", "forms", "balancers"], default=None)
    p.add_argument(
        "--compile", action="store_true", help="forms: time torch.compile'd modules (as trainer.compile does)"
    )
    p.add_argument(
        "--form-size", default=FORM_SIZE, help="forms and balancers: tokens,d_model,experts,top_k,expert_hidden"
    )
    args = p.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    print(
        f"torch {torch.__version__}, {device}, {args.dtype}, threads {torch.get_num_threads()}, median of {args.iters}"
    )
    for name, fn in (
        ("experts", bench_experts),
        ("products", bench_products),
        ("forms", bench_forms),
        ("balancers", bench_balancers),
    ):
        if args.only in (None, name):
            fn(args, device, dtype)


if __name__ == "__main__":
    main()
