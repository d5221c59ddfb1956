"""Run one function on several CPU processes joined by a gloo process group, and collect what each returns.

``run_ranks(fn, world, tmp_path, *args)`` spawns ``world`` processes (spawn, not fork: a forked child of a
process that already ran OpenMP-parallel kernels can hang), each calling ``fn(rank, world, *args)`` inside an
initialised gloo group, and returns the per-rank results in rank order. ``fn`` must be importable (a module
level function) and return something ``torch.save`` can write.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(rank: int, world: int, folder: str, fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(result, f"{folder}/result.{rank}")


def run_ranks(fn: Callable[..., Any], world: int, tmp_path: Path, *args: Any) -> list[Any]:
    """``[fn(0, world, *args), ..., fn(world - 1, world, *args)]``, each computed on its own gloo rank."""
    folder = Path(tmp_path) / f"gloo_{fn.__name__}_{world}"
    folder.mkdir(parents=True, exist_ok=False)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank_main, args=(world, str(folder), fn, args), nprocs=world, join=True)
    return [torch.load(folder / f"result.{rank}", weights_only=False) for rank in range(world)]
