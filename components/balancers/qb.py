"""Quantile Balancing (K3), docs/k3.md §6.4-6.6.

Per routed layer and optimizer step, with the OLD bias ``b`` (the one every micro-batch of the step was
routed with):

1. each token's cutoff ``alpha_i`` = its (k+1)-th largest ``s_i + b`` (the router's free by-product);
2. ``r_ij = alpha_i - s_ij``; expert j takes token i iff ``r_ij < b_j``;
3. ``b^_j`` = the k/E quantile of column ``r_:j`` over the M tokens of the step (all micro-batches, all
   ranks), so that with the cutoffs held fixed about ``q = M k / E`` tokens pick each expert;
4. ``b_new = b^ - mean(b^)`` (top-k is invariant to a common shift), written into the router's
   ``e_score_correction_bias`` and used from the NEXT step on (causality: a batch is never re-routed with
   a bias computed from itself).

Quantile estimators (``estimator``):

* ``histogram`` (K3, default): per-expert counts of r in ``bins`` equal bins over
  ``[min b - 1, max b + 1]`` (a range fixed by the old bias, so counts of micro-batches and ranks simply
  add: one all-reduce of ``[E, bins]`` int32 for all layers); ``b^_j`` interpolates linearly inside the first
  bin whose cumulative count reaches ``tau = M k / E``. Memory ``4 E bins`` bytes per layer.
* ``exact``: order statistic ``b^_j`` = the (q+1)-th smallest ``r_:j`` (q = round(M k / E)), so exactly q
  tokens satisfy ``r_ij < b^_j`` when there are no ties. Keeps every micro-batch's ``r`` block:
  ``4 M E`` bytes per layer until the step (fine for small runs); ranks all-gather their blocks.
* ``interpolated``: the linearly interpolated k/E quantile (``numpy.quantile`` "linear"), same memory.

Exactly balanced fixed-cutoff counts do not mean balanced routing of the next batch (the cutoffs move
once the bias changes); QB converges over steps. With ``top_k == num_experts`` there is nothing to balance
and the bias is left unchanged.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from components.balancers import load_stats
from components.balancers.base import Balancer
from components.balancers.load_stats import (
    find_routers,
    maxvio_metrics,
    reduce_router_stats_,
    reduced_loads,
)
from components.config import ComponentConfig
from components.distributed import world_size
from components.ffn.router import Router, histogram_range, margin_histogram
from components.registry import BALANCERS, ConfigError

QB_ESTIMATORS = ("histogram", "exact", "interpolated")


@dataclass
class QBConfig(ComponentConfig):
    name: str = "qb"
    # histogram (K3), exact (order statistic) or interpolated (linear quantile)
    estimator: str = "histogram"
    # histogram bins (K3: 1000; 10000 balanced no better)
    bins: int = 1000

    def validate(self, model: Any, key: str) -> None:
        if self.estimator not in QB_ESTIMATORS:
            raise ConfigError(f"{key}.estimator", f"must be one of {', '.join(QB_ESTIMATORS)}, got '{self.estimator}'")
        if self.bins < 2:
            raise ConfigError(f"{key}.bins", f"must be >= 2, got {self.bins}")


# -- estimators: r [M, E] or its histogram -> uncentred b^ [E] (float64) ----------------------------------
def qb_bias_histogram(hist: torch.Tensor, lo: float, hi: float, tokens: float, top_k: int) -> torch.Tensor:
    """Interpolated lower k/E quantile of each expert's r from bin counts ``hist [E, bins]`` over [lo, hi]."""
    E, bins = hist.shape
    width = (hi - lo) / bins
    tau = tokens * top_k / E  # target count per expert
    cum = hist.double().cumsum(dim=-1)  # [E, bins]
    i = (cum < tau).sum(dim=-1).clamp(max=bins - 1)  # [E] first bin whose cumulative count reaches tau
    prev = torch.where(i > 0, cum.gather(1, (i - 1).clamp(min=0)[:, None])[:, 0], 0.0)  # [E] count below bin i
    count = hist.double().gather(1, i[:, None])[:, 0].clamp(min=1)  # [E]
    return lo + width * (i.double() + (tau - prev) / count)


def qb_bias_exact(r: torch.Tensor, top_k: int) -> torch.Tensor:
    """Order statistic: the (q+1)-th smallest of each column of ``r [M, E]``, q = round(M k / E)."""
    M, E = r.shape
    q = min(M - 1, int(round(M * top_k / E)))
    return torch.kthvalue(r.double(), q + 1, dim=0).values  # [E]


def qb_bias_interpolated(r: torch.Tensor, top_k: int) -> torch.Tensor:
    """Linearly interpolated k/E quantile of each column of ``r [M, E]`` (numpy's default method)."""
    M, E = r.shape
    s = torch.sort(r.double(), dim=0).values  # [M, E]
    h = (M - 1) * top_k / E
    i0 = int(h)
    i1 = min(i0 + 1, M - 1)
    return s[i0] + (h - i0) * (s[i1] - s[i0])


def center(b: torch.Tensor) -> torch.Tensor:
    return b - b.mean()


