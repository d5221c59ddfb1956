"""Auxiliary load-balancing loss (Switch / DeepSeek expert-level; optional DeepSeek-V3 sequence-wise), docs/k3.md §6.2.

Per routed layer, for the current micro-batch of T tokens, E experts, top-k:

* ``f_j = c_j / (k T)``: fraction of the k*T routed (token, expert) pairs that went to expert j (what was
  actually selected, bias included). A count: no gradient.
* ``P_j = (1/T) sum_t s'_tj`` with per-token normalised scores ``s'_tj = s_tj / sum_l s_tl`` (a no-op for
  a softmax router; for a sigmoid router it makes sum_j P_j = 1 as in DeepSeek-V3). The gradient flows
  only through P.
* ``L = alpha * E * sum_j f_j P_j``: equal to ``alpha`` at perfect balance (f_j = 1/E), ``alpha * E`` at
  full collapse. This is DeepSeek's ``alpha * sum_j f'_j P_j`` with ``f'_j = E c_j / (k T)``, and the
  Switch loss for k = 1.

Data parallel: f counts the selections of the whole micro-batch over all ranks (one all-reduce of
``[layers, E]`` counts), and each rank's P is its local mean; the gradient average DDP takes over ranks
is then the gradient of the global-batch loss, as on one process with the same global batch.

``sequence_wise``: the same quantities per sequence (T = its length), averaged over the sequences of the
micro-batch (DeepSeek-V3's complementary loss, used there with alpha = 1e-4). The returned loss is summed
over routed layers. ``step`` only logs MaxVio (no bias update).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from components.balancers.base import Balancer
from components.balancers.load_stats import find_routers, finish_step, reduce_router_stats_
from components.config import ComponentConfig
from components.distributed import world_size
from components.ffn.router import RouterRecord
from components.registry import BALANCERS, ConfigError


@dataclass
class AuxLossConfig(ComponentConfig):
    name: str = "aux_loss"
    # loss weight (Switch ~1e-2; DeepSeek-V3 sequence-wise: 1e-4)
    alpha: float = 0.01
    # compute f and P within each sequence and average over sequences (needs [B, T] router inputs)
    sequence_wise: bool = False

    def validate(self, model: Any, key: str) -> None:
        if not self.alpha >= 0:
            raise ConfigError(f"{key}.alpha", f"must be >= 0, got {self.alpha}")


def selection_counts(record: RouterRecord) -> torch.Tensor:
    """How many of the micro-batch's (token, expert) selections went to each expert: ``[E]`` float."""
    E = record.scores.shape[-1]
    return torch.bincount(record.indices.flatten(), minlength=E).to(record.scores.dtype)


def balance_loss(
    record: RouterRecord, top_k: int, alpha: float, sequence_wise: bool = False, counts: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``alpha * E * sum_j f_j P_j`` for one router's latest routing (see the module docstring).

    ``counts [E]``: selections per expert over a larger batch (all data-parallel ranks) to take f from,
    instead of this record's own.
    """
    scores, indices = record.scores, record.indices  # [N, E], [N, k]
    N, E = scores.shape
    groups = record.shape[0] if sequence_wise and len(record.shape) >= 2 else 1  # sequences, or one group
    s = scores / scores.sum(dim=-1, keepdim=True).clamp_min(1e-20)  # [N, E] per-token normalised
    s = s.view(groups, N // groups, E)  # [G, T, E]
    P = s.mean(dim=1)  # [G, E]
    if counts is not None and not sequence_wise:
        f = (counts / counts.sum().clamp_min(1)).to(scores.dtype)[None]  # [1, E] sums to 1, like k*T pairs
    else:
        onehot = torch.zeros(N, E, dtype=scores.dtype, device=scores.device).scatter_(1, indices, 1.0)  # [N, E]
        f = onehot.view(groups, N // groups, E).sum(dim=1) / (top_k * (N // groups))  # [G, E], no grad
    return alpha * E * (f * P).sum(dim=-1).mean()


@BALANCERS.register("aux_loss", AuxLossConfig)
class AuxLossBalancer(Balancer):
    """Auxiliary loss alpha * E * sum_j f_j P_j (Switch / DeepSeek), optionally per sequence."""

    def aux_loss(self, model: nn.Module) -> Optional[torch.Tensor]:
        routers = [r for r in find_routers(model) if r.last is not None]
        if not routers:
            return None
        counts: list[Optional[torch.Tensor]] = [None] * len(routers)
        if world_size() > 1 and not self.cfg.sequence_wise:  # sequences never span ranks
            E = max(r.num_experts for r in routers)
            packed = torch.zeros(len(routers), E, dtype=torch.float64, device=routers[0].last.scores.device)  # [L, E]
            for i, r in enumerate(routers):
                packed[i, : r.num_experts] = selection_counts(r.last).double()
            reduce_router_stats_(packed)
            counts = [packed[i, : r.num_experts] for i, r in enumerate(routers)]
        terms = [
            balance_loss(r.last, r.top_k, self.cfg.alpha, self.cfg.sequence_wise, c) for r, c in zip(routers, counts)
        ]
        return torch.stack(terms).sum()

    def step(self, model: nn.Module) -> dict[str, float]:
        return finish_step(model)
