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
  (d_in and m multiples of 4 in fp32, of 8 in bf16). Dropless in bf16 its shapes are fixed (only the
  group offsets are data) and it is traced into a compiled layer; otherwise it runs as an eager island.
  On CUDA ``auto`` only picks it for bf16 (the only
  dtype its meta/CUDA checks accept), fewer than 1024 experts, compute capability 8.x or 9.x (on 10.x,
  Blackwell, it has open reports of wrong gradients for experts that receive no tokens, so ``auto`` runs
  ``padded_bmm`` there; see ``auto_dispatch``). An explicit ``dispatch=grouped_mm`` is always honoured.
* ``blocked``: every expert's rows padded to a multiple of a block (``block_rows``: up to 256 rows) and
  laid out as ``[nb, block, d_in]`` blocks, each block multiplied by its expert's matrices (``bmm`` over
  the blocks, the weights
  gathered per block). ``nb`` has a fixed upper bound, ``ceil(N*k / block) + E``, so every shape is
  static whatever the routing: no host read, nothing data-sized, and the whole expert computation
  (activation included) compiles inside the layer's graph. Padding wastes fewer than ``E * block`` rows
  (at most a quarter of the pairs), however unbalanced the routing, where ``padded_bmm`` pads every
  expert to the largest load. Any dtype.
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

from components.nn.build_context import INIT_STD
from components.nn.eager_island import eager_island
from components.nn.matrix_layout import HasMatrixLayouts, MatrixLayout

DISPATCH_CHOICES = ("auto", "grouped_mm", "blocked", "padded_bmm", "loop")
_MAX_BLOCK_ROWS = (
    256  # rows per block of the ``blocked`` dispatch at most (benchmarks/moe.py: 256 is the fastest on the CPU)
)


def block_rows(pairs: int, num_experts: int) -> int:
    """Rows per block for ``pairs`` routed pairs over ``num_experts``: the largest power of two up to
    ``_MAX_BLOCK_ROWS`` (at least 16) whose padding, under ``num_experts`` blocks, stays within a quarter
    of the pairs. Fixed by the shapes alone, so a compiled layer keeps one shape."""
    fit = max(pairs // (4 * num_experts), 16)
    return min(1 << (fit.bit_length() - 1), _MAX_BLOCK_ROWS)


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
        ok_dtype = (
            x.dtype == torch.bfloat16
            and w.shape[0] < _GROUPED_MM_MAX_GROUPS
            and torch.cuda.get_device_capability(x.device) >= (8, 0)
        )
    else:
        return False
    align = 16 // x.element_size()
    return ok_dtype and x.shape[-1] % align == 0 and w.shape[-1] % align == 0


def auto_dispatch(x: torch.Tensor, w1: torch.Tensor) -> str:
    """The back-end ``dispatch=auto`` runs for tokens ``x [R, d_in]`` and gate weights ``w1 [E, m, d_in]``:
    ``grouped_mm`` where it runs as is and is trusted, else ``blocked``."""
    if not grouped_mm_supported(x, w1.transpose(-2, -1)):
        return "blocked"
    # On the CPU, grouped_mm runs one product per expert, and inside a training step in bf16 its
    # weight-gradient products fall to a slow path (benchmarks/k3_speed.py: k3_small's step 1.4x slower
    # than with padded products); the blocked batched products are the fastest there, eager or compiled.
    if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
        return "blocked"
    # torch._grouped_mm / F.grouped_mm has open reports of wrong gradients for experts that receive zero
    # tokens on Blackwell-class GPUs (compute capability 10.x): pytorch/pytorch#172439 and
    # pytorch/pytorch#193633. Routing leaves experts empty routinely, so on those devices ``auto`` takes the
    # blocked batched path (exact zeros for empty experts, bounded padding) until the kernel is fixed;
    # ``dispatch=grouped_mm`` still forces the grouped kernel.
    if (
        x.device.type == "cuda"
        and tuple(torch.cuda.get_device_capability(x.device)) >= _GROUPED_MM_UNTRUSTED_CAPABILITY
    ):
        return "blocked"
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


def dropless_route_plan(indices: torch.Tensor, num_experts: int) -> RoutePlan:
    """The plan of a dropless routing from fixed-shape tensor ops only (no host read): traced into a
    compiled layer. Nothing here needs a gradient."""
    flat = indices.reshape(-1)  # [N*k], pair p = token * k + slot
    order = torch.argsort(flat, stable=True)  # [N*k]
    expert_sorted = flat[order]  # [N*k]
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )  # [E]
    starts = torch.cumsum(counts, 0) - counts  # [E]
    positions = torch.arange(flat.numel(), device=flat.device)  # [N*k]
    rank = positions - starts[expert_sorted]  # [N*k] slot within expert
    inverse = torch.empty_like(order).scatter_(0, order, positions)  # [N*k]
    offs = torch.cumsum(counts, 0).to(torch.int32)  # [E]
    return RoutePlan(order, inverse, expert_sorted, rank, counts, offs, None)


