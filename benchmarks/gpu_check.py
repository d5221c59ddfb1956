"""One GPU check of every CUDA path: kernel parity against the PyTorch references, speed, training
throughput and MFU, and an FSDP2 step, printed as one table.

    python -m benchmarks.gpu_check               # on one GPU (H200: about 5-8 minutes)
    python -m benchmarks.gpu_check --quick       # smaller sizes and fewer steps (about 2-3 minutes)
    python -m benchmarks.gpu_check --dry-run     # list the checks and sizes, run nothing (seconds)
    python -m benchmarks.gpu_check --only kda_fla,fsdp2 --peak-tflops 989

Checks (each a row; ``--only`` takes these names, comma-separated):

1. ``kda_fla``: fla's ``chunk_kda`` (bf16 q/k/v, fp32 gate and beta, ``safe_gate=True`` for the bounded gate:
   called as ``components/mixers/kda.py::_fla_core`` calls it) against ``components.ops.kda.chunk_kda`` in
   fp32 on the same bf16-rounded inputs, forward+backward, at two sequence lengths; gate ``kda_gate`` with
   lower bound -5. ``kda_fla_varlen``: the same with document masking: fla's variable-length form (the rows
   flattened, ``cu_seqlens`` from ``Segments``, as ``_fla_core`` calls it) against ``chunk_kda(...,
   segments=...)`` (documents packed onto chunk boundaries, state reset there), random document lengths
   including very short ones. ``kda_fla_safe_gate``: fla's bounded-gate path against its general path
   (``safe_gate=False``) on the same inputs. ``kda_mixer``: the whole KDA mixer under bf16 autocast,
   ``backend=fla`` against ``torch``.
2. ``attnres_fla``: ``components.ops.attnres.attnres_read`` with ``backend=fla`` against ``backend=torch``
   on fp32 sources under bf16 autocast (the model's: its stream is fp32 under bf16-mixed), passed as a list
   as the residual schemes pass them, forward+backward.
3. ``situ_glu_triton``: ``situ_glu(backend="triton")`` against ``situ_glu_reference``, forward+backward.
4. ``moe_experts``: grouped dispatch (``grouped_mm``) of ``RoutedExperts`` against the per-expert loop
   ``experts_reference`` (parity and speed); ``moe_vs_dense[<form>]``: each MoE form against a dense
   SiTU-GLU FFN of the same active parameters (``benchmarks/moe.py``), time ratio, goal <= 1.3x.
5. ``train_default`` / ``train_default_compiled`` / ``train_k3_small`` / ``train_k3_small_compiled``:
   forward+backward+optimizer step (the config's optimizer and balancer) under bf16 autocast: tokens/s and
   MFU = ``flops_per_token(T)`` x tokens/s / bf16 peak (from the device name, ``--peak-tflops`` overrides;
   else a measured matmul). k3_small is scaled to d_model 1024 with 128-wide KDA heads and
   ``residual.backend=auto``. A compiled row is compiled as the trainer compiles (one graph, or per layer
   for models with eager islands), times against the eager row and names TorchDynamo's graphs and breaks.
6. ``fsdp2``: the model sharded as the trainer shards it (``runtime.strategies.shard_fsdp2``: ``fully_shard``
   per decoder layer then the root, the training methods registered) on a one-rank group, one
   forward/backward/step; its losses before and after the step against the unsharded model's.

Tolerances are measured, not chosen (``derived_tolerance``): on each row's inputs and at its size, the torch
reference also runs in fp64 and computing in bf16; ``tol = e_bf16 + e_ref``, the worst relative errors
against the fp64 run of the reference computing in bf16 and of the reference the row compares with. A
fast path passes when it is no less accurate than the reference computing in the training run's
precision. (``fsdp2``: twice the bf16-autocast loss's error against the fp64 model's loss.)

Columns: ``max_abs`` / ``rel`` are the largest absolute error and the worst relative RMS error
(``rms(fast - ref) / rms(ref)``) over the output and every gradient (the note names the worst tensor);
``tol`` bounds ``rel``; ``fast_ms`` / ``ref_ms`` are medians of interleaved rounds
(``benchmarks/timing.py``) and ``fast/ref`` their ratio (below 1: the fast path is faster).
Status: ``pass`` / ``FAIL`` (parity), ``ok`` (measurement only), ``skipped`` (with the reason), ``error``
(the exception; the other checks still run). The exit status is 1 when a row FAILs or errors, else 0.
Without CUDA (or with ``--dry-run``) every row is ``skipped`` with the reason, and the exit status is 0.
``--budget-s`` (default 420) skips the checks that would start after that many seconds; the FSDP2 check
runs before the training rows, so a spent budget costs measurements, not parity checks. ``--tiny`` sizes
are the CPU rehearsal's (tests/benchmarks/test_gpu_check_rehearsal.py: every row on a CPU, the kernels
under Triton's interpreter, FSDP2 on two gloo ranks).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import importlib
import importlib.util
import math
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh

from components.nn.build_context import BuildContext

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also runnable as a script

from benchmarks.moe import build_forms, routing
from benchmarks.moe import fwd_bwd as module_step
from benchmarks.timing import medians, time_interleaved
from benchmarks.train_step import train_setup
from components.ffn.experts import RoutedExperts, auto_dispatch, experts_reference, grouped_mm_supported
from components.ffn.glu_activation import glu_activation
from components.mixers import kda
from components.mixers.kda import KDAConfig, KimiDeltaAttention, fla_kda_kernels
from components.model import build_on_meta
from components.nn.segments import Segments
from components.objective import cross_entropy
from components.ops.activations import situ_glu, situ_glu_reference
from components.ops.attnres import attnres_read, attnres_read_reference
from components.ops.kda import chunk_kda, kda_gate, l2norm
from runtime.callbacks.throughput import peak_flops as known_or_measured
from runtime.compose import compose_root
from runtime.strategies import shard_fsdp2

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


# ------------------------------------------------------------------------------------------------
# tolerances: measured on each row's inputs at its size, not chosen
# ------------------------------------------------------------------------------------------------
# bf16's unit round-off over fp32's (2^-8 / 2^-24)
BF16_OVER_FP32 = 2.0**16


def derived_tolerance(
    exact: Mapping[str, torch.Tensor],
    fp32: Mapping[str, torch.Tensor],
    bf16: Mapping[str, torch.Tensor],
    ref: Mapping[str, torch.Tensor],
) -> tuple[float, str]:
    """A parity row's tolerance from the torch reference's own errors against its fp64 run (``exact``, on the
    inputs the row compares on); each error is the worst relative one over output and gradients (``compare``):

        tol = max(e_bf16, 2^16 e_fp32) + e_ref

    ``e_bf16``: the reference computing in bf16 (``bf16``), what bf16 arithmetic costs this computation,
    measured; ``2^16 e_fp32``: the same estimated from the reference's fp32 round-off (``fp32``) scaled by
    the ratio of the two unit round-offs; ``e_ref``: the reference the row compares against, as the row
    runs it (``ref``: its fp32 run, or bf16 autocast / bf16 storage). A fast path passes when its error is
    no more than what bf16 arithmetic costs, beyond the reference's own. Returns (tol, a note with the
    figures)."""
    _, e_bf16, at_bf16 = compare(bf16, exact)
    _, e_fp32, at_fp32 = compare(fp32, exact)
    _, e_ref, at_ref = compare(ref, exact)
    tol = max(e_bf16, BF16_OVER_FP32 * e_fp32) + e_ref
    return tol, (
        f"tol = max(e_bf16 {e_bf16:.1e} ({at_bf16}), 2^16 e_fp32 {e_fp32:.1e} ({at_fp32})) + e_ref {e_ref:.1e} "
        f"({at_ref}), torch reference vs fp64"
    )


def set_derived_parity(
    row: Row,
    out: Mapping[str, torch.Tensor],
    ref: Mapping[str, torch.Tensor],
    exact: Mapping[str, torch.Tensor],
    fp32: Mapping[str, torch.Tensor],
    bf16: Mapping[str, torch.Tensor],
) -> None:
    """``set_parity`` with the tolerance ``derived_tolerance`` measures."""
    tol, how = derived_tolerance(exact, fp32, bf16, ref)
    set_parity(row, out, ref, tol)
    row.add_note(how)


def as_dtype(inputs: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Fresh leaves (requiring grad) of the same values in ``dtype``."""
    return {n: t.detach().to(dtype).requires_grad_() for n, t in inputs.items()}


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


