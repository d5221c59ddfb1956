"""Data-parallel rank helpers the model side needs (balancers sum router statistics over ranks).

They work on one process too: without an initialised process group every call is the one-rank case.
The runtime uses the same helpers (loss normalisation), so they live here, below both.
"""

from __future__ import annotations

import torch


def all_reduce_sum_(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` in place over data-parallel ranks (no-op on one process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
