"""``experiment=k3_small`` training speed on the CPU: the eager reference against the fast path, side by side.

    python -m benchmarks.k3_speed [--batch 32 --seq 256 --rounds 4 --curve-steps 50 --curve-batch 8]

Five ways to run one training step (forward, fp32 loss with the MTP depth's, backward, Muon with
per-head updates, the QB bias update), each from the same initial weights, timed in interleaved rounds
(one step of each per round, order rotated) so background load hits all alike, each timed step right after
an untimed one of its own (the steady state of a run that trains one model: after another model's step the
heap is rearranged and the next step faults in fresh pages, which tripled the default model's step):

* ``eager fp32``: no autocast, no compile;
* ``eager bf16``: bf16 autocast, no compile, experts dispatched as one padded product per expert
  (``ffn.dispatch=padded_bmm``, what ``auto`` chose on the CPU in bf16 before the blocked dispatch) --
  the eager path ``trainer.compile=auto`` ran for K3 before it compiled models with eager islands (the
  reference);
* ``eager auto``: the same with the expert dispatch ``auto`` chooses now (``blocked`` on the CPU in
  bf16): how much of the gain is the dispatch alone;
* ``fast baseline``: the fast path as it stood before this round's kernel work, kept as the fixed row the
  fast path's speed-up is measured against: MLA's attention through SDPA
  (``mixers.mla.attention_kernel=sdpa``), KDA's short convolutions compiled with their taps read straight
  from the ``[P, 1, W]`` kernels (``strided_taps_conv`` below: scalar loops once compiled), KDA's chunked
  core as the batched PyTorch form (``chunk_kda(kernel="batched")``, not the native CPU kernel), SiTU-GLU
  as ``situ_glu_reference`` (not its exp form), and the residual scheme's final read left eager;
* ``fast``: bf16 autocast, ``auto`` dispatch, each decoder layer compiled around its remaining eager
  islands (runtime/compile.py; the blocked expert products are traced into the layer's graph), attention
  as ``attention_kernel=auto`` picks it (bf16 products with an fp32 softmax on the CPU), the short
  convolutions vectorised over channels, KDA's chunked core on the native CPU kernel
  (``components/ops/kda_cpu.py``), SiTU-GLU in its exp form (``situ_glu_exp_form``) and the final residual
  read compiled -- what the trainer runs now.

The eager rows keep SDPA attention, the batched KDA core and the reference SiTU-GLU too: the reference stays
what it was, and the loss curves below compare the fast path's kernels against it.

Beside them, in the same interleaved rounds, two plain decoders compiled as the trainer compiles them:
``default fast``, the default model (the README's run: GQA, dense SiTU-GLU, BPE 8,192, batch 16 x 256,
d_model 128 x 3 layers, sized for its five-minute budget), and ``plain fast``, the same composition at
k3_small's width (d_model 256 x 6 layers, the previous default): the plain decoder a K3-shaped model of
that width should be as efficient as (tiny models use the matrix units worse). Every path is reported in
tokens/s, model FLOPs per second (the analytic training FLOPs per token of ``components/flop_count.py``,
MTP included, times tokens/s) and MFU against this machine's bf16 matrix-product peak, measured in the
same run (the best of square products of 1,024 to 2,048, before and after the rounds); the last lines are
k3_small's fast-path FLOP rate as a fraction of each plain decoder's. ``--components`` adds where an eager
step of k3_small spends its time (``benchmarks/component_times.py``).

``--ablations`` adds what each K3 decision costs on the fast path, where compiled graphs fuse the components
and an eager table cannot say it: every ``experiment=k3_small_<name>`` ablation (each swaps one decision:
plain residual for block AttnRes, no MTP layer, SwiGLU for SiTU-GLU, MLA for KDA, ...) trained on the fast
path in the same interleaved rounds, reported as its step time against k3_small's (``--ablations
swiglu,no_mtp`` runs a subset).

Then the loss curves: ``--curve-steps`` steps of the eager reference, of the fast path and of eager fp32
from the same weights on the same corpus batches; the fast path's differences from the reference are
printed beside the reference's own differences from fp32, the size of bf16 noise on this run.

On a CPU without native bf16 products (no AMX or AVX-512 BF16: bf16 products are emulated there, many times
slower than fp32) the bf16 rows run in fp32, as ``trainer.precision=auto`` trains there, and the peak is
fp32's (``--precision bf16`` forces bf16 anyway, ``--precision fp32`` fp32 anywhere); the table's
"runs in" column names the precision each row computed in.
"""