@eager_island
def _capacity_route_plan(indices: torch.Tensor, num_experts: int, cap: int) -> RoutePlan:
    # An eager island inside a compiled layer: how many pairs each expert keeps depends on the routing.
    flat = indices.reshape(-1)  # [N*k], pair p = token * k + slot
    order = torch.argsort(flat, stable=True)  # [N*k]
    expert_sorted = flat[order]  # [N*k]
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    starts = torch.cumsum(counts, 0) - counts  # [E]
    rank = torch.arange(flat.numel(), device=flat.device) - starts[expert_sorted]  # [N*k] slot within expert
    keep = rank < cap
    order, expert_sorted, rank = order[keep], expert_sorted[keep], rank[keep]
    counts = counts.clamp(max=cap)
    offs = torch.cumsum(counts, 0).to(torch.int32)  # [E]
    return RoutePlan(order, None, expert_sorted, rank, counts, offs, cap)


def _gmm_dense(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # compiled code may hand over other strides than eager code does, and the CPU kernel's per-group
    # products are only fast on dense rows and dense expert matrices
    return _gmm(x.contiguous(), w.contiguous(), offs)


# eager inside a compiled layer, where the rows kept are data-sized (capacity) or grouped_mm's shape
# function refuses the dtype (it accepts bf16 only); the activation between the products still compiles
@eager_island
def _gmm_island(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _gmm_dense(x, w, offs)


@eager_island
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


class BlockPlan(NamedTuple):
    """Where each (token, slot) pair goes in the ``blocked`` layout; every size is fixed by N, k and E."""

    rows: torch.Tensor  # [N*k] row of pair p = token * k + slot in the [nb * block, d] buffer; nb * block if dropped
    block_expert: torch.Tensor  # [nb] expert whose matrices block b is multiplied by


def num_blocks(pairs: int, num_experts: int, block: int, cap: Optional[int] = None) -> int:
    """Upper bound on the blocks any routing of ``pairs`` pairs can fill: each expert's kept rows rounded
    up to a multiple of ``block`` waste fewer than ``block`` rows each."""
    kept = pairs if cap is None else min(pairs, num_experts * cap)
    return -(-(kept + num_experts * (block - 1)) // block)


def block_plan(indices: torch.Tensor, num_experts: int, cap: Optional[int], block: int) -> BlockPlan:
    """The blocked layout of a routing ``indices [N, k]``, from tensor ops of fixed shapes only (traceable,
    no host read). Expert e's rows start at a multiple of ``block``; inside them, its pairs keep token order."""
    flat = indices.reshape(-1)  # [P]
    P, E = flat.numel(), num_experts
    order = torch.argsort(flat, stable=True)  # [P] pairs grouped by expert, token order inside
    counts = torch.zeros(E, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    starts = torch.cumsum(counts, 0) - counts  # [E] first sorted position of each expert
    rank_sorted = torch.arange(P, device=flat.device) - starts[flat[order]]  # [P] slot within its expert
    rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)  # [P] back in pair order
    kept = counts if cap is None else counts.clamp(max=cap)
    padded = (kept + block - 1) // block * block  # [E] rows each expert occupies
    ends = torch.cumsum(padded, 0)  # [E]
    nb = num_blocks(P, E, block, cap)
    rows = (ends - padded)[flat] + rank  # [P]
    if cap is not None:
        rows = torch.where(rank < cap, rows, nb * block)  # a dropped pair goes to the sink row
    first_rows = torch.arange(nb, device=flat.device) * block  # [nb]
    block_expert = torch.searchsorted(ends, first_rows, right=True).clamp(
        max=E - 1
    )  # [nb]; unused blocks: E-1, zero rows
    return BlockPlan(rows, block_expert)


class _ToBlocks(torch.autograd.Function):
    """``pairs [P, d] -> buffer [R + 1, d]`` with pair p at row ``rows[p]`` and zeros elsewhere (rows are
    distinct except the sink row R, whose content is never used). Backward gathers the same rows: no
    accumulating scatter."""

    @staticmethod
    def forward(ctx, pairs, rows, R):
        ctx.save_for_backward(rows)
        return pairs.new_zeros(R + 1, pairs.shape[-1]).index_copy_(0, rows, pairs)

    @staticmethod
    def backward(ctx, g):
        (rows,) = ctx.saved_tensors
        return g.index_select(0, rows), None, None


class _FromBlocks(torch.autograd.Function):
    """``buffer [R + 1, d] -> pairs [P, d]``, ``buffer[rows]``; backward writes the distinct rows back
    (the sink row's gradient is discarded by the caller)."""

    @staticmethod
    def forward(ctx, buf, rows):
        ctx.save_for_backward(rows)
        ctx.R1 = buf.shape[0]
        return buf.index_select(0, rows)

    @staticmethod
    def backward(ctx, g):
        (rows,) = ctx.saved_tensors
        return g.new_zeros(ctx.R1, g.shape[-1]).index_copy_(0, rows, g), None


def blocked_experts(
    z: torch.Tensor,
    plan: BlockPlan,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    k: int,
    block: int,
) -> torch.Tensor:
    """Every pair's expert output ``[N*k, d_in]`` (pair order; zeros for dropped pairs) through the blocked
    layout: one ``bmm`` per matrix over ``[nb, block, .]`` blocks, each with its own expert's weights."""
    N, d = z.shape
    nb = plan.block_expert.numel()
    R = nb * block
    pairs = z.unsqueeze(1).expand(N, k, d).reshape(N * k, d)  # [N*k, d_in]; backward sums the k copies
    buf = _ToBlocks.apply(pairs, plan.rows, R)[:R].view(nb, block, d)  # [nb, block, d_in]
    # each block's expert matrices as a one-hot product: its backward is one dense product summing the
    # blocks of each expert (an index_select's is a scatter-add, slow and serial when compiled for the CPU)
    sel = F.one_hot(plan.block_expert, w1.shape[0]).to(w1.dtype)  # [nb, E]
    g1, g3, g2 = ((sel @ w.flatten(1)).view(nb, *w.shape[1:]) for w in (w1, w3, w2))  # [nb, m, d_in] x2, [nb, d_in, m]
    h = act(torch.bmm(buf, g1.transpose(1, 2)), torch.bmm(buf, g3.transpose(1, 2)))  # [nb, block, m]
    y = torch.bmm(h, g2.transpose(1, 2)).view(R, d)  # [R, d_in]
    return _FromBlocks.apply(torch.cat([y, y.new_zeros(1, d)]), plan.rows)  # [N*k, d_in]; the sink row is 0


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
        init_std: float = INIT_STD,
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
        # set by components/ffn/expert_parallel.py when each rank holds a slice of the experts (not a submodule:
        # parameter names stay those of one process)
        self.expert_parallel: Optional[Callable[..., torch.Tensor]] = None

    def muon_layouts(self) -> dict[str, MatrixLayout]:
        """Each expert's matrix is orthogonalised on its own."""
        return {n: MatrixLayout(stacked=True) for n in ("w1", "w2", "w3")}

    def expert_params(self) -> int:
        """Weights of one expert."""
        return 3 * self.d_in * self.hidden_dim

    # -- K3 per-expert state dict interop --------------------------------------------------------------
    def per_expert_state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """``{prefix}{i}.w1.weight`` etc. (views of ``w1[i]``): the K3 reference layout."""
        return {
            f"{prefix}{i}.{n}.weight": getattr(self, n)[i] for i in range(self.num_experts) for n in ("w1", "w2", "w3")
        }

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

    def compute_dtype(self, z: torch.Tensor) -> torch.dtype:
        """The dtype the expert products run in: autocast's where it is on (grouped_mm is not autocast-aware)."""
        return torch.get_autocast_dtype(z.device.type) if torch.is_autocast_enabled(z.device.type) else z.dtype

    def forward(self, z: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.expert_parallel is not None:  # components/ffn/expert_parallel.py: experts spread over ranks
            return self.expert_parallel(self, z, indices, weights)
        dtype = self.compute_dtype(z)
        return self.dispatch_rows(z.to(dtype), indices, weights, *(w.to(dtype) for w in (self.w1, self.w2, self.w3)))

    def dispatch_rows(
        self,
        z: torch.Tensor,
        indices: torch.Tensor,
        weights: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w3: torch.Tensor,
    ) -> torch.Tensor:
        """``sum_j weights[:, j] * expert_{indices[:, j]}(z)``: ``z [N, d_in]`` (any N, 0 included) through the
        dispatch back-end, with expert matrices ``w1, w3 [E', m, d_in]``, ``w2 [E', d_in, m]`` in ``z``'s dtype
        (E' = the experts these weights hold; ``indices`` index into them)."""
        dtype, d = z.dtype, z.shape[-1]
        backend = self._backend(z, w1)
        if backend == "loop":
            return experts_reference(z, indices, weights, w1, w2, w3, self.act, self.capacity_factor)

        N, k = indices.shape
        E = w1.shape[0]
        cap = capacity(N, k, E, self.capacity_factor)
        acc = torch.promote_types(dtype, torch.float32)
        if backend == "blocked":  # static shapes end to end: traced into the layer's graph when compiled
            block = block_rows(N * k, E)
            plan = block_plan(indices, E, cap, block)
            ys = blocked_experts(z, plan, w1, w2, w3, self.act, k, block)  # [N*k, d_in]
            yw = ys.to(acc) * weights.reshape(-1, 1).to(acc)  # [N*k, d_in]; fp32 weighting as below
            return yw.view(N, k, d).sum(dim=1).to(dtype)  # [N, d_in]

        plan = dropless_route_plan(indices, E) if cap is None else _capacity_route_plan(indices, E, cap)
        if plan.cap is not None:
            xs = z[plan.order // k]  # [P, d_in], P kept pairs
        else:  # dropless: order is a permutation of the N*k pairs
            xs = _GatherRows.apply(z, plan.order // k, plan.inverse, k)  # [N*k, d_in]

        if backend == "grouped_mm":
            # dropless in bf16 every shape is fixed (the group sizes are data, the rows are not): traced
            gmm = _gmm_dense if cap is None and dtype == torch.bfloat16 else _gmm_island
            h = self.act(gmm(xs, w1, plan.offs), gmm(xs, w3, plan.offs))  # [P, m]
            ys = gmm(h, w2, plan.offs)  # [P, d_in]
        else:
            ys = _padded_bmm_island(xs, w1, w2, w3, self.act, plan)  # [P, d_in]

        # weight in fp32 (router precision; fp64 stays fp64), un-sort to [N, k, d_in], sum the k choices, cast back once
        yw = ys.to(acc) * weights.reshape(-1)[plan.order].to(acc)[:, None]  # [P, d_in]
        if plan.cap is not None:
            full = yw.new_zeros(N * k, d).index_put((plan.order,), yw)  # [N*k, d_in]; dropped pairs stay 0
        else:
            full = _PermuteRows.apply(yw, plan.inverse, plan.order)  # [N*k, d_in], back in pair order
        return full.view(N, k, d).sum(dim=1).to(dtype)  # [N, d_in]

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, d_in={self.d_in}, hidden={self.hidden_dim}, "
            f"capacity_factor={self.capacity_factor}, dispatch={self.dispatch}"
        )
