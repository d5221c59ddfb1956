"""Residual schemes: time and activation memory of one training step (forward + backward + AdamW step).

    PYTHONPATH=. python benchmarks/residual.py [--iters 5 --device cpu --threads 1 --d-model 256 --n-layers 12 --seq 256 --batch 8]

Candidates: plain, full AttnRes, block AttnRes (block sizes 2, 4, 12), all the same decoder otherwise and
timed interleaved in one process (one step of each per round, order rotated every round) so machine
drift hits all alike; medians are reported as ratios to plain.

Memory: on CPU, the bytes autograd saves for backward during the forward (unique storages seen by
``saved_tensors_hooks``, parameters excluded): deterministic, and the part of peak memory the residual
scheme changes. On CUDA, additionally the peak allocated memory of a step above the resident model and
optimizer state (``torch.cuda.max_memory_allocated``).
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
from components.config import validate  # noqa: E402
from components.launch import compose, strip_hydra  # noqa: E402
from components.model import Decoder  # noqa: E402
from components.optim.build import adamw_param_groups, unique_trainable  # noqa: E402

SCHEMES: dict[str, list[str]] = {
    "plain": ["residual=plain"],
    "full": ["residual=full_attnres"],
    "block2": ["residual=block_attnres", "residual.block_size=2"],
    "block4": ["residual=block_attnres", "residual.block_size=4"],
    "block12": ["residual=block_attnres", "residual.block_size=12"],
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(fns: dict[str, Callable[[], None]], iters: int, warmup: int, device: torch.device) -> dict[str, float]:
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


def make_step(model: Decoder, ids: torch.Tensor, targets: torch.Tensor) -> Callable[[], None]:
    opt = torch.optim.AdamW(adamw_param_groups(unique_trainable(model), 0.1), lr=1e-4)

    def step() -> None:
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def saved_activation_bytes(model: Decoder, ids: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for backward over one forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()  # saved tensors stay alive, so addresses are not reused
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids).float().logsumexp(-1).mean()
    total = sum(seen.values())
    del loss
    return total


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
    p.add_argument("--only", default=None, help="comma-separated subset of " + ",".join(SCHEMES))
    args = p.parse_args()
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

    activations = {name: saved_activation_bytes(m, x) for name, m in models.items()}
    steps = {name: make_step(m, x, y) for name, m in models.items()}
    times = time_interleaved(steps, args.iters, args.warmup, device)
    peaks = {name: cuda_step_peak(steps[name], device) for name in names} if device.type == "cuda" else None

    print(
        f"device {device} ({torch.get_num_threads()} threads), d_model {args.d_model}, {args.n_layers} layers, "
        f"batch {args.batch} x seq {args.seq}, median of {args.iters} interleaved steps (fwd+bwd+AdamW)"
    )
    header = f"{'scheme':<9} {'params':>11} {'step ms':>9} {'time/plain':>10} {'saved MiB':>10} {'saved/plain':>11}"
    if peaks is not None:
        header += f" {'peak MiB':>9} {'peak/plain':>10}"
    print(header)
    for name in names:
        m = models[name]
        line = (
            f"{name:<9} {m.num_params():>11,} {times[name] * 1e3:>9.1f} {times[name] / times['plain']:>10.3f} "
            f"{activations[name] / 2**20:>10.1f} {activations[name] / activations['plain']:>11.3f}"
        )
        if peaks is not None:
            line += f" {peaks[name] / 2**20:>9.1f} {peaks[name] / peaks['plain']:>10.3f}"
        print(line)


if __name__ == "__main__":
    main()
