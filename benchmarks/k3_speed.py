"""``experiment=k3_small`` training speed on the CPU: the eager reference against the fast path, side by side.

    python -m benchmarks.k3_speed [--batch 32 --seq 256 --rounds 4 --curve-steps 50 --curve-batch 8]

Four ways to run one training step (forward, fp32 loss with the MTP depth's, backward, Muon with
per-head updates, the QB bias update), each from the same initial weights, timed in interleaved rounds
(one step of each per round, order rotated) so background load hits all alike:

* ``eager fp32``: no autocast, no compile;
* ``eager bf16``: bf16 autocast, no compile, experts dispatched as one padded product per expert
  (``ffn.dispatch=padded_bmm``, what ``auto`` chose on the CPU in bf16 before the blocked dispatch) --
  the eager path ``trainer.compile=auto`` ran for K3 before it compiled models with eager islands (the
  reference);
* ``eager auto``: the same with the expert dispatch ``auto`` chooses now (``blocked`` on the CPU in
  bf16): how much of the gain is the dispatch alone;
* ``fast``: bf16 autocast, ``auto`` dispatch, each decoder layer compiled around its remaining eager
  islands (runtime/compile.py; the blocked expert products are traced into the layer's graph) -- what
  the trainer runs now.

Then the loss curves: ``--curve-steps`` steps of the eager reference, of the fast path and of eager fp32
from the same weights on the same corpus batches; the fast path's differences from the reference are
printed beside the reference's own differences from fp32, the size of bf16 noise on this run.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.timing import medians, time_interleaved
from benchmarks.train_step import train_setup
from runtime.cpu_allocator import keep_freed_memory
from runtime.launch import validate_overrides

# name: (compile mode, precision, extra overrides)
PATHS = {
    "eager fp32": ("off", "fp32", []),  # auto: grouped_mm in fp32, as before
    "eager bf16": ("off", "bf16", ["ffn.dispatch=padded_bmm"]),
    "eager auto": ("off", "bf16", []),
    "fast": ("layers", "bf16", []),
}
REFERENCE = "eager bf16"


def corpus_batches(root, n: int, batch: int, seq: int) -> list[torch.Tensor]:
    """``n`` training batches ``[batch, seq + 1]`` of the configured dataset (the embedded corpus)."""
    from components.registry import DATASETS

    root.data.batch_size, root.data.seq_len = batch, seq
    dataset = DATASETS.build(root.data, root.seed)
    out = []
    for i in range(n):
        x, y = dataset.train_batch(i)  # [batch, seq] each
        out.append(torch.cat([x, y[:, -1:]], dim=1))  # [batch, seq + 1]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32, help="sequences per step (k3_small's default 32)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4, help="timed steps of each path")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each path first (compilation)")
    ap.add_argument("--curve-steps", type=int, default=50, help="steps of the loss-curve comparison (0: skip)")
    ap.add_argument("--curve-batch", type=int, default=8)
    ap.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset of: " + ", ".join(PATHS))
    ap.add_argument("overrides", nargs="*", help="config overrides after experiment=k3_small")
    args = ap.parse_args(argv)
    overrides = ["experiment=k3_small", *args.overrides]
    names = [n for n in args.paths.split(",") if n]
    unknown = set(names) - set(PATHS)
    if unknown:
        ap.error(f"--paths: unknown {sorted(unknown)}; choose from {', '.join(PATHS)}")

    keep_freed_memory()  # as the trainer does on the CPU, for every path alike
    print(
        f"k3_small training step on the CPU ({torch.get_num_threads()} threads), batch {args.batch} x {args.seq} "
        "tokens; "
        f"{args.warmup} warmup + {args.rounds} timed steps each, interleaved"
    )
    ids = corpus_batches(validate_overrides(list(overrides)), 1, args.batch, args.seq)[0]
    steps = {}
    for name in names:
        compile, precision, extra = PATHS[name]
        _, step = train_setup(
            validate_overrides([*overrides, *extra]), torch.device("cpu"), compile, precision=precision
        )
        steps[name] = lambda s=step: s(ids)
    t0 = time.perf_counter()
    sec = medians(time_interleaved(steps, args.rounds, warmup=args.warmup))
    tokens = args.batch * args.seq
    ref = sec.get(REFERENCE)
    print(f"{'path':12s} {'s/step':>8s} {'tokens/s':>9s} {'vs ' + REFERENCE:>14s}")
    for name in names:
        ratio = f"{ref / sec[name]:.2f}x" if ref else "-"
        print(f"{name:12s} {sec[name]:8.3f} {tokens / sec[name]:9,.0f} {ratio:>14s}")
    print(f"(measured in {time.perf_counter() - t0:.0f} s, compilation included)")

    if args.curve_steps > 0:
        batches = corpus_batches(validate_overrides(list(overrides)), args.curve_steps, args.curve_batch, args.seq)
        curves = {}
        for name in ("eager fp32", REFERENCE, "fast"):
            compile, precision, extra = PATHS[name]
            _, step = train_setup(
                validate_overrides([*overrides, *extra]), torch.device("cpu"), compile, precision=precision
            )
            curves[name] = [float(step(b)) for b in batches]

        def gap(a: str, b: str) -> str:
            diff = [abs(x - y) for x, y in zip(curves[a], curves[b])]
            return f"largest step difference {max(diff):.4f}, mean {sum(diff) / len(diff):.4f}"

        print(
            f"loss curves over {args.curve_steps} steps (batch {args.curve_batch}): "
            + ", ".join(f"{n} {c[0]:.4f} -> {c[-1]:.4f}" for n, c in curves.items())
        )
        print(f"  fast vs {REFERENCE}: {gap('fast', REFERENCE)}")
        print(f"  bf16 noise, {REFERENCE} vs eager fp32: {gap(REFERENCE, 'eager fp32')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
