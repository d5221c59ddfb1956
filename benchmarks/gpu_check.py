"""One GPU check of every CUDA path: kernel parity against the PyTorch references, speed, training
throughput and MFU, and an FSDP2 step, printed as one table.

    python -m benchmarks.gpu_check               # on one GPU (H200: about 5-8 minutes)
    python -m benchmarks.gpu_check --quick       # smaller sizes and fewer steps (about 2-3 minutes)
    python -m benchmarks.gpu_check --dry-run     # list the checks and sizes, run nothing (seconds)
    python -m benchmarks.gpu_check --only kda_fla,fsdp2 --peak-tflops 989

Checks (each a row; ``--only`` takes these names, comma-separated):

1. ``kda_fla``: fla's ``chunk_kda`` (bf16 q/k/v, fp32 gate and beta, called as
   ``components/mixers/kda.py::_fla_core`` calls it) against ``components.ops.kda.chunk_kda`` in fp32 on
   the same bf16-rounded inputs, forward+backward, at two sequence lengths; gate ``kda_gate`` with lower
   bound -5. ``kda_fla_varlen``: the same with document masking: fla's variable-length form (the rows
   flattened, ``cu_seqlens`` from ``Segments``, as ``_fla_core`` calls it) against ``chunk_kda(...,
   segments=...)`` (documents packed onto chunk boundaries, state reset there), random document
   lengths including very short ones. ``kda_mixer``: the whole KDA mixer under bf16 autocast,
   ``backend=fla`` against ``torch``.
2. ``attnres_fla``: ``components.ops.attnres.attnres_read`` with ``backend=fla`` against ``backend=torch``,
   sources passed as a list as the residual schemes pass them, forward+backward.
3. ``situ_glu_triton``: ``situ_glu(backend="triton")`` against ``situ_glu_reference``, forward+backward.
4. ``moe_experts``: grouped dispatch (``grouped_mm``) of ``RoutedExperts`` against the per-expert loop
   ``experts_reference`` (parity and speed); ``moe_vs_dense[<form>]``: each MoE form against a dense
   SiTU-GLU FFN of the same active parameters (``benchmarks/moe.py``), time ratio, goal <= 1.3x.
5. ``train_default`` / ``train_default_compiled`` / ``train_k3_small``: forward+backward+optimizer step
   (the config's optimizer and balancer) under bf16 autocast: tokens/s and MFU = ``flops_per_token(T)`` x
   tokens/s / bf16 peak (from the device name, ``--peak-tflops`` overrides; else a measured matmul).
   k3_small is scaled to d_model 1024 with 128-wide KDA heads and ``residual.backend=auto``.
   The compiled row's reference is the eager step; compile-unfriendly models (KDA, MoE) run eager only.
6. ``fsdp2``: a single-process group (world size 1), ``fully_shard`` per decoder layer then the root (as
   ``runtime/lit_module.py::configure_model``), one forward/backward/step; its losses before and after the
   step against the unsharded model's.

Columns: ``max_abs`` / ``rel`` are the largest absolute error and the worst relative RMS error
(``rms(fast - ref) / rms(ref)``) over the output and every gradient (the note names the worst tensor);
``tol`` bounds ``rel``; ``fast_ms`` / ``ref_ms`` are medians of interleaved rounds
(``benchmarks/timing.py``) and ``fast/ref`` their ratio (below 1: the fast path is faster).
Status: ``pass`` / ``FAIL`` (parity), ``ok`` (measurement only), ``skipped`` (with the reason), ``error``
(the exception; the other checks still run). The exit status is 1 when a row FAILs or errors, else 0.
Without CUDA (or with ``--dry-run``) every row is ``skipped`` with the reason, and the exit status is 0.
``--budget-s`` (default 420) skips the checks that would start after that many seconds; the FSDP2 check
runs before the training rows, so a spent budget costs measurements, not parity checks.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import math
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from components.nn.build_context import BuildContext

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also runnable as a script

from benchmarks.timing import medians, time_interleaved
from benchmarks.train_step import train_setup
from components.objective import cross_entropy
from runtime.launch import validate_overrides

GOAL_MOE_VS_DENSE = 1.3
NO_CUDA = "no CUDA device: torch.cuda.is_available() is False"
DRY_RUN = "--dry-run: nothing is run"


# ------------------------------------------------------------------------------------------------
# rows, parity, exit status
# ------------------------------------------------------------------------------------------------
@dataclass
class Row:
    """One line of the table."""

    check: str
    size: str
    status: str = ""  # pass | FAIL | ok | skipped | error
    max_abs: float | None = None
    rel: float | None = None
    tol: float | None = None
    fast_ms: float | None = None
    ref_ms: float | None = None
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.fast_ms is None or not self.ref_ms:
            return None
        return self.fast_ms / self.ref_ms

    def add_note(self, text: str) -> None:
        self.note = f"{self.note}; {text}" if self.note else text


class Skip(Exception):
    """Raised by a check that cannot run here; its message is the reason."""


def judge(row: Row) -> str:
    """``pass`` / ``FAIL`` for a row with a tolerance (NaN or a missing error fails), else ``ok``."""
    if row.tol is None:
        return "ok"
    rel = row.rel if row.rel is not None else math.nan
    return "pass" if math.isfinite(rel) and rel <= row.tol else "FAIL"


def exit_status(rows: Sequence[Row]) -> int:
    """1 when any row failed its parity check or raised, else 0 (skipped rows do not count)."""
    return 1 if any(r.status in ("FAIL", "error") for r in rows) else 0


def compare(out: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]) -> tuple[float, float, str]:
    """(max abs error, worst relative RMS error, name of that tensor) of ``out`` against ``ref``.

    Relative RMS error of one pair: ``rms(a - b) / rms(b)``, in fp64; non-finite values give inf.
    """
    max_abs, worst, worst_name = 0.0, 0.0, ""
    for name, b in ref.items():
        a = out[name]
        if a.shape != b.shape:
            raise ValueError(f"{name}: shape {tuple(a.shape)} vs reference {tuple(b.shape)}")
        a64, b64 = a.detach().double(), b.detach().double()
        diff = a64 - b64
        if not (torch.isfinite(a64).all() and torch.isfinite(b64).all()):
            err, rel = math.inf, math.inf
        else:
            err = float(diff.abs().max()) if diff.numel() else 0.0
            rel = float(diff.norm() / b64.norm().clamp_min(1e-30)) if diff.numel() else 0.0
        max_abs = max(max_abs, err)
        if rel > worst or not worst_name:
            worst, worst_name = rel, name
    return max_abs, worst, worst_name


def set_parity(row: Row, out: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor], tol: float) -> None:
    row.max_abs, row.rel, worst = compare(out, ref)
    row.tol = tol
    row.add_note(f"worst: {worst}")


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


COLUMNS = (
    ("check", 32, "<"),
    ("size", 36, "<"),
    ("status", 7, "<"),
    ("max_abs", 9, ">"),
    ("rel", 9, ">"),
    ("tol", 7, ">"),
    ("fast_ms", 9, ">"),
    ("ref_ms", 9, ">"),
    ("fast/ref", 8, ">"),
    ("note", 0, "<"),
)


def format_table(rows: Sequence[Row]) -> str:
    lines = [" ".join(f"{name:{al}{w}}" if w else name for name, w, al in COLUMNS)]
    for r in rows:
        cells = (
            r.check,
            r.size,
            r.status,
            fmt(r.max_abs, ".2e"),
            fmt(r.rel, ".2e"),
            fmt(r.tol, ".0e"),
            fmt(r.fast_ms, ".2f"),
            fmt(r.ref_ms, ".2f"),
            fmt(r.ratio, ".2f") + ("x" if r.ratio is not None else ""),
            r.note,
        )
        lines.append(" ".join(f"{c:{al}{w}}" if w else c for c, (_, w, al) in zip(cells, COLUMNS)))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------
@dataclass
class Context:
    args: argparse.Namespace
    device: torch.device
    deadline: float = math.inf
    peak: tuple[float, str] | None = None  # (FLOP/s, where it comes from)
    results: dict[str, Any] = field(default_factory=dict)  # what later checks reuse

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time_ms(self, fns: Mapping[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, float]:
        """Median milliseconds per call of each fn, interleaved (benchmarks/timing.py)."""
        return {n: 1e3 * s for n, s in medians(time_interleaved(fns, repeats, warmup=warmup, sync=self.sync)).items()}


@dataclass
class Check:
    name: str
    size: str
    fn: Callable[[Context, Row], None]
    needs: tuple[str, ...] = ()  # "fla", "triton": kernel packages it imports


def import_error(modules: Sequence[str]) -> str | None:
    """None when every module imports, else ``"<module>: <error>"`` of the first that does not."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 -- ImportError, or Triton failing to initialise
            return f"{module}: {type(err).__name__}: {err}"
    return None


