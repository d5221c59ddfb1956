"""Data-parallel rank helpers the model side needs (balancers sum router statistics over ranks).

They work on one process too: without an initialised process group every call is the one-rank case.
The runtime uses the same helpers (loss normalisation), so they live here, below both.
"""

from __future__ import annotations

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