COLUMNS = (
    ("check", 32, "<"),
    ("size", 36, "<"),
    ("status", 7, "<"),
    ("max_abs", 9, ">"),
    ("rel", 9, ">"),
    ("tol", 8, ">"),
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
            fmt(r.tol, ".1e"),
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


def kda_reference(segments=None, compute_dtype: torch.dtype | None = None) -> Callable[..., torch.Tensor]:
    """``components.ops.kda.chunk_kda``'s output as a function of (q, k, v, g, beta)."""

    def ref(q, k, v, g, beta):
        return chunk_kda(q, k, v, g, beta, segments=segments, compute_dtype=compute_dtype)[0]

    return ref


def check_kda(
    B: int, T: int, H: int, K: int, repeats: int, varlen: bool = False, safe_gate_vs_general: bool = False
) -> Callable[[Context, Row], None]:
    """fla's chunk_kda on bf16 q/k/v and fp32 gate and beta (as the mixer hands them over under bf16
    autocast, with ``safe_gate`` as the mixer passes it for its bounded gate) against the torch chunked form
    in fp32 on the same values; ``varlen``: with documents, fla's variable-length form; ``safe_gate_vs_general``:
    fla's bounded-gate path against fla's general one (the same result is expected)."""

    def run(ctx: Context, row: Row) -> None:
        fla_chunk_kda = fla_kda_kernels()[0]
        x = kda_inputs(B, T, H, K, ctx.device, seed=1 if varlen else 0)
        segments = random_segments(B, T, 500, ctx.device) if varlen else None
        fast_in = {n: (t.bfloat16() if n in ("q", "k", "v") else t).requires_grad_() for n, t in x.items()}
        do = torch.randn(B, T, H, K, device=ctx.device).bfloat16()  # [B, T, H, V]

        def fla(safe_gate: bool) -> Callable[..., torch.Tensor]:
            def f(q, k, v, g, beta):  # the calls of KimiDeltaAttention._fla_core (no cache)
                if segments is None:
                    return fla_chunk_kda(q, k, v, g, beta, output_final_state=False, safe_gate=safe_gate)[0]
                flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]  # [1, B*T, ...]
                o = fla_chunk_kda(*flat, cu_seqlens=segments.cu_seqlens(), safe_gate=safe_gate)[0]
                return o.view(B, T, H, K)

            return f

        # the comparison: fla's general path, or the torch form on the same (bf16-rounded) values in fp32
        if safe_gate_vs_general:
            ref_in = {n: t.detach().clone().requires_grad_() for n, t in fast_in.items()}
            ref_fn, ref_do = fla(False), do
        else:
            ref_in, ref_fn, ref_do = as_dtype(fast_in, torch.float32), kda_reference(segments), do.float()
        steps = {"fla": fwd_bwd(fla(True), fast_in, do), "ref": fwd_bwd(ref_fn, ref_in, ref_do)}
        got = {"fla": outputs_and_grads(steps["fla"], fast_in), "ref": outputs_and_grads(steps["ref"], ref_in)}
        # the torch form in fp64 and computing in bf16, on the same values: the tolerance
        exact_in = as_dtype(fast_in, torch.float64)
        exact = outputs_and_grads(fwd_bwd(kda_reference(segments), exact_in, do.double()), exact_in)
        low_in = {n: t.detach().clone().requires_grad_() for n, t in fast_in.items()}
        low = outputs_and_grads(fwd_bwd(kda_reference(segments, torch.bfloat16), low_in, do), low_in)
        fp32_in = as_dtype(fast_in, torch.float32)
        fp32 = (
            got["ref"]
            if not safe_gate_vs_general
            else outputs_and_grads(fwd_bwd(kda_reference(segments), fp32_in, do.float()), fp32_in)
        )
        set_derived_parity(row, got["fla"], got["ref"], exact, fp32, low)
        t = ctx.time_ms(steps, repeats)
        row.fast_ms, row.ref_ms = t["fla"], t["ref"]
        if safe_gate_vs_general:
            row.add_note("fla safe_gate=True vs safe_gate=False (both bf16), fwd+bwd")
        elif segments is not None:
            n_docs = len(segments.cu_seqlens()) - 1
            row.add_note(f"{n_docs} documents; fla cu_seqlens bf16 vs torch chunk_kda with segments fp32, fwd+bwd")
        else:
            row.add_note("fla bf16 (safe_gate) vs torch chunk_kda fp32, fwd+bwd")

    return run