from __future__ import annotations

import argparse
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch._dynamo

import components.mixers.kda as kda_mixer
import components.ops.activations as activations
import components.ops.attnres as attnres_ops
import components.ops.kda as kda_ops
from benchmarks.component_times import component_times, print_table
from benchmarks.timing import medians, time_interleaved
from benchmarks.train_step import train_setup
from components.model import build_on_meta
from components.ops.bf16_support import cpu_has_native_bf16
from components.registry import DATASETS
from runtime.compile import compile_mode
from runtime.compose import compose_root, conf_dir
from runtime.cpu_allocator import keep_freed_memory

# MLA's attention through SDPA, as every path ran it before attention_kernel existed
SDPA = ["mixers.mla.attention_kernel=sdpa"]
# name: (compile mode, precision, extra overrides); BASELINE also runs its kernels as they were (as_before)
PATHS = {
    "eager fp32": ("off", "fp32", SDPA),  # auto: grouped_mm in fp32, as before
    "eager bf16": ("off", "bf16", ["ffn.dispatch=padded_bmm", *SDPA]),
    "eager auto": ("off", "bf16", SDPA),
    "fast baseline": ("layers", "bf16", SDPA),
    "fast": ("layers", "bf16", []),
}
REFERENCE = "eager bf16"
BASELINE = "fast baseline"
# plain decoders, as the trainer runs them: the default model, and the same composition at k3_small's width
PLAIN = {"default fast": [], "plain fast": ["model=d256"]}


ABLATION_PREFIX = "k3_small_"


def ablations() -> dict[str, str]:
    """The one-decision ablations of k3_small in ``conf/experiment`` (``k3_small_<name>.yaml``): name -> what it
    swaps (the file's opening comment up to its first parenthesis, colon or full stop)."""
    found = {}
    for path in sorted(Path(conf_dir(), "experiment").glob(f"{ABLATION_PREFIX}*.yaml")):
        comment = []
        for line in path.read_text().splitlines():
            if not line.startswith("#"):
                break
            if "@package" not in line:
                comment.append(line.lstrip("# "))
        text = re.split(r" \(|: |\. |\.$", " ".join(comment), maxsplit=1)[0]
        found[path.stem[len(ABLATION_PREFIX) :]] = text.removeprefix("k3_small ")
    return found


def strided_taps_conv(x: torch.Tensor, weight: torch.Tensor, xp: Optional[torch.Tensor], segments=None) -> torch.Tensor:
    """KDA's compiled short convolution as the fast baseline ran it: the taps read straight from the
    ``[P, 1, W]`` kernel (stride W between channels) and every shift sliced from the concatenated prefix.
    Same values as ``components.mixers.kda.shifted_depthwise_conv``, whose signature it takes."""
    B, T, P = x.shape
    W = weight.shape[-1]
    if xp is None:
        xp = torch.cat([x.new_zeros(B, W - 1, P), x], dim=1)  # [B, W-1+T, P]
    w = weight.to(x.dtype)[:, 0, :]  # [P, W]
    y = None
    for j in range(W):
        shifted = xp[:, j : j + T]  # [B, T, P]
        if segments is not None and j < W - 1:
            shifted = shifted * segments.same_segment_as_shifted(W - 1 - j)
        y = shifted * w[:, j] if y is None else y + shifted * w[:, j]
    return y


