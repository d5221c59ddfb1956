"""Expert parallelism: each rank of an expert-parallel group holds ``E / n`` whole experts, and the (token,
slot) pairs of every rank travel to their experts' ranks and back by all-to-all.

Where: between the routed down-projection and the weighting of a latent MoE (K3's Stable LatentMoE), so
the rows that travel are ``d_latent`` wide (half of d_model in K3), as the release computes them; in a
full-width MoE they are d_model wide. Per forward, on every rank of the group:

1. sort the rank's ``N * k`` pairs by expert (stable: token order inside an expert); expert ``e`` lives on
   rank ``e // (E / n)``, so the pairs for each destination are contiguous;
2. exchange the per-destination pair counts (a plain all-to-all of n integers, then one host read: the
   row counts of the next exchanges), then each pair's local expert index and its row ``[P, d_latent]``;
3. run the received rows through the experts' own dispatch back-end (``RoutedExperts.dispatch_rows``) with
   this rank's expert matrices, each row weighted 1;
4. send the outputs back by the reverse all-to-all; weight each pair by its router weight in fp32, un-sort
   and sum the k choices, exactly as the one-process path does.

The row exchanges are ``torch.distributed._functional_collectives.all_to_all_single``, which autograd
differentiates as the reverse exchange. A rank that receives no rows still runs steps 3 and 4 on an empty
block, so it takes part in every forward and backward collective (a rank leaving the graph would leave its
peers' backward all-to-all waiting forever), and its experts get zero gradients, not none.

The expert weights are DTensors on the expert-parallel mesh dimension, ``Shard(0)``: their global names and
shapes are those of one process, so a distributed checkpoint reloads under any other expert-parallel size.
Router statistics are not exchanged here: they are counted before dispatch, on every rank's own tokens,
and reduced over every data-parallel rank (components/balancers/load_stats.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from components.ffn.experts import RoutedExperts, _GatherRows, _PermuteRows

EXPERT_WEIGHTS = ("w1", "w2", "w3")


def _local(w: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a weight sharded on the expert dimension (a plain tensor is taken as local)."""
    from torch.distributed.tensor import DTensor  # start-up time: DTensor, only sharded runs

    return w.to_local() if isinstance(w, DTensor) else w


class ExpertParallel:
    """The forward of a ``RoutedExperts`` whose experts are spread over the ranks of ``group`` (``size``
    ranks, this one at ``rank`` holding experts ``[rank * E / size, (rank + 1) * E / size)``). Not a module:
    set as ``experts.expert_parallel``, it adds no parameters and no names."""

    def __init__(self, group: Any, size: int, rank: int) -> None:
        self.group, self.size, self.rank = group, size, rank

    def __call__(
        self, experts: RoutedExperts, z: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol  # start-up time: only expert-parallel runs

        if experts.capacity_factor is not None:
            raise ValueError("expert parallelism is dropless: capacity_factor must be None")
        dtype = experts.compute_dtype(z)
        z = z.to(dtype)
        w1, w2, w3 = (_local(getattr(experts, n)).to(dtype) for n in EXPERT_WEIGHTS)  # [E/n, ...] each
        per_rank = experts.num_experts // self.size
        if w1.shape[0] != per_rank:
            raise ValueError(f"this rank holds {w1.shape[0]} experts, expected {experts.num_experts} / {self.size}")
        N, k = indices.shape
        d = z.shape[-1]
        flat = indices.reshape(-1)  # [N*k], pair p = token * k + slot
        order = torch.argsort(flat, stable=True)  # [N*k] pairs grouped by expert, hence by destination rank
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        expert_sorted = flat[order]  # [N*k]
        send = torch.bincount(flat // per_rank, minlength=self.size)  # [n] pairs for each rank
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # [n] pairs from each rank
        send_splits, recv_splits = send.tolist(), recv.tolist()  # the one host read: sizes of the exchanges
        local_expert = funcol.all_to_all_single(
            (expert_sorted % per_rank).contiguous(), recv_splits, send_splits, self.group
        )  # [R] expert (local index) of each received row
        rows = _GatherRows.apply(z, order // k, inverse, k)  # [N*k, d] the pairs' rows, sorted
        received = funcol.all_to_all_single(rows, recv_splits, send_splits, self.group)  # [R, d]
        ones = torch.ones(received.shape[0], 1, dtype=weights.dtype, device=received.device)  # [R, 1]
        out = experts.dispatch_rows(received, funcol.wait_tensor(local_expert)[:, None], ones, w1, w2, w3)  # [R, d]
        back = funcol.all_to_all_single(out, send_splits, recv_splits, self.group)  # [N*k, d] sorted pair order
        acc = torch.promote_types(dtype, torch.float32)
        yw = back.to(acc) * weights.reshape(-1)[order].to(acc)[:, None]  # [N*k, d]; fp32 weighting
        full = _PermuteRows.apply(yw, inverse, order)  # [N*k, d], pair order
        return full.view(N, k, d).sum(dim=1).to(dtype)  # [N, d]


def routed_experts(model: nn.Module) -> list[RoutedExperts]:
    return [m for m in model.modules() if isinstance(m, RoutedExperts)]


def distribute_experts(model: nn.Module, ep_mesh: Any) -> list[RoutedExperts]:
    """Spread the experts of every routed layer of ``model`` over the 1-D expert-parallel mesh ``ep_mesh``:
    each weight becomes a ``Shard(0)`` DTensor (this rank keeps its ``E / n`` experts, global name and shape
    unchanged) and the layer's forward exchanges pairs with its peers. Every rank must start from the same
    weights (the same seed). Returns the layers."""
    from torch.distributed.tensor import Shard, distribute_tensor  # start-up time: DTensor, only sharded runs

    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    layers = routed_experts(model)
    for experts in layers:
        if experts.num_experts % size:
            raise ValueError(f"{experts.num_experts} experts do not split over {size} expert-parallel ranks")
        for name in EXPERT_WEIGHTS:
            w = getattr(experts, name)
            setattr(experts, name, nn.Parameter(distribute_tensor(w.detach(), ep_mesh, [Shard(0)]), w.requires_grad))
        experts.expert_parallel = ExpertParallel(ep_mesh.get_group(), size, rank)
    return layers
