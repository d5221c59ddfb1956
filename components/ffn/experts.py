"""Routed GLU experts stored as 3-D tensors, with loop-free grouped dispatch (docs/k3.md §4.2).

Weights (``nn.Linear`` convention, ``y = x W^T``), for E experts of input width ``d_in`` and hidden width m:

* ``w1 [E, m, d_in]`` gate, ``w3 [E, m, d_in]`` up, ``w2 [E, d_in, m]`` down;
  expert e computes ``w2[e] @ act(w1[e] z, w3[e] z)``.

A K3 per-expert state dict maps one to one: ``experts.{i}.w1.weight`` <-> ``experts.w1[i]`` (same for
``w2``, ``w3``); see ``per_expert_state_dict`` / ``load_per_expert_state_dict``. (Kimi Linear's
``gate_up_proj [E, 2m, d]`` is ``cat([w1, w3], 1)``.)

Dispatch: sort the N*k (token, expert) pairs by expert (stable, so each expert sees its tokens in token
order), gather the tokens, run the three matmuls as grouped GEMMs over the contiguous per-expert blocks,
weight each pair's output by its router weight in fp32, and un-sort into ``[N, k, d]`` to sum over the k
choices (an index write with unique positions: deterministic, no atomics). Backends:

* ``grouped_mm``: ``torch.nn.functional.grouped_mm`` (2-D tokens x 3-D weights with int32 offsets). In
  torch 2.13 it runs on CPU for fp32/bf16/fp16 (not fp64) when every row stride is a multiple of 16 bytes
  (d_in and m multiples of 4 in fp32, of 8 in bf16); on CUDA ``auto`` only picks it for bf16 (the only
  dtype its meta/CUDA checks accept), fewer than 1024 experts, compute capability 8.x or 9.x (on 10.x,
  Blackwell, it has open reports of wrong gradients for experts that receive no tokens, so ``auto`` runs
  ``padded_bmm`` there; see ``auto_dispatch``). An explicit ``dispatch=grouped_mm`` is always honoured.
* ``padded_bmm``: scatter the sorted tokens into ``[E, C, d_in]`` (C = the largest expert load, or the
  capacity), ``bmm``, gather back; any dtype, wasted work on padding.
* ``loop``: ``experts_reference`` (a Python loop over experts; slow, the test oracle).

``capacity_factor`` (None = dropless): each expert keeps at most ``ceil(capacity_factor * N * k / E)``
pairs, the first ones in token order; a dropped pair contributes nothing (the token keeps its other
experts' weighted outputs, weights are not renormalised).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from components.nn.matrix_layout import HasMatrixLayouts, MatrixLayout

DISPATCH_CHOICES = ("auto", "grouped_mm", "padded_bmm", "loop")
_GROUPED_MM_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_GROUPED_MM_MAX_GROUPS = 1024  # the CUDA bf16 kernel needs fewer groups than this
# From this compute capability on (Blackwell, sm_100+), ``auto`` does not pick grouped_mm: see auto_dispatch.
_GROUPED_MM_UNTRUSTED_CAPABILITY = (10, 0)


def capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: Optional[float]) -> Optional[int]:
    """Per-expert slot count, or None when dropless."""
    if capacity_factor is None:
        return None
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``grouped_mm(x [R, K], w [E, K, N])`` (w a transposed view of [E, N, K]) runs as is."""
    if not hasattr(F, "grouped_mm") or x.dtype != w.dtype or x.device != w.device:
        return False
    if x.device.type == "cpu":
        ok_dtype = x.dtype in _GROUPED_MM_CPU_DTYPES
    elif x.device.type == "cuda":
        ok_dtype = x.dtype == torch.bfloat16 and w.shape[0] < _GROUPED_MM_MAX_GROUPS and torch.cuda.get_device_capability(x.device) >= (8, 0)
    else:
        return False
    align = 16 // x.element_size()
    return ok_dtype and x.shape[-1] % align == 0 and w.shape[-1] % align == 0