@contextmanager
def reference_kernels() -> Iterator[None]:
    """Run the kernels the eager rows and the fast baseline ran when they were fixed: KDA's chunked core as the
    batched PyTorch form (``chunk_kda(kernel="batched")``) instead of the native CPU kernel, KDA's q/k/v
    convolutions as PyTorch ops (``causal_depthwise_conv``, ``l2norm``) instead of the native short-convolution
    op, AttnRes reads as PyTorch ops instead of the native read, and SiTU-GLU as ``situ_glu_reference`` (tanh and
    sigmoid, autograd's backward) instead of its exp form. The switches are read at call (or trace) time, so they
    hold inside compiled layers traced in this context."""
    switches = [
        (kda_ops, "native_available"),
        (kda_mixer, "short_conv_native_available"),
        (attnres_ops, "native_available"),
    ]
    saved = [getattr(owner, name) for owner, name in switches]
    exp_form = activations.situ_glu_exp_form
    for owner, name in switches:
        setattr(owner, name, _not_available)
    activations.situ_glu_exp_form = activations.situ_glu_reference  # same signature
    try:
        yield
    finally:
        for (owner, name), value in zip(switches, saved):
            setattr(owner, name, value)
        activations.situ_glu_exp_form = exp_form


def _not_available() -> bool:
    return False


@contextmanager
def as_before() -> Iterator[None]:
    """Run (and compile) with the fast baseline's kernels: TorchDynamo guards on the function a compiled
    layer called, so graphs traced inside this context are used only inside it."""
    current = kda_mixer.shifted_depthwise_conv
    kda_mixer.shifted_depthwise_conv = strided_taps_conv
    try:
        with reference_kernels():
            yield
    finally:
        kda_mixer.shifted_depthwise_conv = current


def corpus_batches(root, n: int, batch: int, seq: int) -> list[torch.Tensor]:
    """``n`` training batches ``[batch, seq + 1]`` of the configured dataset (the embedded corpus)."""
    root.data.batch_size, root.data.seq_len = batch, seq
    dataset = DATASETS.build(root.data, root.seed)
    out = []
    for i in range(n):
        x, y = dataset.train_batch(i)  # [batch, seq] each
        out.append(torch.cat([x, y[:, -1:]], dim=1))  # [batch, seq + 1]
    return out


def _run_as_before(step, ids: torch.Tensor) -> torch.Tensor:
    with as_before():
        return step(ids)


def _run_reference(step, ids: torch.Tensor) -> torch.Tensor:
    with reference_kernels():
        return step(ids)


def _runner(name: str):
    """How path ``name`` runs a step: the fast path as the trainer does, the baseline with its old kernels,
    the eager rows with the reference kernels (``reference_kernels``)."""
    if name == BASELINE:
        return _run_as_before
    return (lambda step, ids: step(ids)) if name == "fast" else _run_reference


def matmul_peak(seconds: float = 1.0, dtype: torch.dtype = torch.bfloat16) -> float:
    """This machine's matrix-product rate in ``dtype`` in FLOP/s: the best of square products of 1,024 to 2,048."""
    best = 0.0
    for n in (1024, 1536, 2048):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        for _ in range(2):
            a @ b
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 3:
            a @ b
            calls += 1
        best = max(best, 2 * n**3 * calls / (time.perf_counter() - t0))
    return best


