"""Rank helpers the model side needs: sums over data-parallel ranks (balancers' router statistics), and
the guard that keeps one-process tools (generation, export) off a model split over ranks.

They work on one process too: without an initialised process group every call is the one-rank case.
The runtime uses the same helpers (loss normalisation), so they live here, below both.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist


def all_reduce_sum_(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum ``t`` in place over the ranks of ``group`` (None: every rank; no-op on one process)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class ShardedModelError(RuntimeError):
    """A one-process tool was handed a model whose parameters are split over ranks."""


def require_whole_model(model: torch.nn.Module, what: str) -> None:
    """Refuse, naming the first split parameter, to run ``what`` (a one-process tool: generation, export)
    on a model whose parameters are split over ranks (FSDP2 shards, expert-parallel experts): on one rank
    alone its first collective would wait forever for peers that never call it."""
    tensor_module = sys.modules.get("torch.distributed.tensor")
    if tensor_module is None:  # never imported: no parameter can be a DTensor
        return
    for name, p in model.named_parameters():
        if isinstance(p, tensor_module.DTensor) and p.device_mesh.size() > 1:
            raise ShardedModelError(
                f"{what} runs on one process, but parameter '{name}' is split over {p.device_mesh.size()} ranks "
                f"({', '.join(str(pl) for pl in p.placements)}); read the run with runtime.load_run.load_run "
                f"(one process, every parameter whole) and call {what} on that model"
            )
