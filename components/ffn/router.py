"""Top-k router with a selection-only bias (DeepSeek-V3 / K3 "noaux_tc", docs/k3.md §4.1).

``scores = sigmoid(x W^T)`` in fp32 (softmax optional); experts are chosen by top-k of
``scores + e_score_correction_bias``, but the combine weights come from the UNBIASED scores of the chosen
experts, renormalised to sum to 1 (+1e-20) when ``k > 1`` and ``renormalize``, times
``routed_scaling_factor``. The bias is a persistent fp32 buffer (checkpointed, never trained by the
optimizer); load balancers (``components.balancers``) update it once per optimizer step.

Statistics for balancers (training mode only, detached, accumulated over micro-batches until a balancer's
``step`` consumes them and calls ``reset_stats``):

* ``load [E]`` (int64): how many tokens chose each expert; ``tokens``: how many tokens were routed.
* ``last``: the latest forward's routing (``scores`` WITH autograd graph, for auxiliary losses; detached
  ``indices`` and ``cutoff``). One micro-batch only; replaced by every forward.
* opt-in (``configure_stats``), for Quantile Balancing: ``hist [E, bins]`` (int32) counts of
  ``r = cutoff - score`` over ``[min b - 1, max b + 1]`` (docs/k3.md §6.6), or the list ``margins`` of ``r``
  blocks ``[N, E]`` of every micro-batch (exact quantiles; memory ``4 * M * E`` bytes per layer and step).

The cutoff of a token is its (k+1)-th largest biased score. It is free: the router takes top-(k+1) once and
uses the first k as routes. Every training-mode forward is counted once: a forward that activation
checkpointing recomputes in backward (``components/nn/recompute.py``) routes the same tokens the same way
and records nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from components.nn.build_context import INIT_STD
from components.nn.eager_island import eager_island
from components.nn.recompute import recomputing

ROUTER_ACTIVATIONS = ("sigmoid", "softmax")


@dataclass
class RouterRecord:
    """Routing of the latest training forward (one micro-batch)."""

    scores: torch.Tensor  # [N, E] fp32, unbiased, with autograd graph
    indices: torch.Tensor  # [N, k] int64, chosen experts
    cutoff: torch.Tensor  # [N] fp32, (k+1)-th largest biased score (-inf when k == E)
    shape: tuple[int, ...]  # leading dims of the input (e.g. (B, T)); N = prod(shape)


def histogram_range(bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[min b - 1, max b + 1]``: contains every ``r = cutoff - s`` when ``s`` lies in [0, 1] (docs/k3.md §6.6).

    0-d float64 tensors on the bias's device: the forward pass never waits on a host read of the bias."""
    b = bias.detach().double()
    return b.min() - 1.0, b.max() + 1.0


def margin_histogram(r: torch.Tensor, lo: float | torch.Tensor, hi: float | torch.Tensor, bins: int) -> torch.Tensor:
    """Per-expert bin counts ``[E, bins]`` (int32) of ``r [N, E]`` over equal bins of ``[lo, hi]``.

    Values outside the range are clamped into the end bins. Counts are additive, so histograms of any
    split of the tokens (micro-batches, ranks) sum to the histogram of all of them. int32: a bin counts at
    most the tokens of one optimizer step over all ranks (QB refuses a step beyond 2^31 - 1 tokens), and the
    histogram is kept and all-reduced every step (at K3 size half the 0.66 GB an int64 one takes).
    """
    N, E = r.shape
    width = (hi - lo) / bins
    # a NaN margin (scores of a diverging step) counts in the last bin instead of turning into a negative
    # index: the step ends and the non-finite guard names it, rather than bincount failing mid-forward
    idx = torch.nan_to_num(torch.floor((r.double() - lo) / width), nan=bins - 1).clamp_(0, bins - 1).long()  # [N, E]
    idx += torch.arange(E, device=r.device) * bins  # flatten (expert, bin)
    return torch.bincount(idx.flatten(), minlength=E * bins).view(E, bins).to(torch.int32)