def auto_dispatch(x: torch.Tensor, w1: torch.Tensor) -> str:
    """The back-end ``dispatch=auto`` runs for tokens ``x [R, d_in]`` and gate weights ``w1 [E, m, d_in]``:
    ``grouped_mm`` where it runs as is and is trusted, else ``padded_bmm``."""
    if not grouped_mm_supported(x, w1.transpose(-2, -1)):
        return "padded_bmm"
    # On the CPU, grouped_mm runs one small product per expert; in bf16 one padded batched product is
    # faster (benchmarks/moe.py, benchmarks/k3_speed.py), and far faster once the layer around it is compiled.
    if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
        return "padded_bmm"
    # torch._grouped_mm / F.grouped_mm has open reports of wrong gradients for experts that receive zero
    # tokens on Blackwell-class GPUs (compute capability 10.x): pytorch/pytorch#172439 and
    # pytorch/pytorch#193633. Routing leaves experts empty routinely, so on those devices ``auto`` takes the
    # padded batched path (exact zeros for empty experts, some wasted work on padding) until the kernel is
    # fixed; ``dispatch=grouped_mm`` still forces the grouped kernel.
    if x.device.type == "cuda" and tuple(torch.cuda.get_device_capability(x.device)) >= _GROUPED_MM_UNTRUSTED_CAPABILITY:
        return "padded_bmm"
    return "grouped_mm"


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient dense (grouped_mm's backward refuses the
    stride-0 gradients that e.g. ``out.sum().backward()`` produces)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


class _GatherRows(torch.autograd.Function):
    """``x[rows]`` where ``rows`` lists every row of x exactly ``repeats`` times (``inverse`` puts the result
    back in row-major repeat order). Backward is a gather plus a sum over the repeats, instead of the
    scatter-add (sorting, serial accumulation) that autograd's indexing backward does on the CPU."""

    @staticmethod
    def forward(ctx, x, rows, inverse, repeats):
        ctx.save_for_backward(inverse)
        ctx.repeats = repeats
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, g):
        (inverse,) = ctx.saved_tensors
        g = g.index_select(0, inverse)  # [N * repeats, d], row-major
        return g.view(-1, ctx.repeats, g.shape[-1]).sum(dim=1), None, None, None


class _PermuteRows(torch.autograd.Function):
    """``x[perm]`` for a permutation ``perm`` with inverse ``inverse``: backward is ``g[inverse]``."""

    @staticmethod
    def forward(ctx, x, perm, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, g):
        (inverse,) = ctx.saved_tensors
        return g.index_select(0, inverse), None, None


