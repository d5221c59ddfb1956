"""The L2 norm of all gradients, and clipping by it, over parameters sharded on any number of device meshes.

``torch.nn.utils.get_total_norm`` stacks the per-tensor norms, which fails once gradients live on two meshes
(FSDP2 over every rank for most weights, over the expert-sharding dimension for experts): "All operands in
aten.stack.default must have the same mesh". Here each gradient contributes the sum of squares of its local
shard; those sums are added per set of mesh dimensions the gradient is sharded over and all-reduced over
exactly those dimensions (a replicated dimension holds copies, which must not be added), in the order the
parameters come, the same on every rank. The result is the one-process norm up to summation order.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _sharded_dims(grad: Any) -> tuple[Any, tuple[int, ...]]:
    """(mesh, the mesh dimensions ``grad`` is split over) for a DTensor gradient: every dimension that is not
    a copy (``Shard``, and FSDP's ``_StridedShard`` on a dimension another mesh dimension splits too)."""
    for i, p in enumerate(grad.placements):
        if p.is_partial():
            raise ValueError(f"gradient placement {p} on mesh dimension {i}: a pending sum, not a gradient")
    return grad.device_mesh, tuple(i for i, p in enumerate(grad.placements) if not p.is_replicate())


def total_grad_norm(params: Iterable[torch.Tensor]) -> Optional[torch.Tensor]:
    """L2 norm (a plain fp32 scalar tensor) of the gradients of ``params``, plain or DTensor on any meshes,
    equal on every rank; None when no parameter has a gradient. A collective where gradients are sharded:
    every rank must call it with its parameters in the same order."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return None
    if not any(isinstance(g, DTensor) for g in grads):  # one process, or DDP: torch's own norm, as always
        return torch.nn.utils.get_total_norm(grads, norm_type=2.0).float()
    plain = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    sharded: dict[tuple[int, tuple[int, ...]], tuple[Any, tuple[int, ...], torch.Tensor]] = {}
    for g in grads:
        if not isinstance(g, DTensor):
            plain = plain + g.detach().float().pow(2).sum()
            continue
        local = g.to_local().detach().float().pow(2).sum()
        mesh, dims = _sharded_dims(g)
        if not dims:  # replicated everywhere: every rank holds the whole gradient
            plain = plain + local
            continue
        key = (id(mesh), dims)
        _, _, acc = sharded.get(key, (mesh, dims, torch.zeros_like(local)))
        sharded[key] = (mesh, dims, acc + local)
    total = plain
    for mesh, dims, acc in sharded.values():  # insertion order: the parameters' order, the same on every rank
        for dim in dims:
            dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
        total = total + acc.to(total.device)
    return total.sqrt()


@torch.no_grad()
def clip_grads_with_norm_(params: Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale every gradient by ``min(1, max_norm / (total_norm + 1e-6))`` (``total_grad_norm``'s value, as
    ``torch.nn.utils.clip_grads_with_norm_``), in place, shard by shard: no collective."""
    coef = (max_norm / (total_norm.float() + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is None:
            continue
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        local.mul_(coef.to(device=local.device, dtype=local.dtype))