def quantile_balance_update(
    scores: torch.Tensor, bias: torch.Tensor, top_k: int, num_bins: Optional[int] = 1000
) -> torch.Tensor:
    """One QB step as a pure function: the centred new bias ``[N]`` for one batch of router scores.

    scores: ``[M, N]`` after the router activation (sigmoid); bias: ``[N]``, the bias the batch was routed
    with; ``num_bins=None`` takes the exact order statistic, otherwise K3's histogram estimate over
    ``[min b - 1, max b + 1]``. With ``top_k >= N`` there is nothing to balance: the bias comes back
    unchanged. The balancer below does the same from statistics gathered over micro-batches and ranks.
    """
    M, N = scores.shape
    if top_k >= N:
        return bias.clone()
    s = scores.float()
    cutoff = (s + bias.float()).topk(top_k + 1, dim=-1).values[:, -1]  # [M] (k+1)-th largest biased score
    r = cutoff[:, None] - s  # [M, N] expert j takes token i iff r_ij < b_j
    if num_bins is None:
        new = qb_bias_exact(r, top_k)
    else:
        lo, hi = histogram_range(bias)
        new = qb_bias_histogram(margin_histogram(r, lo, hi, num_bins), lo, hi, M, top_k)
    return center(new).to(bias.dtype)


def _all_gather_rows(r: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``[M_rank, E]`` block (ranks may hold different M)."""
    if world_size() == 1:
        return r
    group = load_stats.router_stats_group()  # looked up when called: the one place that names the group
    n = torch.tensor([r.shape[0]], device=r.device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, n, group=group)
    m = int(max(s.item() for s in sizes))
    padded = torch.zeros(m, r.shape[1], dtype=r.dtype, device=r.device)
    padded[: r.shape[0]] = r
    blocks = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(blocks, padded, group=group)
    return torch.cat([b[: int(s.item())] for b, s in zip(blocks, sizes)])


@BALANCERS.register("qb", QBConfig)
class QBBalancer(Balancer):
    """Quantile Balancing (K3): bias = centred k/E quantile of (cutoff - score) over the step's tokens."""

    def __init__(self, cfg: QBConfig):
        super().__init__(cfg)
        self._warned = False

    def attach(self, model: nn.Module) -> None:
        """Ask every router for the statistics this estimator needs.

        Call once before training; ``aux_loss`` and ``step`` also call it, which covers a run whose first
        step has one micro-batch (the router back-fills from its latest forward).
        """
        hist = self.cfg.estimator == "histogram"
        for r in find_routers(model):
            r.configure_stats(hist_bins=self.cfg.bins if hist else 0, keep_margins=not hist)

    def aux_loss(self, model: nn.Module) -> Optional[torch.Tensor]:
        self.attach(model)
        return None

    @torch.no_grad()
    def new_biases(self, routers: list[Router], tokens: torch.Tensor) -> list[Optional[torch.Tensor]]:
        """Centred new bias per router (None: leave unchanged), from statistics summed over ranks."""
        if self.cfg.estimator == "histogram":
            hists = []
            for r in routers:
                h = r.hist if r.hist is not None else torch.zeros(r.num_experts, self.cfg.bins, dtype=torch.int32)
                hists.append(h.to(r.e_score_correction_bias.device).flatten())
            if float(tokens.max()) > torch.iinfo(torch.int32).max:
                raise OverflowError(
                    f"qb: {int(tokens.max())} tokens routed in one step, more than the int32 histogram counts "
                    "(2^31 - 1): use balancer.estimator=exact or a smaller global batch"
                )
            flat = reduce_router_stats_(torch.cat(hists))  # one collective for all layers
            sizes = [h.numel() for h in hists]
            out = []
            for r, h, M in zip(routers, flat.split(sizes), tokens.tolist()):
                if M <= 0 or r.top_k >= r.num_experts:
                    out.append(None)
                    continue
                lo, hi = r.hist_range if r.hist_range is not None else histogram_range(r.e_score_correction_bias)
                out.append(center(qb_bias_histogram(h.view(r.num_experts, -1), lo, hi, M, r.top_k)))
            return out
        estimate = qb_bias_exact if self.cfg.estimator == "exact" else qb_bias_interpolated
        out = []
        for r in routers:
            local = torch.cat(r.margins) if r.margins else r.e_score_correction_bias.new_zeros(0, r.num_experts)
            rows = _all_gather_rows(local)  # [M, E]
            if rows.shape[0] == 0 or r.top_k >= r.num_experts:
                out.append(None)
                continue
            out.append(center(estimate(rows, r.top_k)))
        return out

    @torch.no_grad()
    def step(self, model: nn.Module) -> dict[str, float]:
        routers = find_routers(model)
        if not routers:
            return {}
        self.attach(model)
        incomplete = [r for r in routers if not r.stats_complete()]
        if incomplete and not self._warned:
            self._warned = True
            warnings.warn(
                "qb: some routers lack statistics for part of this step (the balancer attached after "
                "several micro-batches); their bias is left unchanged this step. Call balancer.attach(model) "
                "before training.",
                stacklevel=2,
            )
        loads, tokens = reduced_loads(routers)  # [L, E], [L]
        metrics = maxvio_metrics(routers, loads, tokens)
        for r, b in zip(routers, self.new_biases(routers, tokens)):
            if b is not None and r not in incomplete:
                r.e_score_correction_bias.copy_(b.to(r.e_score_correction_bias.dtype))
            r.reset_stats()
        return metrics