NEEDS = {"fla": ("fla.ops.kda", "fla.ops.attnres.fused"), "triton": ("triton",)}


def dry_reason(check: Check, args: argparse.Namespace) -> str:
    """Why a check does not run in dry mode; whether its packages are installed is looked up, not imported."""
    reason = DRY_RUN if args.dry_run else NO_CUDA
    missing = [pkg for pkg in check.needs if importlib.util.find_spec(pkg) is None]
    if missing:
        reason += f"; {', '.join(missing)} not installed"
    return reason


def run_checks(checks: Sequence[Check], ctx: Context, log: Callable[[str], None] = print) -> list[Row]:
    """Run each check in turn; a failing check becomes an ``error`` row and the others still run."""
    rows, unavailable = [], {}
    for i, check in enumerate(checks, 1):
        row = Row(check.name, check.size)
        start = time.perf_counter()
        for pkg in check.needs:
            if pkg not in unavailable:
                err = import_error(NEEDS[pkg])
                unavailable[pkg] = None if err is None else f"{pkg} not importable: {err}"
        reason = next((unavailable[p] for p in check.needs if unavailable[p]), None)
        if reason is None and start > ctx.deadline:
            reason = f"time budget spent (--budget-s {ctx.args.budget_s:g})"
        if reason is not None:
            row.status, row.note = "skipped", reason
        else:
            try:
                check.fn(ctx, row)
                row.status = judge(row)
            except Skip as why:
                row.status, row.note = "skipped", str(why)
            except Exception as err:  # noqa: BLE001 -- any failure becomes an error row
                row.status = "error"
                row.add_note(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300])
                traceback.print_exc(file=sys.stderr)
            finally:
                gc.collect()
                if ctx.device.type == "cuda":
                    torch.cuda.empty_cache()
        rows.append(row)
        log(f"[{i}/{len(checks)}] {check.name} {check.size}: {row.status} ({time.perf_counter() - start:.1f} s)")
    return rows