def low_precision(choice: str) -> str:
    """What ``--precision`` makes of the bf16 rows: ``auto`` keeps them bf16 where this CPU multiplies bf16
    natively and runs them in fp32 elsewhere (as ``trainer.precision=auto`` trains)."""
    if choice == "auto":
        return "bf16" if cpu_has_native_bf16() else "fp32"
    return choice


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32, help="sequences per step (k3_small's default 32)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4, help="timed steps of each path")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each path first (compilation)")
    ap.add_argument("--curve-steps", type=int, default=50, help="steps of the loss-curve comparison (0: skip)")
    ap.add_argument("--curve-batch", type=int, default=8)
    ap.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset of: " + ", ".join(PATHS))
    ap.add_argument("--no-default", action="store_true", help="leave out the plain decoders' rows")
    ap.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="the bf16 rows' precision (auto: bf16 where this CPU multiplies bf16 natively, else fp32)",
    )
    ap.add_argument("--components", action="store_true", help="also the per-component table of an eager step")
    ap.add_argument(
        "--ablations",
        nargs="?",
        const="all",
        default="",
        help="also the fast path of each k3_small_<name> ablation (all, or comma-separated names)",
    )
    ap.add_argument("overrides", nargs="*", help="config overrides after experiment=k3_small")
    args = ap.parse_args(argv)
    overrides = ["experiment=k3_small", *args.overrides]
    names = [n for n in args.paths.split(",") if n]
    unknown = set(names) - set(PATHS)
    if unknown:
        ap.error(f"--paths: unknown {sorted(unknown)}; choose from {', '.join(PATHS)}")
    known = ablations()
    swapped = list(known) if args.ablations == "all" else [n for n in args.ablations.split(",") if n]
    if set(swapped) - set(known):
        ap.error(f"--ablations: unknown {sorted(set(swapped) - set(known))}; choose from all, {', '.join(known)}")
    if swapped and "fast" not in names:
        ap.error("--ablations compares against the fast path: keep 'fast' in --paths")

    low = low_precision(args.precision)

    def precision_of(path_precision: str) -> str:
        return low if path_precision == "bf16" else path_precision

    keep_freed_memory()  # as the trainer does on the CPU, for every path alike
    # every model compiled here adds its layers' graphs to the same decoder-layer code: room for all of them
    # (TorchDynamo's default limit falls back to eager once about five k3_small-sized models are compiled)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 512)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 4096)
    print(
        f"k3_small training step on the CPU ({torch.get_num_threads()} threads), batch {args.batch} x {args.seq} "
        "tokens; "
        f"{args.warmup} warmup + {args.rounds} timed steps each, interleaved"
    )
    if low != "bf16":
        print(
            "the bf16 rows run in fp32"
            + (" (this CPU has no native bf16 matrix products)" if args.precision == "auto" else "")
        )
    peak_dtype = torch.bfloat16 if low == "bf16" else torch.float32
    peak_before = matmul_peak(dtype=peak_dtype)
    ids = corpus_batches(compose_root(list(overrides)), 1, args.batch, args.seq)[0]
    # runs_in: the precision each row computed in (a bf16 row runs in fp32 where bf16 is emulated)
    steps, tokens, flops, runs_in = {}, {}, {}, {}
    for name in names:
        compile, precision, extra = PATHS[name]
        runs_in[name] = precision_of(precision)
        model, step = train_setup(
            compose_root([*overrides, *extra]),
            torch.device("cpu"),
            compile,
            precision=precision_of(precision),
            compile_finish=name != BASELINE,
        )
        steps[name] = lambda s=step, run=_runner(name): run(s, ids)
        tokens[name] = args.batch * args.seq
        flops[name] = model.flops_per_token(args.seq)
    if not args.no_default:
        for name, size in PLAIN.items():
            root = compose_root([*size, *args.overrides])
            plain_ids = corpus_batches(root, 1, root.data.batch_size, root.data.seq_len)[0]
            # what the trainer runs: one graph for a plain decoder
            mode = compile_mode(root.trainer, build_on_meta(root.decoder_config()))
            model, step = train_setup(root, torch.device("cpu"), mode, precision=low)
            steps[name] = lambda s=step, ids=plain_ids: s(ids)
            runs_in[name] = low
            tokens[name] = root.data.batch_size * root.data.seq_len
            flops[name] = model.flops_per_token(root.data.seq_len)
    for name in swapped:
        compile, precision, extra = PATHS["fast"]
        root = compose_root([f"experiment={ABLATION_PREFIX}{name}", *args.overrides, *extra])
        model, step = train_setup(root, torch.device("cpu"), compile, precision=precision_of(precision))
        steps[ABLATION_PREFIX + name] = lambda s=step: s(ids)
        tokens[ABLATION_PREFIX + name] = args.batch * args.seq
        flops[ABLATION_PREFIX + name] = model.flops_per_token(args.seq)
    t0 = time.perf_counter()
    sec = medians(time_interleaved(steps, args.rounds, warmup=args.warmup, settle=1))
    peak = max(peak_before, matmul_peak(dtype=peak_dtype))
    ref = sec.get(REFERENCE)
    print(f"{str(peak_dtype).removeprefix('torch.')} matrix-product peak of this machine: {peak / 1e9:,.0f} GFLOP/s")
    print(
        f"{'path':14s} {'runs in':>7s} {'s/step':>8s} {'tokens/s':>9s} {'GFLOP/tok':>10s} {'GFLOP/s':>8s} {'MFU':>6s} "
        f"{'vs ' + REFERENCE:>14s}"
    )
    for name in (n for n in steps if not n.startswith(ABLATION_PREFIX)):
        rate = tokens[name] / sec[name]
        ratio = f"{ref / sec[name]:.2f}x" if ref and name in PATHS else "-"
        print(
            f"{name:14s} {runs_in[name]:>7s} {sec[name]:8.3f} {rate:9,.0f} {flops[name] / 1e9:10.4f} "
            f"{rate * flops[name] / 1e9:8.1f} {rate * flops[name] / peak:6.1%} {ratio:>14s}"
        )
    if "fast" in steps and BASELINE in steps:
        print(f"k3_small fast path: {sec[BASELINE] / sec['fast']:.2f}x the speed of the {BASELINE}")
    for name in PLAIN:
        if "fast" in steps and name in steps:
            share = (tokens["fast"] / sec["fast"] * flops["fast"]) / (tokens[name] / sec[name] * flops[name])
            print(f"k3_small fast path: {share:.0%} of the FLOP rate of {name}")
    if swapped:
        print("\nwhat each K3 decision costs on the fast path: k3_small's fast step against each ablation's")
        print(f"{'ablation':26s} {'s/step':>8s} {'tokens/s':>9s} {'GFLOP/tok':>10s} {'k3_small vs it':>15s}  swaps")
        for name in swapped:
            key = ABLATION_PREFIX + name
            extra_time = sec["fast"] / sec[key] - 1  # > 0: the K3 decision costs this much step time
            print(
                f"{key:26s} {sec[key]:8.3f} {tokens[key] / sec[key]:9,.0f} {flops[key] / 1e9:10.4f} "
                f"{extra_time:+15.1%}  {known[name]}"
            )
    print(f"(measured in {time.perf_counter() - t0:.0f} s, compilation included)")

    if args.components:
        compile, precision, extra = PATHS["eager auto"]
        model, step = train_setup(
            compose_root([*overrides, *extra]), torch.device("cpu"), compile, precision=precision_of(precision)
        )
        print(f"\nwhere an eager {low} step of k3_small spends its time (exclusive, ms per step):")
        rows, total = component_times(model, step, ids)
        print_table(rows, total, args.batch * args.seq)

    if args.curve_steps > 0:
        batches = corpus_batches(compose_root(list(overrides)), args.curve_steps, args.curve_batch, args.seq)
        curves = {}
        for name in ("eager fp32", REFERENCE, "fast"):
            compile, precision, extra = PATHS[name]
            _, step = train_setup(
                compose_root([*overrides, *extra]),
                torch.device("cpu"),
                compile,
                precision=precision_of(precision),
            )
            curves[name] = [float(_runner(name)(step, b)) for b in batches]

        def gap(a: str, b: str) -> str:
            diff = [abs(x - y) for x, y in zip(curves[a], curves[b])]
            return f"largest step difference {max(diff):.4f}, mean {sum(diff) / len(diff):.4f}"

        print(
            f"loss curves over {args.curve_steps} steps (batch {args.curve_batch}): "
            + ", ".join(f"{n} {c[0]:.4f} -> {c[-1]:.4f}" for n, c in curves.items())
        )
        print(f"  fast vs {REFERENCE}: {gap('fast', REFERENCE)}")
        noise = "bf16 noise" if low == "bf16" else "fp32 rows (no bf16 noise), the dispatch's own difference"
        print(f"  {noise}, {REFERENCE} vs eager fp32: {gap(REFERENCE, 'eager fp32')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