def random_segments(B: int, T: int, mean_len: int, device: torch.device, seed: int = 0):
    """``Segments`` of B rows with about T / mean_len documents each at random places, plus a 3-token one."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        cut = torch.randint(1, T - 4, (max(1, T // mean_len),), generator=gen)
        starts[b, cut] = 1
        starts[b, cut[0] + 3] = 1  # the document at cut[0] is 3 tokens long (if no other cut falls inside)
    return Segments(starts.cumsum(1).to(device))


@contextlib.contextmanager
def kda_core_in(dtype: torch.dtype) -> Iterator[None]:
    """The KDA mixer's torch chunked core computing in ``dtype`` (the tolerance's bf16 run)."""
    original = kda.chunk_kda
    kda.chunk_kda = functools.partial(original, compute_dtype=dtype)
    try:
        yield
    finally:
        kda.chunk_kda = original


def check_kda_mixer(B: int, T: int, H: int, K: int, repeats: int) -> Callable[[Context, Row], None]:
    def run(ctx: Context, row: Row) -> None:
        d = H * K
        torch.manual_seed(0)
        mixer = KimiDeltaAttention(
            KDAConfig(n_heads=H, head_dim=K, gate_lower_bound=-5.0, backend="torch"), BuildContext(d)
        ).to(ctx.device)
        x = {"x": torch.randn(B, T, d, device=ctx.device).requires_grad_()}  # [B, T, d]
        dy = torch.randn(B, T, d, device=ctx.device).bfloat16()  # [B, T, d]

        def forward(layer, backend: str, autocast: bool = True) -> Callable[..., torch.Tensor]:
            def f(x: torch.Tensor) -> torch.Tensor:
                layer.cfg.backend = backend
                with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=autocast):
                    return layer(x)  # [B, T, d] bf16 under autocast

            return f

        def measured(layer, backend: str, inputs, grad, autocast: bool = True) -> dict[str, torch.Tensor]:
            step = fwd_bwd(forward(layer, backend, autocast), inputs, grad, list(layer.parameters()))
            return outputs_and_grads(step, {**inputs, **dict(layer.named_parameters())})

        steps = {b: fwd_bwd(forward(mixer, b), x, dy, list(mixer.parameters())) for b in ("fla", "torch")}
        got = {b: measured(mixer, b, x, dy) for b in ("fla", "torch")}
        # the tolerance: the torch mixer in fp64, and under autocast with its chunked core computing in bf16
        exact = measured(copy.deepcopy(mixer).double(), "torch", as_dtype(x, torch.float64), dy.double(), False)
        fp32 = measured(mixer, "torch", x, dy.float(), autocast=False)
        with kda_core_in(torch.bfloat16):
            low = measured(mixer, "torch", x, dy)
        set_derived_parity(row, got["fla"], got["torch"], exact, fp32, low)
        t = ctx.time_ms(steps, repeats)
        row.fast_ms, row.ref_ms = t["fla"], t["torch"]
        row.add_note("KimiDeltaAttention backend fla vs torch, bf16 autocast, output + all grads")

    return run


# ------------------------------------------------------------------------------------------------
# 2. AttnRes: fla's fused read against the torch read
# ------------------------------------------------------------------------------------------------
def check_attnres(S: int, B: int, T: int, d: int, repeats: int) -> Callable[[Context, Row], None]:
    def run(ctx: Context, row: Row) -> None:
        gen = torch.Generator(device=ctx.device).manual_seed(0)
        # fp32 sources, as the model's under bf16-mixed: the embedding is fp32 and every write casts a
        # sublayer's bf16 output to the stream's dtype (components/residual/attnres.py)
        u = torch.randn(S, B, T, d, device=ctx.device, generator=gen)  # [S, B, T, d] sources
        inputs = {f"u{i}": u[i].clone().requires_grad_() for i in range(S)}  # S x [B, T, d], oldest first
        inputs["query"] = (0.3 * torch.randn(d, device=ctx.device, generator=gen)).requires_grad_()  # [d]
        inputs["gain"] = (1.0 + 0.2 * torch.randn(d, device=ctx.device, generator=gen)).requires_grad_()  # [d]
        dy = torch.randn(B, T, d, device=ctx.device, generator=gen)  # [B, T, d], fp32 as the stream

        def read(backend: str, compute_dtype: torch.dtype | None = None) -> Callable[..., torch.Tensor]:
            def f(query: torch.Tensor, gain: torch.Tensor, **sources: torch.Tensor) -> torch.Tensor:
                # a list of sources, as the residual schemes' _read_and_norm passes them, under the run's autocast
                with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
                    if compute_dtype is not None:  # the tolerance's bf16 run
                        return attnres_read_reference(list(sources.values()), query, gain, 1e-5, compute_dtype)
                    return attnres_read(list(sources.values()), query, gain, eps=1e-5, backend=backend)  # [B, T, d]

            return f

        steps = {b: fwd_bwd(read(b), inputs, dy) for b in ("fla", "torch")}
        got = {b: outputs_and_grads(step, inputs) for b, step in steps.items()}
        exact_in = as_dtype(inputs, torch.float64)
        exact = outputs_and_grads(fwd_bwd(read("torch"), exact_in, dy.double()), exact_in)
        low_in = as_dtype(inputs, torch.float32)
        low = outputs_and_grads(fwd_bwd(read("torch", torch.bfloat16), low_in, dy), low_in)
        set_derived_parity(row, got["fla"], got["torch"], exact, got["torch"], low)
        t = ctx.time_ms(steps, repeats)
        row.fast_ms, row.ref_ms = t["fla"], t["torch"]
        row.add_note("attnres_read backend fla vs torch, fp32 sources under bf16 autocast, fwd+bwd")

    return run


# ------------------------------------------------------------------------------------------------
# 3. SiTU-GLU: the Triton kernel against the torch reference
# ------------------------------------------------------------------------------------------------
def check_situ(rows_: int, cols: int, repeats: int) -> Callable[[Context, Row], None]:
    def run(ctx: Context, row: Row) -> None:
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
        exact_in = as_dtype(inputs, torch.float64)
        exact = outputs_and_grads(fwd_bwd(situ_glu_reference, exact_in, dz.double()), exact_in)
        low_in = as_dtype(inputs, torch.bfloat16)
        in_bf16 = functools.partial(situ_glu_reference, compute_dtype=torch.bfloat16)
        low = outputs_and_grads(fwd_bwd(in_bf16, low_in, dz), low_in)
        fp32_in = as_dtype(inputs, torch.float32)
        fp32 = outputs_and_grads(fwd_bwd(situ_glu_reference, fp32_in, dz.float()), fp32_in)
        set_derived_parity(row, got["triton"], got["torch"], exact, fp32, low)
        t = ctx.time_ms(steps, repeats, warmup=2)
        row.fast_ms, row.ref_ms = t["triton"], t["torch"]
        row.add_note("situ_glu(backend=triton) vs situ_glu_reference, bf16, fwd+bwd")

    return run


# ------------------------------------------------------------------------------------------------
# 4. MoE: grouped dispatch against the loop, MoE forms against dense FFNs
# ------------------------------------------------------------------------------------------------
def check_moe_experts(N: int, E: int, k: int, d: int, m: int, repeats: int) -> Callable[[Context, Row], None]:
    def run(ctx: Context, row: Row) -> None:
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

        def loop(x, w1, w2, w3, combine=w):
            return experts_reference(x, idx, combine, w1, w2, w3, act)

        steps = {
            "grouped": fwd_bwd(lambda x: ex(x, idx, w), inputs, gy, list(params.values())),
            "loop": fwd_bwd(lambda x: loop(x, ex.w1, ex.w2, ex.w3), inputs, gy, list(params.values())),
        }
        got = {n: outputs_and_grads(s, {**inputs, **params}) for n, s in steps.items()}
        # the tolerance: the loop in fp64 and fp32; the loop as the row runs it computes in bf16 already
        wide = {}
        for dtype in (torch.float64, torch.float32):
            wide_in = as_dtype({**inputs, **params}, dtype)
            step = fwd_bwd(lambda x, w1, w2, w3: loop(x, w1, w2, w3, w.to(dtype)), wide_in, gy.to(dtype))
            wide[dtype] = outputs_and_grads(step, wide_in)
        set_derived_parity(row, got["grouped"], got["loop"], wide[torch.float64], wide[torch.float32], got["loop"])
        t = ctx.time_ms(steps, repeats)
        row.fast_ms, row.ref_ms = t["grouped"], t["loop"]
        row.add_note("RoutedExperts dispatch=grouped_mm vs experts_reference loop, bf16, fwd+bwd")

    return run


def check_moe_vs_dense(
    form: str, size: tuple[int, int, int, int, int], repeats: int, last: bool
) -> Callable[[Context, Row], None]:
    def run(ctx: Context, row: Row) -> None:
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
            ctx.peak = known_or_measured(ctx.device, "bf16-mixed")
    return ctx.peak


def dynamo_counts() -> tuple[int, int, int]:
    """(graphs, graph breaks, of those at eager islands) TorchDynamo has compiled since its last reset."""
    breaks = counters["graph_break"]
    islands = sum(n for reason, n in breaks.items() if "torch.compiler.disable()" in reason)
    return counters["stats"]["unique_graphs"], sum(breaks.values()), islands


def check_train(
    key: str, overrides: Sequence[str], B: int, T: int, warmup: int, steps: int, compile: bool = False
) -> Callable[[Context, Row], None]:
    def run(ctx: Context, row: Row) -> None:
        root = compose_root(list(overrides))
        unfriendly = build_on_meta(root.decoder_config()).compile_unfriendly()
        mode = ("layers" if unfriendly else "model") if compile else "off"  # as the trainer compiles it
        if compile:  # count this model's graphs only
            torch._dynamo.reset()
            counters.clear()
        model, step = train_setup(root, ctx.device, mode, compile_backend=ctx.args.compile_backend)
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
        how = {"off": "eager", "model": "compiled", "layers": "compiled per layer (eager islands)"}[mode]
        if compile:
            graphs, breaks, islands = dynamo_counts()
            how += f" ({ctx.args.compile_backend}): {graphs} graphs, {breaks} breaks ({islands} at eager islands)"
        row.add_note(
            f"{tokens_per_s:,.0f} tok/s, MFU {mfu:.1%} of {peak / 1e12:.0f} TFLOP/s ({source}); "
            f"{model.num_params() / 1e6:.1f}M params, {model.flops_per_token(T) / 1e6:.0f} MFLOP/token; "
            f"{how}, {root.optimizer.name}, loss {float(losses[0]):.3f} -> {float(losses[-1]):.3f}"
        )

    return run


# ------------------------------------------------------------------------------------------------
# 6. FSDP2 on one GPU
# ------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_fsdp2(overrides: Sequence[str], B: int, T: int) -> Callable[[Context, Row], None]:
    """One training step of the model sharded by ``runtime.strategies.shard_fsdp2`` (as the trainer shards
    it) against the unsharded model's: losses before and after the step. On one process a one-rank group
    (NCCL on a GPU, gloo on a CPU); in a process group started already (the CPU rehearsal's two gloo ranks,
    each with the same batch), over all of its ranks."""

    def run(ctx: Context, row: Row) -> None:
        root = compose_root(list(overrides))
        created = not dist.is_initialized()
        if created:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            if ctx.device.type == "cuda":
                torch.cuda.set_device(ctx.device)
            dist.init_process_group("nccl" if ctx.device.type == "cuda" else "gloo", rank=0, world_size=1)
        try:
            mesh = init_device_mesh(ctx.device.type, (dist.get_world_size(),))
            gen = torch.Generator().manual_seed(0)
            ids = None
            losses: dict[str, torch.Tensor] = {}
            for name in ("fsdp2", "plain"):
                model, step = train_setup(
                    root, ctx.device, prepare=(lambda m: shard_fsdp2(m, mesh)) if name == "fsdp2" else None
                )
                if ids is None:
                    ids = torch.randint(0, model.vocab_size, (B, T + 1), generator=gen).to(ctx.device)  # [B, T+1]
                if name == "plain":  # the tolerance: the first loss in fp64 and fp32, without autocast
                    with torch.no_grad():
                        wide = {  # the loss in the model's own dtype (cross_entropy would compute it in fp32)
                            dtype: torch.nn.functional.cross_entropy(
                                copy.deepcopy(model).to(dtype)(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()
                            )
                            for dtype in (torch.float64, torch.float32)
                        }
                first = step(ids)  # forward/backward/step
                with torch.no_grad(), torch.autocast(ctx.device.type, dtype=torch.bfloat16):
                    logits = model(ids[:, :-1])  # [B, T, vocab], after the step
                after = cross_entropy(logits, ids[:, 1:], reduction="mean")
                losses[name] = torch.stack([first.float(), after.float()])  # [2]
                del model, step
            row.max_abs, row.rel, _ = compare({"loss": losses["fsdp2"]}, {"loss": losses["plain"]})
            # the reference (the unsharded bf16-autocast step) computes in bf16 itself: its first loss is
            # both e_bf16 and e_ref
            first = {"loss": losses["plain"][:1]}
            exact, fp32 = ({"loss": wide[dtype].reshape(1)} for dtype in (torch.float64, torch.float32))
            row.tol, how = derived_tolerance(exact, fp32, first, first)
            a, b = losses["fsdp2"].tolist(), losses["plain"].tolist()
            row.add_note(
                f"loss before/after one step: fsdp2 {a[0]:.5f}/{a[1]:.5f}, unsharded {b[0]:.5f}/{b[1]:.5f}; "
                f"world size {dist.get_world_size()}, {dist.get_backend()}, {root.optimizer.name}, bf16 autocast; "
                f"{how} (first loss)"
            )
        finally:
            if created:
                dist.destroy_process_group()

    return run


# ------------------------------------------------------------------------------------------------
# the plan
# ------------------------------------------------------------------------------------------------
# sizes of every check by preset: full (one GPU), quick (--quick), tiny (--tiny: the CPU rehearsal,
# tests/benchmarks/test_gpu_check_rehearsal.py, with the kernels under Triton's interpreter)
SIZES: dict[str, dict[str, Any]] = {
    "full": {
        "repeats": 10,
        "kda": ((2, 16, 128), (2048, 8192)),  # (B, H, K), sequence lengths
        "kda_varlen": (2, 4096, 16, 128),  # B, T, H, K
        "kda_safe_gate": (2, 8192, 16, 128),
        "kda_mixer": (2, 2048, 16, 128),
        "attnres": (9, 4, 2048, 2048),  # S, B, T, d
        "situ": (8192, 3072),  # tokens, width
        "moe_experts": (16384, 64, 4, 1024, 512),  # N, E, k, d, m
        "moe_forms": (32768, 2048, 64, 4, 1024),
        "fsdp2": (8, 512),  # B, T
        "train": (8, 32, 1024, 3, 10),  # k3_small B, default B, T (k3_small: 2T), warmup, steps
        "k3_small": {"d": 1024, "head_dim": 128, "n_layers": None},
    },
    "quick": {
        "repeats": 5,
        "kda": ((1, 8, 128), (1024, 2048)),
        "kda_varlen": (2, 1024, 8, 128),
        "kda_safe_gate": (1, 2048, 8, 128),
        "kda_mixer": (1, 1024, 8, 128),
        "attnres": (5, 2, 1024, 1024),
        "situ": (4096, 1024),
        "moe_experts": (4096, 32, 4, 512, 256),
        "moe_forms": (8192, 1024, 64, 4, 512),
        "fsdp2": (4, 256),
        "train": (4, 8, 512, 2, 4),
        "k3_small": {"d": 512, "head_dim": 128, "n_layers": None},
    },
    "tiny": {
        "repeats": 1,
        "kda": ((1, 2, 32), (64, 160)),  # one chunk; several with a ragged last one
        "kda_varlen": (2, 128, 2, 32),
        "kda_safe_gate": (1, 160, 2, 32),
        "kda_mixer": (1, 64, 2, 32),
        "attnres": (3, 1, 8, 64),
        "situ": (64, 96),
        "moe_experts": (64, 4, 2, 32, 16),
        "moe_forms": (64, 32, 4, 2, 16),
        "fsdp2": (2, 16),
        "train": (2, 2, 16, 1, 2),
        "k3_small": {"d": 64, "head_dim": 32, "n_layers": 2},
    },
}


def k3_small_overrides(preset: str) -> list[str]:
    """experiment=k3_small scaled to a GPU: d_model 1024 (512 quick), K3's 128-wide KDA heads, and the
    AttnRes read on ``auto`` (fla's kernel; k3_small's own choice, ``torch``, suits its CPU runs)."""
    size = SIZES[preset]["k3_small"]
    d = size["d"]
    heads = d // size["head_dim"]
    overrides = [
        "experiment=k3_small",
        f"model.d_model={d}",
        f"mixer.n_heads={heads}",
        f"mixer.head_dim={size['head_dim']}",
        f"mixers.mla.n_heads={heads}",
        f"ffn.latent_dim={d // 2}",
        f"ffn.expert_hidden_dim={d // 4}",
        f"ffns.dense.hidden_dim={4 * d}",
        "residual.backend=auto",
    ]
    if size["n_layers"] is not None:
        overrides.append(f"model.n_layers={size['n_layers']}")
    return overrides


def preset(args: argparse.Namespace) -> str:
    return "tiny" if args.tiny else "quick" if args.quick else "full"


def build_checks(args: argparse.Namespace) -> list[Check]:
    size = SIZES[preset(args)]
    reps = size["repeats"]
    compiled = not (args.no_compile or args.quick)
    checks: list[Check] = []
    (B, H, K), lengths = size["kda"]
    for T in lengths:
        checks.append(Check("kda_fla", f"B={B} T={T} H={H} K=V={K}", check_kda(B, T, H, K, reps), ("fla",)))
    B, T, H, K = size["kda_varlen"]
    checks.append(
        Check("kda_fla_varlen", f"B={B} T={T} H={H} K=V={K}", check_kda(B, T, H, K, reps, varlen=True), ("fla",))
    )
    B, T, H, K = size["kda_safe_gate"]
    checks.append(
        Check(
            "kda_fla_safe_gate",
            f"B={B} T={T} H={H} K=V={K}",
            check_kda(B, T, H, K, reps, safe_gate_vs_general=True),
            ("fla",),
        )
    )
    B, T, H, K = size["kda_mixer"]
    checks.append(
        Check("kda_mixer", f"B={B} T={T} d={H * K} H={H} K=V={K}", check_kda_mixer(B, T, H, K, reps), ("fla",))
    )
    S, B, T, d = size["attnres"]
    checks.append(Check("attnres_fla", f"S={S} B={B} T={T} d={d} fp32", check_attnres(S, B, T, d, reps), ("fla",)))
    N, m = size["situ"]
    checks.append(Check("situ_glu_triton", f"[{N}, {m}] bf16", check_situ(N, m, 3 * reps), ("triton",)))
    N, E, k, d, m = size["moe_experts"]
    checks.append(Check("moe_experts", f"N={N} E={E} k={k} d={d} m={m}", check_moe_experts(N, E, k, d, m, reps)))
    forms = ("moe", "latent_moe", "stable_latent_moe")
    for form in forms:
        checks.append(
            Check(
                f"moe_vs_dense[{form}]",
                "N={} d={} E={} k={} m={}".format(*size["moe_forms"]),
                check_moe_vs_dense(form, size["moe_forms"], reps, last=form == forms[-1]),
            )
        )
    B, T = size["fsdp2"]
    # before the measurements: a spent --budget-s then skips throughput rows, not parity checks
    checks.append(Check("fsdp2", f"default config, B={B} T={T}", check_fsdp2([], B, T)))
    B_k3, B, T, warmup, steps = size["train"]
    checks.append(
        Check("train_default", f"default config, B={B} T={T}", check_train("train_default", [], B, T, warmup, steps))
    )
    if compiled:
        checks.append(
            Check(
                "train_default_compiled",
                f"default config, B={B} T={T}",
                check_train("train_default", [], B, T, warmup, steps, compile=True),
            )
        )
    ov = k3_small_overrides(preset(args))
    B, T = B_k3, 2 * T
    d = ov[1].split("=")[1]
    checks.append(
        Check("train_k3_small", f"k3_small d={d}, B={B} T={T}", check_train("train_k3_small", ov, B, T, warmup, steps))
    )
    if compiled:
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
    p.add_argument(
        "--tiny", action="store_true", help="CPU-rehearsal sizes (tests/benchmarks/test_gpu_check_rehearsal.py)"
    )
    p.add_argument("--dry-run", action="store_true", help="list the checks and their sizes, run nothing")
    p.add_argument("--only", default=None, help="comma-separated check names")
    p.add_argument(
        "--peak-tflops", type=float, default=None, help="bf16 dense peak for MFU (default: from the device name)"
    )
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd training rows")
    p.add_argument(
        "--compile-backend", default="inductor", help="torch.compile back-end of the compiled rows (default inductor)"
    )
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
            f"{preset(args)} sizes, budget {args.budget_s:g} s",
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
