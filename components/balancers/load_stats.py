"""Shared balancer plumbing: find routers, all-reduce their statistics, MaxVio (docs/k3.md §6.1).

Every balancer's ``step`` reads the loads each router accumulated over the micro-batches of the step,
sums them over data-parallel ranks (one all-reduce for all layers), logs MaxVio, and resets the routers.

Which ranks: ``router_stats_group``, the one place every balancer's collective takes its group from. Router
statistics are counted before dispatch, on the tokens each rank routes, so they are summed over every rank
that holds a different share of the batch -- every data-parallel rank, expert-parallel peers included (an
expert-parallel group alone would see a fraction of the batch: wrong biases, a wrong MaxVio).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from components.distributed import all_reduce_sum_, world_size
from components.ffn.router import Router


def router_stats_group() -> Any:
    """The process group router statistics are reduced over: every data-parallel rank. The trainer's ranks
    are all data-parallel (no tensor or pipeline parallelism; expert parallelism splits the experts, not the
    batch), so that is the default group (None)."""
    return None


def reduce_router_stats_(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` in place over ``router_stats_group`` (no-op on one process)."""
    return all_reduce_sum_(t, router_stats_group())


def find_routers(model: nn.Module) -> list[Router]:
    """Every routed layer's router, in module order."""
    return [m for m in model.modules() if isinstance(m, Router)]


def router_labels(routers: list[Router]) -> list[str]:
    """``layer_<layer_idx>``; ``router_<position>`` when layer indices are not unique."""
    labels = [f"layer_{r.layer_idx}" for r in routers]
    return labels if len(set(labels)) == len(labels) else [f"router_{i}" for i in range(len(routers))]


def reduced_loads(routers: list[Router]) -> tuple[torch.Tensor, torch.Tensor]:
    """Step loads ``[L, E]`` and token counts ``[L]`` (float64), summed over ranks.

    A router that saw no tokens this step contributes zeros.
    """
    device = routers[0].e_score_correction_bias.device
    E = max(r.num_experts for r in routers)
    packed = torch.zeros(len(routers), E + 1, dtype=torch.float64, device=device)  # [L, E | tokens]
    for i, r in enumerate(routers):
        if r.load is not None:
            packed[i, : r.num_experts] = r.load.to(device=device, dtype=torch.float64)
        packed[i, E] = r.tokens
    reduce_router_stats_(packed)
    return packed[:, :E], packed[:, E]


def bias_rank_divergence(routers: list[Router]) -> float:
    """Largest difference of any selection-bias entry between data-parallel ranks (0 when in sync)."""
    bias = torch.cat([r.e_score_correction_bias.detach().double().flatten() for r in routers])  # [sum E]
    if world_size() == 1:
        return 0.0
    extremes = torch.cat([bias, -bias])  # max over ranks of both: [max b | -min b]
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=router_stats_group())
    return float((extremes[: bias.numel()] + extremes[bias.numel() :]).max())


def maxvio(load: torch.Tensor) -> torch.Tensor:
    """``(max_j l_j - q) / q`` with ``q = mean_j l_j`` (= M k / N): relative overload of the busiest expert."""
    q = load.double().mean(-1)
    return (load.double().amax(-1) - q) / q


def maxvio_metrics(routers: list[Router], loads: torch.Tensor, tokens: torch.Tensor) -> dict[str, float]:
    """``maxvio/layer_<i>`` per routed layer plus ``maxvio/mean`` and ``maxvio/max`` over layers."""
    metrics: dict[str, float] = {}
    values = []
    for i, (r, label) in enumerate(zip(routers, router_labels(routers))):
        if tokens[i] <= 0:
            continue
        v = float(maxvio(loads[i, : r.num_experts]))
        metrics[f"maxvio/{label}"] = v
        values.append(v)
    if values:
        metrics["maxvio/mean"] = sum(values) / len(values)
        metrics["maxvio/max"] = max(values)
    return metrics


def finish_step(model: nn.Module, routers: Optional[list[Router]] = None) -> dict[str, float]:
    """MaxVio of the step, then reset every router's statistics (for balancers without a bias update)."""
    routers = find_routers(model) if routers is None else routers
    if not routers:
        return {}
    loads, tokens = reduced_loads(routers)
    metrics = maxvio_metrics(routers, loads, tokens)
    for r in routers:
        r.reset_stats()
    return metrics
