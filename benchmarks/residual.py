"""Residual schemes: time and activation memory of one training step (forward + backward + AdamW step).

    PYTHONPATH=. python benchmarks/residual.py [--iters 5 --device cpu --threads 1 --d-model 256 --n-layers 12
                                               --seq 256 --batch 8]

Candidates: plain, full AttnRes, block AttnRes (block sizes 2, 4, 12 layers; and 3 sublayers, which gives a
12-layer model K3's 8 block summaries and 9-source final read), all the same decoder otherwise and
timed interleaved in one process (one step of each per round, order rotated every round) so machine
drift hits all alike; medians are reported as ratios to plain.

``--compile`` times torch.compile'd steps, as the trainer runs them on the CPU by default.

Memory: the activation bytes a training forward leaves for backward, as resident memory after the forward
minus before, in a fresh process per candidate (eager; Linux). A second table varies the depth at a fixed
number of blocks (4) and prints each scheme's activation bytes above plain's: block AttnRes stays flat
with depth (its extra memory follows the blocks), where keeping every read's output would grow by one
[B, T, d] per sublayer. On CUDA, additionally the peak allocated memory of a step above the resident model
and optimizer state (``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable without PYTHONPATH

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import medians  # noqa: E402
from timing import time_interleaved as _time_interleaved  # noqa: E402

from components.model import Decoder  # noqa: E402
from components.objective import cross_entropy  # noqa: E402
from components.optim.param_groups import adamw_param_groups, unique_trainable  # noqa: E402
from runtime.compose import compose, strip_hydra  # noqa: E402
from runtime.validation import validate  # noqa: E402

SCHEMES: dict[str, list[str]] = {
    "plain": ["residual=plain"],
    "full": ["residual=full_attnres"],
    "block2": ["residual=block_attnres", "residual.block_size=2"],
    "block4": ["residual=block_attnres", "residual.block_size=4"],
    "block12": ["residual=block_attnres", "residual.block_size=12"],
    "block12-keep": ["residual=block_attnres", "residual.block_size=12", "residual.recompute=false"],
    # K3's block count: 8 summaries (embedding + 7 blocks) and a 9-source final read, as over K3's 93 layers
    "k3blocks": ["residual=block_attnres", "residual.block_size=3", "residual.block_unit=sublayers"],
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    fns: dict[str, Callable[[], None]], iters: int, warmup: int, device: torch.device
) -> dict[str, float]:
    """Median seconds per call of each fn, interleaved (benchmarks/timing.py)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    return medians(_time_interleaved(fns, iters, warmup=warmup, sync=sync))


def build(overrides: list[str], args: argparse.Namespace, device: torch.device) -> Decoder:
    common = [f"model.d_model={args.d_model}", f"model.n_layers={args.n_layers}"]
    if args.backend and overrides[0] != "residual=plain":
        common.append(f"residual.backend={args.backend}")
    root = validate(strip_hydra(compose([*overrides, *common])))
    torch.manual_seed(0)  # same weights for every candidate where the parameters coincide
    return Decoder(root).to(device)


def make_step(model: Decoder, ids: torch.Tensor, targets: torch.Tensor, compile: bool = False) -> Callable[[], None]:
    opt = torch.optim.AdamW(adamw_param_groups(model, unique_trainable(model), 0.1), lr=1e-4)
    forward = torch.compile(model, dynamic=False) if compile else model

    def step() -> None:
        logits = forward(ids)
        loss = cross_entropy(logits, targets, reduction="mean")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def forward_activation_bytes(args: argparse.Namespace, overrides: list[str], n_layers: int) -> int:
    """Resident bytes the training forward leaves for backward (RSS after forward minus before), measured
    in a fresh process so allocations of other candidates cannot blur it; Linux only."""
    cmd = [
        sys.executable,
        __file__,
        "--measure-forward",
        json.dumps(overrides),
        "--d-model",
        str(args.d_model),
        "--n-layers",
        str(n_layers),
        "--seq",
        str(args.seq),
        "--batch",
        str(args.batch),
    ]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # big tensors in their own mappings: RSS tracks them
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    return int(out.split()[-1])