class Router(nn.Module):
    """``router(x [..., d]) -> (indices [N, k], weights [N, k] fp32, scores [N, E] fp32)``, N = prod(...)."""

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        top_k: int,
        activation: str = "sigmoid",
        renormalize: bool = True,
        routed_scaling_factor: float = 1.0,
        init_std: float = INIT_STD,
        layer_idx: int = 0,
    ):
        super().__init__()
        if activation not in ROUTER_ACTIVATIONS:
            raise ValueError(f"router activation must be one of {ROUTER_ACTIVATIONS}, got {activation!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"need 1 <= top_k <= num_experts, got top_k={top_k}, num_experts={num_experts}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.activation = activation
        self.renormalize = renormalize
        self.routed_scaling_factor = routed_scaling_factor
        self.layer_idx = layer_idx
        # K3 gate.weight [E, d], kept in fp32; normal(0, init_std) as HF Kimi-Linear / DeepSeek-V3
        # (the K3 reference constructor uses kaiming_uniform, but its weights are always loaded)
        self.weight = nn.Parameter(torch.empty(num_experts, d_model, dtype=torch.float32))
        nn.init.normal_(self.weight, std=init_std)
        # selection-only bias; persistent so checkpoints carry what the balancer learned
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32), persistent=True)
        # balancer statistics (plain attributes: transient, not in the state dict)
        self.hist_bins = 0  # > 0: accumulate the QB histogram
        self.keep_margins = False  # accumulate r blocks for exact quantiles
        self.reset_stats()

    # -- dtype: weight and bias stay fp32 whatever the module is cast to -----------------------------
    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.weight.dtype != torch.float32:
            self.weight.data = self.weight.data.float()
        if self.e_score_correction_bias.dtype != torch.float32:
            self.e_score_correction_bias = self.e_score_correction_bias.float()
        return self

    # -- routing --------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = tuple(x.shape[:-1])
        h = x.reshape(-1, x.shape[-1])  # [N, d]
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(h.float(), self.weight.float())  # [N, E] fp32
        scores = torch.sigmoid(logits) if self.activation == "sigmoid" else torch.softmax(logits, dim=-1)  # [N, E]
        k, E = self.top_k, self.num_experts
        biased = scores.detach() + self.e_score_correction_bias  # [N, E], selection only
        # top-(k+1): the first k are the routes, the (k+1)-th is the token's cutoff (QB's alpha)
        top_vals, top_idx = torch.topk(biased, min(k + 1, E), dim=-1, sorted=True)  # [N, k(+1)]
        indices = top_idx[:, :k]  # [N, k]
        cutoff = top_vals[:, k] if k < E else torch.full_like(top_vals[:, 0], float("-inf"))  # [N]
        weights = scores.gather(1, indices)  # [N, k], unbiased scores
        if self.renormalize and k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.routed_scaling_factor
        if self.training and not recomputing():
            self._record(scores, indices, cutoff, shape)
        return indices, weights, scores

    # -- statistics -----------------------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Forget the accumulated statistics (a balancer calls this after consuming them in ``step``)."""
        self.load: Optional[torch.Tensor] = None  # [E] int64
        self.tokens = 0
        self.hist: Optional[torch.Tensor] = None  # [E, bins] int32
        self.hist_range: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # 0-d float64, on device
        self.margins: list[torch.Tensor] = []  # [N_i, E] fp32 blocks
        self.last: Optional[RouterRecord] = None

    def configure_stats(self, hist_bins: Optional[int] = None, keep_margins: Optional[bool] = None) -> None:
        """Turn the optional statistics on or off.

        When a statistic is switched on after exactly one micro-batch was routed (a balancer attaching
        lazily after the first forward), it is back-filled from ``last``; ``stats_complete`` tells whether
        the optional statistics cover all routed tokens of the step.
        """
        if hist_bins is not None and hist_bins != self.hist_bins:
            self.hist_bins = int(hist_bins)
            self.hist, self.hist_range = None, None
            if self.hist_bins and self._can_backfill():
                self._accumulate_hist(self._last_margins())
        if keep_margins is not None and keep_margins != self.keep_margins:
            self.keep_margins = bool(keep_margins)
            self.margins = []
            if self.keep_margins and self._can_backfill():
                self.margins.append(self._last_margins())

    def stats_complete(self) -> bool:
        """Whether the enabled optional statistics cover every token counted in ``tokens``."""
        if self.hist_bins and self.tokens and (self.hist is None or int(self.hist[0].sum()) != self.tokens):
            return False
        if self.keep_margins and sum(m.shape[0] for m in self.margins) != self.tokens:
            return False
        return True

    def _can_backfill(self) -> bool:
        return self.last is not None and self.tokens == self.last.indices.shape[0]

    def _last_margins(self) -> torch.Tensor:
        return self.last.cutoff[:, None] - self.last.scores.detach()  # [N, E]

    def _accumulate_hist(self, r: torch.Tensor) -> None:
        if self.hist_range is None:
            # depends only on the bias, which is fixed until the step ends
            self.hist_range = histogram_range(self.e_score_correction_bias)
        h = margin_histogram(r, *self.hist_range, self.hist_bins)  # [E, bins]
        self.hist = h if self.hist is None else self.hist + h

    @eager_island
    @torch.no_grad()
    def _record(
        self, scores: torch.Tensor, indices: torch.Tensor, cutoff: torch.Tensor, shape: tuple[int, ...]
    ) -> None:
        # Eager even inside a compiled layer (an island, not traced): it mutates per-step Python state and
        # its counts have data-dependent sizes. Everything stays on the device until a balancer's step.
        counts = torch.bincount(indices.flatten(), minlength=self.num_experts)  # [E]
        self.load = counts if self.load is None else self.load + counts
        self.tokens += indices.shape[0]
        self.last = RouterRecord(scores=scores, indices=indices.detach(), cutoff=cutoff.detach(), shape=shape)
        if self.hist_bins or self.keep_margins:
            r = cutoff[:, None] - scores.detach()  # [N, E]; expert j is chosen iff r_ij < b_j
            if self.hist_bins:
                self._accumulate_hist(r)
            if self.keep_margins:
                self.margins.append(r)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, activation={self.activation}, "
            f"renormalize={self.renormalize}, routed_scaling_factor={self.routed_scaling_factor}"
        )