# ------------------------------------------------------------------------------------------------
# 1. KDA: fla's kernels against the torch chunked form
# ------------------------------------------------------------------------------------------------
def kda_inputs(B: int, T: int, H: int, K: int, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random KDA inputs as the mixer produces them (fp32): L2-normalised q/k, lower-bound gate, beta."""
    from components.ops.kda import kda_gate, l2norm

    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=gen)

    dt = torch.exp(torch.empty(H * K, device=device).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # [H*K], the mixer's init (inverse softplus of dt)
    return {
        "q": l2norm(randn(B, T, H, K)),  # [B, T, H, K]
        "k": l2norm(randn(B, T, H, K)),  # [B, T, H, K]
        "v": randn(B, T, H, K),  # [B, T, H, V], V = K
        "g": kda_gate(
            randn(B, T, H, K), torch.zeros(H, device=device), dt_bias, lower_bound=-5.0
        ),  # [B, T, H, K] in (-5, 0)
        "beta": torch.sigmoid(randn(B, T, H)),  # [B, T, H]
    }


def fwd_bwd(
    fn: Callable[..., torch.Tensor],
    inputs: Mapping[str, torch.Tensor],
    grad_out: torch.Tensor,
    params: Sequence[torch.nn.Parameter] = (),
) -> Callable[[], torch.Tensor]:
    """A step: reset grads, ``fn(**inputs)``, backward against ``grad_out``; returns the output."""

    def step() -> torch.Tensor:
        for t in (*inputs.values(), *params):
            t.grad = None
        out = fn(**inputs)
        out.backward(grad_out)
        return out

    return step


def outputs_and_grads(step: Callable[[], torch.Tensor], named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run ``step`` once; its output and the gradients of ``named`` (``d<name>``), detached copies."""
    out = step()
    got = {"out": out.detach().clone()}
    got.update({f"d{n}": t.grad.detach().clone() for n, t in named.items() if t.grad is not None})
    return got


def check_kda_fla(B: int, T: int, H: int, K: int, tol: float, repeats: int) -> Callable[[Context, Row], None]:
    def run(ctx: Context, row: Row) -> None:
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        from components.ops.kda import chunk_kda

        x = kda_inputs(B, T, H, K, ctx.device)
        # fla: bf16 q/k/v, fp32 gate and beta, as the mixer hands them over under bf16 autocast
        fast_in = {n: (t.bfloat16() if n in ("q", "k", "v") else t).requires_grad_() for n, t in x.items()}
        # reference: the same (bf16-rounded) values in fp32
        ref_in = {n: t.detach().float().requires_grad_() for n, t in fast_in.items()}
        do = torch.randn(B, T, H, K, device=ctx.device).bfloat16()  # [B, T, H, V]

        def fla(q, k, v, g, beta):  # the call of KimiDeltaAttention._fla_core (no cache)
            return fla_chunk_kda(q, k, v, g, beta, initial_state=None, output_final_state=False)[0]

        def ref(q, k, v, g, beta):
            return chunk_kda(q, k, v, g, beta)[0]

        steps = {"fla": fwd_bwd(fla, fast_in, do), "torch": fwd_bwd(ref, ref_in, do.float())}
        set_parity(row, outputs_and_grads(steps["fla"], fast_in), outputs_and_grads(steps["torch"], ref_in), tol)
        t = ctx.time_ms(steps, repeats)
        row.fast_ms, row.ref_ms = t["fla"], t["torch"]
        row.add_note("fla bf16 vs torch chunk_kda fp32, fwd+bwd")

    return run


def random_segments(B: int, T: int, mean_len: int, device: torch.device, seed: int = 0):
    """``Segments`` of B rows with about T / mean_len documents each at random places, plus a 3-token one."""
    from components.nn.segments import Segments

    gen = torch.Generator().manual_seed(seed)
    starts = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        cut = torch.randint(1, T - 4, (max(1, T // mean_len),), generator=gen)
        starts[b, cut] = 1
        starts[b, cut[0] + 3] = 1  # the document at cut[0] is 3 tokens long (if no other cut falls inside)
    return Segments(starts.cumsum(1).to(device))


def check_kda_fla_varlen(B: int, T: int, H: int, K: int, tol: float, repeats: int) -> Callable[[Context, Row], None]:
    def run(ctx: Context, row: Row) -> None:
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        from components.ops.kda import chunk_kda

        x = kda_inputs(B, T, H, K, ctx.device, seed=1)
        segments = random_segments(B, T, 500, ctx.device)
        fast_in = {n: (t.bfloat16() if n in ("q", "k", "v") else t).requires_grad_() for n, t in x.items()}
        ref_in = {n: t.detach().float().requires_grad_() for n, t in fast_in.items()}
        do = torch.randn(B, T, H, K, device=ctx.device).bfloat16()  # [B, T, H, V]

        def fla(q, k, v, g, beta):  # the varlen call of KimiDeltaAttention._fla_core
            flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]  # [1, B*T, ...]
            return fla_chunk_kda(*flat, cu_seqlens=segments.cu_seqlens())[0].view(B, T, H, K)

        def ref(q, k, v, g, beta):
            return chunk_kda(q, k, v, g, beta, segments=segments)[0]

        steps = {"fla": fwd_bwd(fla, fast_in, do), "torch": fwd_bwd(ref, ref_in, do.float())}
        set_parity(row, outputs_and_grads(steps["fla"], fast_in), outputs_and_grads(steps["torch"], ref_in), tol)
        t = ctx.time_ms(steps, repeats)
        row.fast_ms, row.ref_ms = t["fla"], t["torch"]
        n_docs = len(segments.cu_seqlens()) - 1
        row.add_note(f"{n_docs} documents; fla cu_seqlens bf16 vs torch chunk_kda with segments fp32, fwd+bwd")

    return run


def check_kda_mixer(B: int, T: int, H: int, K: int, tol: float, repeats: int) -> Callable[[Context, Row], None]:
    def run(ctx: Context, row: Row) -> None:
        from components.mixers.kda import KDAConfig, KimiDeltaAttention

        d = H * K
        torch.manual_seed(0)
        mixer = KimiDeltaAttention(
            KDAConfig(n_heads=H, head_dim=K, gate_lower_bound=-5.0, backend="torch"), BuildContext(d)
        ).to(ctx.device)
        params = list(mixer.parameters())
        x = {"x": torch.randn(B, T, d, device=ctx.device).requires_grad_()}  # [B, T, d]
        dy = torch.randn(B, T, d, device=ctx.device).bfloat16()  # [B, T, d]

        def forward(backend: str) -> Callable[..., torch.Tensor]:
            def f(x: torch.Tensor) -> torch.Tensor:
                mixer.cfg.backend = backend
                with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
                    return mixer(x)  # [B, T, d] bf16

            return f

        steps = {b: fwd_bwd(forward(b), x, dy, params) for b in ("fla", "torch")}
        got = {}
        for b, step in steps.items():
            got[b] = outputs_and_grads(step, {**x, **dict(mixer.named_parameters())})
        set_parity(row, got["fla"], got["torch"], tol)
        t = ctx.time_ms(steps, repeats)
        row.fast_ms, row.ref_ms = t["fla"], t["torch"]
        row.add_note("KimiDeltaAttention backend fla vs torch, bf16 autocast, output + all grads")

    return run


# ------------------------------------------------------------------------------------------------
# 2. AttnRes: fla's fused read against the torch read
# ------------------------------------------------------------------------------------------------
def check_attnres(S: int, B: int, T: int, d: int, tol: float, repeats: int) -> Callable[[Context, Row], None]:
    def run(ctx: Context, row: Row) -> None:
        from components.ops.attnres import attnres_read

        gen = torch.Generator(device=ctx.device).manual_seed(0)
        u = torch.randn(S, B, T, d, device=ctx.device, generator=gen).bfloat16()  # [S, B, T, d] sources
        inputs = {f"u{i}": u[i].clone().requires_grad_() for i in range(S)}  # S x [B, T, d], oldest first
        inputs["query"] = (0.3 * torch.randn(d, device=ctx.device, generator=gen)).requires_grad_()  # [d]
        inputs["gain"] = (1.0 + 0.2 * torch.randn(d, device=ctx.device, generator=gen)).requires_grad_()  # [d]
        dy = torch.randn(B, T, d, device=ctx.device, generator=gen).bfloat16()  # [B, T, d]

        def read(backend: str) -> Callable[..., torch.Tensor]:
            def f(query: torch.Tensor, gain: torch.Tensor, **sources: torch.Tensor) -> torch.Tensor:
                # a list of sources, as the residual schemes' _read_and_norm passes them
                return attnres_read(list(sources.values()), query, gain, eps=1e-5, backend=backend)  # [B, T, d]

            return f

        steps = {b: fwd_bwd(read(b), inputs, dy) for b in ("fla", "torch")}
        got = {b: outputs_and_grads(step, inputs) for b, step in steps.items()}
        set_parity(row, got["fla"], got["torch"], tol)
        t = ctx.time_ms(steps, repeats)
        row.fast_ms, row.ref_ms = t["fla"], t["torch"]
        row.add_note("attnres_read backend fla vs torch, bf16 sources, fwd+bwd")

    return run


# ------------------------------------------------------------------------------------------------
# 3. SiTU-GLU: the Triton kernel against the torch reference
# ------------------------------------------------------------------------------------------------
def check_situ(rows_: int, cols: int, tol: float, repeats: int) -> Callable[[Context, Row], None]:
    def run(ctx: Context, row: Row) -> None:
        from components.ops.activations import situ_glu, situ_glu_reference

        torch.manual_seed(0)
        shape = (rows_, cols)  # [tokens, expert intermediate]
        inputs = {
            "gate": (torch.randn(shape, device=ctx.device) * 4).bfloat16().requires_grad_(),  # [N, m]
            "up": (torch.randn(shape, device=ctx.device) * 40).bfloat16().requires_grad_(),  # [N, m]
        }
        dz = torch.randn(shape, device=ctx.device).bfloat16()  # [N, m]
        steps = {
            "triton": fwd_bwd(lambda gate, up: situ_glu(gate, up, backend="triton"), inputs, dz),
            "torch": fwd_bwd(situ_glu_reference, inputs, dz),
        }
        got = {n: outputs_and_grads(s, inputs) for n, s in steps.items()}
        set_parity(row, got["triton"], got["torch"], tol)
        t = ctx.time_ms(steps, repeats, warmup=2)
        row.fast_ms, row.ref_ms = t["triton"], t["torch"]
        row.add_note("situ_glu(backend=triton) vs situ_glu_reference, bf16, fwd+bwd")

    return run


# ------------------------------------------------------------------------------------------------
# 4. MoE: grouped dispatch against the loop, MoE forms against dense FFNs
# ------------------------------------------------------------------------------------------------
def check_moe_experts(
    N: int, E: int, k: int, d: int, m: int, tol: float, repeats: int
) -> Callable[[Context, Row], None]:
    def run(ctx: Context, row: Row) -> None:
        from benchmarks.moe import routing
        from components.ffn.experts import (
            RoutedExperts,
            experts_reference,
            grouped_mm_supported,
        )
        from components.ffn.glu_activation import glu_activation

        act = glu_activation("situ_glu", beta=4.0, linear_beta=25.0)
        torch.manual_seed(0)
        with ctx.device:  # initialised on the device
            ex = RoutedExperts(E, d, m, act, init_std=0.05, dispatch="grouped_mm").to(dtype=torch.bfloat16)
        params = dict(ex.named_parameters())  # w1, w3 [E, m, d]; w2 [E, d, m]
        inputs = {"x": torch.randn(N, d, device=ctx.device, dtype=torch.bfloat16).requires_grad_()}  # [N, d]
        if not grouped_mm_supported(inputs["x"], ex.w1.transpose(-2, -1)):
            raise Skip(
                f"grouped_mm does not run here (torch {torch.__version__}, {ctx.device}; "
                "components.ffn.experts.grouped_mm_supported)"
            )
        idx, w = routing(N, E, k, ctx.device)  # [N, k] expert ids, [N, k] combine weights (uneven loads)
        gy = torch.randn(N, d, device=ctx.device, dtype=torch.bfloat16)  # [N, d]
        steps = {
            "grouped": fwd_bwd(lambda x: ex(x, idx, w), inputs, gy, list(params.values())),
            "loop": fwd_bwd(
                lambda x: experts_reference(x, idx, w, ex.w1, ex.w2, ex.w3, act), inputs, gy, list(params.values())
            ),
        }
        got = {n: outputs_and_grads(s, {**inputs, **params}) for n, s in steps.items()}
        set_parity(row, got["grouped"], got["loop"], tol)
        t = ctx.time_ms(steps, repeats)
        row.fast_ms, row.ref_ms = t["grouped"], t["loop"]
        row.add_note("RoutedExperts dispatch=grouped_mm vs experts_reference loop, bf16, fwd+bwd")

    return run


def check_moe_vs_dense(
    form: str, size: tuple[int, int, int, int, int], repeats: int, last: bool
) -> Callable[[Context, Row], None]:
    def run(ctx: Context, row: Row) -> None:
        from benchmarks.moe import build_forms
        from benchmarks.moe import fwd_bwd as module_step
        from components.ffn.experts import auto_dispatch

        N, d = size[:2]
        key = ("moe_forms", size)
        if key not in ctx.results:  # one build (on the device: no host-side init) serves every form's row
            torch.manual_seed(0)
            with ctx.device:
                ctx.results[key] = build_forms(size, ctx.device, torch.bfloat16)  # each form and its dense twin
        modules = ctx.results[key]
        moe, dense = modules[form], modules[f"dense={form}"]
        x = torch.randn(1, N, d, device=ctx.device, dtype=torch.bfloat16, requires_grad=True)  # [1, N, d]
        gy = torch.randn(1, N, d, device=ctx.device, dtype=torch.bfloat16)  # [1, N, d]
        t = ctx.time_ms({"moe": module_step(moe, x, gy), "dense": module_step(dense, x, gy)}, repeats, warmup=2)
        row.fast_ms, row.ref_ms = t["moe"], t["dense"]
        ex = moe.experts  # RoutedExperts over the (latent) expert width
        dispatch = ex.dispatch if ex.dispatch != "auto" else "auto -> " + auto_dispatch(x.new_empty(1, ex.d_in), ex.w1)
        met = "met" if row.ratio is not None and row.ratio <= GOAL_MOE_VS_DENSE else "MISSED"
        row.add_note(
            f"goal moe/dense <= {GOAL_MOE_VS_DENSE}x: {met}; dispatch {dispatch}; "
            f"{moe.active_params():,} active params each, bf16, fwd+bwd"
        )
        if last:
            del ctx.results[key]

    return run


# ------------------------------------------------------------------------------------------------
# 5. training throughput and MFU
# ------------------------------------------------------------------------------------------------
def peak_flops(ctx: Context) -> tuple[float, str]:
    """bf16 dense peak FLOP/s: ``--peak-tflops``, else the datasheet value of a known device name, else a
    measured bf16 matmul (runtime/callbacks/throughput.py)."""
    if ctx.peak is None:
        if ctx.args.peak_tflops:
            ctx.peak = (ctx.args.peak_tflops * 1e12, "--peak-tflops")
        else:
            from runtime.callbacks.throughput import peak_flops as known_or_measured

            ctx.peak = known_or_measured(ctx.device, "bf16-mixed")
    return ctx.peak


def check_train(
    key: str, overrides: Sequence[str], B: int, T: int, warmup: int, steps: int, compile: bool = False
) -> Callable[[Context, Row], None]:
    def run(ctx: Context, row: Row) -> None:
        root = validate_overrides(list(overrides))
        from components.model import build_on_meta

        unfriendly = build_on_meta(root.decoder_config()).compile_unfriendly()
        mode = ("layers" if unfriendly else "model") if compile else "off"  # as the trainer compiles it
        model, step = train_setup(root, ctx.device, mode)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.vocab_size, (B, T + 1), generator=gen).to(ctx.device)  # [B, T+1]
        losses = []
        ms = ctx.time_ms({"step": lambda: losses.append(step(ids))}, steps, warmup=warmup)["step"]
        if not all(torch.isfinite(v) for v in losses):
            raise RuntimeError(f"non-finite training loss: {[float(v) for v in losses]}")
        tokens_per_s = B * T / (ms / 1e3)
        peak, source = peak_flops(ctx)
        mfu = model.flops_per_token(T) * tokens_per_s / peak
        row.fast_ms = ms
        if compile:
            row.ref_ms = ctx.results.get(f"{key}_eager_ms")  # compiled against eager
        else:
            ctx.results[f"{key}_eager_ms"] = ms
        mode = {"off": "eager", "model": "compiled", "layers": "compiled per layer (eager islands)"}[mode]
        row.add_note(
            f"{tokens_per_s:,.0f} tok/s, MFU {mfu:.1%} of {peak / 1e12:.0f} TFLOP/s ({source}); "
            f"{model.num_params() / 1e6:.1f}M params, {model.flops_per_token(T) / 1e6:.0f} MFLOP/token; "
            f"{mode}, {root.optimizer.name}, loss {float(losses[0]):.3f} -> {float(losses[-1]):.3f}"
        )

    return run


# ------------------------------------------------------------------------------------------------
# 6. FSDP2 on one GPU
# ------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_fsdp2(overrides: Sequence[str], B: int, T: int, tol: float) -> Callable[[Context, Row], None]:
    def run(ctx: Context, row: Row) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        root = validate_overrides(list(overrides))
        created = not dist.is_initialized()
        if created:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            if ctx.device.type == "cuda":
                torch.cuda.set_device(ctx.device)
            dist.init_process_group("nccl" if ctx.device.type == "cuda" else "gloo", rank=0, world_size=1)
        try:
            mesh = init_device_mesh(ctx.device.type, (1,))

            def shard(model: torch.nn.Module) -> None:
                # runtime/lit_module.py::configure_model: each decoder layer, then the root
                for layer in model.layers:
                    fully_shard(layer, mesh=mesh)
                fully_shard(model, mesh=mesh)

            gen = torch.Generator().manual_seed(0)
            ids = None
            losses = {}
            for name in ("fsdp2", "plain"):
                model, step = train_setup(root, ctx.device, prepare=shard if name == "fsdp2" else None)
                if ids is None:
                    ids = torch.randint(0, model.vocab_size, (B, T + 1), generator=gen).to(ctx.device)  # [B, T+1]
                first = step(ids)  # forward/backward/step
                with torch.no_grad(), torch.autocast(ctx.device.type, dtype=torch.bfloat16):
                    logits = model(ids[:, :-1])  # [B, T, vocab], after the step
                after = cross_entropy(logits, ids[:, 1:], reduction="mean")
                losses[name] = torch.stack([first.float(), after.float()])  # [2]
                del model, step
            row.max_abs, row.rel, _ = compare({"loss": losses["fsdp2"]}, {"loss": losses["plain"]})
            row.tol = tol
            a, b = losses["fsdp2"].tolist(), losses["plain"].tolist()
            row.add_note(
                f"loss before/after one step: fsdp2 {a[0]:.5f}/{a[1]:.5f}, unsharded {b[0]:.5f}/{b[1]:.5f}; "
                f"world size 1, {dist.get_backend()}, {root.optimizer.name}, bf16 autocast"
            )
        finally:
            if created:
                dist.destroy_process_group()

    return run


# ------------------------------------------------------------------------------------------------
# the plan
# ------------------------------------------------------------------------------------------------
def k3_small_overrides(quick: bool) -> list[str]:
    """experiment=k3_small scaled to a GPU: d_model 1024 (512 quick), K3's 128-wide KDA heads, and the
    AttnRes read on ``auto`` (fla's kernel; k3_small's own choice, ``torch``, suits its CPU runs)."""
    d = 512 if quick else 1024
    heads = d // 128
    return [
        "experiment=k3_small",
        f"model.d_model={d}",
        f"mixer.n_heads={heads}",
        "mixer.head_dim=128",
        f"mixers.mla.n_heads={heads}",
        f"ffn.latent_dim={d // 2}",
        f"ffn.expert_hidden_dim={d // 4}",
        f"ffns.dense.hidden_dim={4 * d}",
        "residual.backend=auto",
    ]


def build_checks(args: argparse.Namespace) -> list[Check]:
    q = args.quick
    reps = 5 if q else 10
    checks: list[Check] = []
    B, H, K = (1, 8, 128) if q else (2, 16, 128)
    for T in (1024, 2048) if q else (2048, 8192):
        checks.append(Check("kda_fla", f"B={B} T={T} H={H} K=V={K}", check_kda_fla(B, T, H, K, 2e-2, reps), ("fla",)))
    B, T, H = (2, 1024, 8) if q else (2, 4096, 16)
    checks.append(
        Check("kda_fla_varlen", f"B={B} T={T} H={H} K=V={K}", check_kda_fla_varlen(B, T, H, K, 2e-2, reps), ("fla",))
    )
    B, T, H = (1, 1024, 8) if q else (2, 2048, 16)
    checks.append(
        Check("kda_mixer", f"B={B} T={T} d={H * K} H={H} K=V={K}", check_kda_mixer(B, T, H, K, 5e-2, reps), ("fla",))
    )
    S, B, T, d = (5, 2, 1024, 1024) if q else (9, 4, 2048, 2048)
    checks.append(Check("attnres_fla", f"S={S} B={B} T={T} d={d}", check_attnres(S, B, T, d, 1e-2, reps), ("fla",)))
    N, m = (4096, 1024) if q else (8192, 3072)
    checks.append(Check("situ_glu_triton", f"[{N}, {m}] bf16", check_situ(N, m, 1e-2, 3 * reps), ("triton",)))
    N, E, k, d, m = (4096, 32, 4, 512, 256) if q else (16384, 64, 4, 1024, 512)
    checks.append(Check("moe_experts", f"N={N} E={E} k={k} d={d} m={m}", check_moe_experts(N, E, k, d, m, 2e-2, reps)))
    size = (8192, 1024, 64, 4, 512) if q else (32768, 2048, 64, 4, 1024)
    forms = ("moe", "latent_moe", "stable_latent_moe")
    for form in forms:
        checks.append(
            Check(
                f"moe_vs_dense[{form}]",
                "N={} d={} E={} k={} m={}".format(*size),
                check_moe_vs_dense(form, size, reps, last=form == forms[-1]),
            )
        )
    B, T = (4, 256) if q else (8, 512)
    # before the measurements: a spent --budget-s then skips throughput rows, not parity checks
    checks.append(Check("fsdp2", f"default config, B={B} T={T}", check_fsdp2([], B, T, 1e-3)))
    warmup, steps = (2, 4) if q else (3, 10)
    B, T = (8, 512) if q else (32, 1024)
    checks.append(
        Check("train_default", f"default config, B={B} T={T}", check_train("train_default", [], B, T, warmup, steps))
    )
    if not (args.no_compile or q):
        checks.append(
            Check(
                "train_default_compiled",
                f"default config, B={B} T={T}",
                check_train("train_default", [], B, T, warmup, steps, compile=True),
            )
        )
    ov = k3_small_overrides(q)
    B, T = (4, 1024) if q else (8, 2048)
    d = ov[1].split("=")[1]
    checks.append(
        Check("train_k3_small", f"k3_small d={d}, B={B} T={T}", check_train("train_k3_small", ov, B, T, warmup, steps))
    )
    if not (args.no_compile or q):
        checks.append(
            Check(
                "train_k3_small_compiled",
                f"k3_small d={d}, B={B} T={T}",
                check_train("train_k3_small", ov, B, T, warmup, steps, compile=True),
            )
        )
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {c.name for c in checks} - {"train_default_compiled", "train_k3_small_compiled"}
        if unknown:
            raise SystemExit(
                f"--only: unknown check(s) {', '.join(sorted(unknown))}; "
                f"choose from {', '.join(dict.fromkeys(c.name for c in checks))}"
            )
        checks = [c for c in checks if c.name in wanted]
    return checks


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer steps")
    p.add_argument("--dry-run", action="store_true", help="list the checks and their sizes, run nothing")
    p.add_argument("--only", default=None, help="comma-separated check names")
    p.add_argument(
        "--peak-tflops", type=float, default=None, help="bf16 dense peak for MFU (default: from the device name)"
    )
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd training row")
    p.add_argument("--budget-s", type=float, default=420.0, help="start no check after this many seconds")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    checks = build_checks(args)
    cuda = torch.cuda.is_available()
    if args.dry_run or not cuda:
        rows = [Row(c.name, c.size, "skipped", note=dry_reason(c, args)) for c in checks]
        print(f"gpu_check: dry mode ({DRY_RUN if args.dry_run else NO_CUDA}); torch {torch.__version__}")
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        ctx = Context(args, device, deadline=time.perf_counter() + args.budget_s)
        print(
            f"gpu_check: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
            f"{'quick' if args.quick else 'full'} sizes, budget {args.budget_s:g} s",
            flush=True,
        )
        rows = run_checks(checks, ctx, log=lambda s: print(s, flush=True))
    print()
    print(format_table(rows))
    status = exit_status(rows)
    counts = {s: sum(r.status == s for r in rows) for s in ("pass", "FAIL", "ok", "skipped", "error")}
    print("\n" + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + f"; exit status {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())