def measure_forward(args: argparse.Namespace) -> None:
    overrides = json.loads(args.measure_forward)
    model = build(overrides, args, torch.device("cpu"))
    ids = torch.randint(0, model.vocab_size, (args.batch, args.seq))
    model(ids).float().logsumexp(-1).mean().backward()  # warm every allocation path once
    model.zero_grad(set_to_none=True)
    gc.collect()
    before = _rss_bytes()
    loss = model(ids).float().logsumexp(-1).mean()
    after = _rss_bytes()
    del loss
    print(after - before)


def cuda_step_peak(step: Callable[[], None], device: torch.device) -> int:
    _sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    _sync(device)
    return torch.cuda.max_memory_allocated(device) - base


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=12)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--backend", default=None, help="AttnRes read backend: torch | fla | auto (default: the YAML's)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--compile", action="store_true", help="time torch.compile'd steps (as trainer.compile does)")
    p.add_argument("--only", default=None, help="comma-separated subset of " + ",".join(SCHEMES))
    p.add_argument("--depths", default="6,12,24", help="depths of the memory-vs-depth table ('' skips it)")
    p.add_argument("--measure-forward", default=None, help=argparse.SUPPRESS)  # internal: one measurement
    args = p.parse_args()
    if args.measure_forward:
        measure_forward(args)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    names = args.only.split(",") if args.only else list(SCHEMES)
    if "plain" not in names:
        names.insert(0, "plain")

    models = {name: build(SCHEMES[name], args, device) for name in names}
    vocab = models["plain"].vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g).to(device)
    x, y = ids[:, :-1], ids[:, 1:]

    activations = {name: forward_activation_bytes(args, SCHEMES[name], args.n_layers) for name in names}
    steps = {name: make_step(m, x, y, args.compile) for name, m in models.items()}
    times = time_interleaved(steps, args.iters, args.warmup, device)
    peaks = {name: cuda_step_peak(steps[name], device) for name in names} if device.type == "cuda" else None

    print(
        f"device {device} ({torch.get_num_threads()} threads), d_model {args.d_model}, {args.n_layers} layers, "
        f"batch {args.batch} x seq {args.seq}, median of {args.iters} interleaved steps (fwd+bwd+AdamW)"
    )
    header = f"{'scheme':<12} {'params':>11} {'step ms':>9} {'time/plain':>10} {'act MiB':>9} {'act/plain':>9}"
    if peaks is not None:
        header += f" {'peak MiB':>9} {'peak/plain':>10}"
    print(header)
    for name in names:
        m = models[name]
        line = (
            f"{name:<12} {m.num_params():>11,} {times[name] * 1e3:>9.1f} {times[name] / times['plain']:>10.3f} "
            f"{activations[name] / 2**20:>9.1f} {activations[name] / activations['plain']:>9.3f}"
        )
        if peaks is not None:
            line += f" {peaks[name] / 2**20:>9.1f} {peaks[name] / peaks['plain']:>10.3f}"
        print(line)
    if args.depths:
        depth_table(args, [int(v) for v in args.depths.split(",")])


def depth_table(args: argparse.Namespace, depths: list[int]) -> None:
    """Activation MiB above plain at several depths, 4 blocks for the block scheme."""
    print("\nactivation MiB above plain vs depth (block AttnRes: 4 blocks of L/4 layers)")
    print(f"{'layers':>6} {'plain MiB':>10} {'block':>8} {'block keep':>10} {'full':>8}")
    for L in depths:
        block = ["residual=block_attnres", f"residual.block_size={max(1, L // 4)}"]
        cands = {
            "plain": ["residual=plain"],
            "block": block,
            "block keep": [*block, "residual.recompute=false"],
            "full": ["residual=full_attnres"],
        }
        act = {n: forward_activation_bytes(args, o, L) for n, o in cands.items()}
        extra = {n: (act[n] - act["plain"]) / 2**20 for n in cands}
        print(
            f"{L:>6} {act['plain'] / 2**20:>10.1f} {extra['block']:>8.1f} {extra['block keep']:>10.1f} "
            f"{extra['full']:>8.1f}"
        )


if __name__ == "__main__":
    main()