def _gmm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``[R, K] x [E, N, K] -> [R, N]``: rows offs[e-1]:offs[e] use w[e]."""
    return _ContiguousGrad.apply(F.grouped_mm(x, w.transpose(-2, -1), offs=offs))


class RoutePlan(NamedTuple):
    """Where each (token, slot) pair goes: computed from the routing alone, without gradients."""

    order: torch.Tensor  # [P] pair indices (token * k + slot) grouped by expert, token order inside
    inverse: Optional[torch.Tensor]  # [N*k] position of each pair in ``order`` (dropless only)
    expert_sorted: torch.Tensor  # [P] expert of each sorted pair
    rank: torch.Tensor  # [P] slot of each sorted pair within its expert
    counts: torch.Tensor  # [E] pairs kept per expert
    offs: torch.Tensor  # [E] int32 end offsets of each expert's rows (grouped_mm)
    cap: Optional[int]  # per-expert slots, or None (dropless)


@torch.compiler.disable
def _route_plan(indices: torch.Tensor, num_experts: int, cap: Optional[int]) -> RoutePlan:
    # An eager island inside a compiled layer: sort and count sizes depend on the routing, and nothing
    # here needs a gradient.
    flat = indices.reshape(-1)  # [N*k], pair p = token * k + slot
    order = torch.argsort(flat, stable=True)  # [N*k]
    expert_sorted = flat[order]  # [N*k]
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    starts = torch.cumsum(counts, 0) - counts  # [E]
    rank = torch.arange(flat.numel(), device=flat.device) - starts[expert_sorted]  # [N*k] slot within expert
    inverse = None
    if cap is not None:
        keep = rank < cap
        order, expert_sorted, rank = order[keep], expert_sorted[keep], rank[keep]
        counts = counts.clamp(max=cap)
    else:
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    offs = torch.cumsum(counts, 0).to(torch.int32)  # [E]
    return RoutePlan(order, inverse, expert_sorted, rank, counts, offs, cap)


@torch.compiler.disable
def _gmm_island(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # eager inside a compiled layer: the group sizes are data, and grouped_mm's shape function on the
    # CPU accepts bf16 only; the activation between the products still compiles. Compiled code may hand
    # over other strides than eager code does, and the CPU kernel's per-group products are only fast on
    # dense rows and dense expert matrices.
    return _gmm(x.contiguous(), w.contiguous(), offs)


@torch.compiler.disable
def _padded_bmm_island(xs, w1, w2, w3, act, plan: RoutePlan) -> torch.Tensor:
    # eager inside a compiled layer: the padded width is the largest expert load, known only from the data
    E = w1.shape[0]
    C = plan.cap if plan.cap is not None else int(plan.counts.max()) if plan.counts.numel() else 0
    slot = plan.expert_sorted * C + plan.rank  # [P] row of each pair in the flattened [E * C] buffer
    # distinct rows: index_copy / index_select (their backwards are a gather and a scatter of distinct
    # rows), not advanced indexing, whose backward is an accumulating index_put
    buf = xs.new_zeros(E * C, xs.shape[-1]).index_copy(0, slot, xs).view(E, C, -1)  # [E, C, d_in]
    h = act(torch.bmm(buf, w1.transpose(1, 2)), torch.bmm(buf, w3.transpose(1, 2)))  # [E, C, m]
    return torch.bmm(h, w2.transpose(1, 2)).flatten(0, 1).index_select(0, slot)  # [P, d_in]


def experts_reference(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    capacity_factor: Optional[float] = None,
) -> torch.Tensor:
    """Loop over experts (K3 ``moe_infer`` style). x [N, d], indices/weights [N, k] -> [N, d]."""
    N, k = indices.shape
    E = w1.shape[0]
    cap = capacity(N, k, E, capacity_factor)
    acc = torch.promote_types(x.dtype, torch.float32)  # fp32 combine (fp64 stays fp64)
    out = torch.zeros(N, x.shape[-1], dtype=acc, device=x.device)
    for e in range(E):
        tok, slot = torch.nonzero(indices == e, as_tuple=True)  # row-major: token order
        if cap is not None:
            tok, slot = tok[:cap], slot[:cap]
        if tok.numel() == 0:
            continue
        xe = x[tok]  # [n_e, d]
        ye = F.linear(act(F.linear(xe, w1[e]), F.linear(xe, w3[e])), w2[e])  # [n_e, d]
        out = out.index_add(0, tok, ye.to(acc) * weights[tok, slot].to(acc)[:, None])
    return out.to(x.dtype)


class RoutedExperts(HasMatrixLayouts):
    """``experts(z [N, d_in], indices [N, k], weights [N, k]) -> [N, d_in]``."""

    def __init__(
        self,
        num_experts: int,
        d_in: int,
        hidden_dim: int,
        act: Any,
        init_std: float = 0.02,
        out_init_std: Optional[float] = None,
        capacity_factor: Optional[float] = None,
        dispatch: str = "auto",
    ):
        super().__init__()
        if dispatch not in DISPATCH_CHOICES:
            raise ValueError(f"dispatch must be one of {DISPATCH_CHOICES}, got {dispatch!r}")
        self.num_experts = num_experts
        self.d_in = d_in
        self.hidden_dim = hidden_dim
        self.act = act
        self.capacity_factor = capacity_factor
        self.dispatch = dispatch
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, d_in))  # gate
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, d_in))  # up
        self.w2 = nn.Parameter(torch.empty(num_experts, d_in, hidden_dim))  # down
        nn.init.normal_(self.w1, std=init_std)
        nn.init.normal_(self.w3, std=init_std)
        nn.init.normal_(self.w2, std=out_init_std or init_std)

    def muon_layouts(self) -> dict[str, MatrixLayout]:
        """Each expert's matrix is orthogonalised on its own."""
        return {n: MatrixLayout(stacked=True) for n in ("w1", "w2", "w3")}

    def expert_params(self) -> int:
        """Weights of one expert."""
        return 3 * self.d_in * self.hidden_dim

    # -- K3 per-expert state dict interop --------------------------------------------------------------
    def per_expert_state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """``{prefix}{i}.w1.weight`` etc. (views of ``w1[i]``): the K3 reference layout."""
        return {f"{prefix}{i}.{n}.weight": getattr(self, n)[i] for i in range(self.num_experts) for n in ("w1", "w2", "w3")}

    @torch.no_grad()
    def load_per_expert_state_dict(self, state: dict[str, torch.Tensor], prefix: str = "") -> None:
        for n in ("w1", "w2", "w3"):
            param = getattr(self, n)
            for i in range(self.num_experts):
                param[i].copy_(state[f"{prefix}{i}.{n}.weight"])

    # -- dispatch --------------------------------------------------------------------------------------
    def _backend(self, z: torch.Tensor, w1: torch.Tensor) -> str:
        if self.dispatch != "auto":
            return self.dispatch  # an explicit choice is honoured, grouped_mm on any device included
        return auto_dispatch(z, w1)

    def forward(self, z: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        dtype = z.dtype
        if torch.is_autocast_enabled(z.device.type):
            dtype = torch.get_autocast_dtype(z.device.type)  # grouped_mm is not autocast-aware
        z = z.to(dtype)
        w1, w2, w3 = (w.to(dtype) for w in (self.w1, self.w2, self.w3))
        backend = self._backend(z, w1)
        if backend == "loop":
            return experts_reference(z, indices, weights, w1, w2, w3, self.act, self.capacity_factor)

        N, k = indices.shape
        plan = _route_plan(indices, self.num_experts, capacity(N, k, self.num_experts, self.capacity_factor))
        if plan.cap is not None:
            xs = z[plan.order // k]  # [P, d_in], P kept pairs
        else:  # dropless: order is a permutation of the N*k pairs
            xs = _GatherRows.apply(z, plan.order // k, plan.inverse, k)  # [N*k, d_in]

        if backend == "grouped_mm":
            h = self.act(_gmm_island(xs, w1, plan.offs), _gmm_island(xs, w3, plan.offs))  # [P, m]
            ys = _gmm_island(h, w2, plan.offs)  # [P, d_in]
        else:
            ys = _padded_bmm_island(xs, w1, w2, w3, self.act, plan)  # [P, d_in]

        # weight in fp32 (router precision; fp64 stays fp64), un-sort to [N, k, d_in], sum the k choices, cast back once
        acc = torch.promote_types(dtype, torch.float32)
        yw = ys.to(acc) * weights.reshape(-1)[plan.order].to(acc)[:, None]  # [P, d_in]
        if plan.cap is not None:
            full = yw.new_zeros(N * k, yw.shape[-1]).index_put((plan.order,), yw)  # [N*k, d_in]; dropped pairs stay 0
        else:
            full = _PermuteRows.apply(yw, plan.inverse, plan.order)  # [N*k, d_in], back in pair order
        return full.view(N, k, -1).sum(dim=1).to(dtype)  # [N, d_in]

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, d_in={self.d_in}, hidden={self.hidden_dim}, "
            f"capacity_factor={self.capacity_factor}, dispatch={self.dispatch}"
        )
