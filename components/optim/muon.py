"""Muon (Moonlight version) with an AdamW fallback in one optimizer, and per-head / per-expert updates.

Muon, for a hidden weight matrix W [A, B] with gradient G (docs/k3.md §8.1):

    M <- mu M + (1 - mu) G                       momentum (EMA form, as torch.optim.Muon)
    U <- (1 - mu) G + mu M  (Nesterov)  or  M
    O <- NS5(U)                                  approximately the orthogonal factor of U
    W <- W (1 - lr wd) - lr 0.2 sqrt(max(A, B)) O

The 0.2 sqrt(max(A, B)) factor ("match_rms_adamw") gives the update the per-entry RMS of a typical AdamW
update, so one learning rate and weight decay serve both halves of the optimizer.

Some parameters hold several independent matrices. A module says so through ``muon_layouts()``, which
maps its parameter names to a :class:`MatrixLayout`:

* attention projections split into head blocks (Per-Head Muon, docs/k3.md §8.2): each head's block is
  orthogonalised on its own, with the scale computed on the block shape, so a head with small gradients
  still gets an O(1) update instead of being starved by the others;
* stacked expert weights ``[E, a, b]`` are E matrices, each orthogonalised on its own.

``torch.optim.Muon`` implements the plain 2-D case; it has no block layouts and no AdamW half, and one
optimizer object keeps a single learning-rate schedule and one checkpointable state. It is the test
oracle for the plain case (tests/optim/test_muon.py).
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from components.nn.matrix_layout import MatrixLayout
from components.ops.bf16_support import native_bf16
from components.optim.base import OptimizerConfig
from components.optim.param_groups import PER_HEAD_SCOPES, adamw_param_groups, muon_partition
from components.registry import OPTIMIZERS, ConfigError

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
NS_DTYPES = ("auto", "bf16", "fp32")


def ns_dtype_for(choice: str, device: torch.device) -> torch.dtype:
    """The dtype Newton-Schulz iterates in: ``bf16`` (the reference implementations' choice), ``fp32``, or
    ``auto``: bf16 where ``device`` multiplies bf16 in hardware, fp32 where bf16 products would be emulated
    (a CPU without AMX or AVX-512 BF16, where they run many times slower than fp32)."""
    if choice == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    return torch.bfloat16 if choice == "bf16" else torch.float32


def newton_schulz(
    update: Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Quintic Newton-Schulz iteration towards the orthogonal factor of each trailing matrix.

    ``update`` is ``[..., A, B]``; leading dims are independent matrices. Runs in ``dtype``, bf16 by default
    (as the reference implementations do): the iteration is self-correcting and its output singular values
    land in roughly [0.7, 1.2] rather than exactly 1, which does not matter for optimisation.
    """
    a, b, c = coefficients
    lead = update.shape[:-2]
    x = update.to(dtype).reshape(-1, *update.shape[-2:])  # [N, A, B]
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the wide orientation: the Gram matrix is the small side
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT  # [N, A, A]
        # fused multiply-adds round once per product, as torch.optim.Muon's addmm does
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    if tall:
        x = x.mT
    return x.reshape(*lead, *x.shape[-2:])


def orthogonalized_update(
    update: Tensor, layout: MatrixLayout, ns_steps: int = 5, dtype: torch.dtype = torch.bfloat16
) -> tuple[Tensor, float]:
    """NS5 of each independent matrix of ``update``, and the RMS-matching scale 0.2 sqrt(max(a, b))."""
    a, b = layout.block_shape(update.shape)
    blocks = newton_schulz(layout.to_blocks(update), ns_steps, dtype=dtype)  # [N, a, b]
    return layout.from_blocks(blocks, update.shape).to(update.dtype), 0.2 * math.sqrt(max(a, b))


def orthogonalized_update_any(
    update: Tensor, layout: MatrixLayout, ns_steps: int = 5, dtype: torch.dtype = torch.bfloat16
) -> tuple[Tensor, float]:
    """``orthogonalized_update`` for a plain tensor or a sharded one (DTensor), gathered on every rank: the
    reference the sharded paths of ``orthogonalized_updates`` are held to (tests/distributed)."""
    full_tensor = getattr(update, "full_tensor", None)
    if full_tensor is None:
        return orthogonalized_update(update, layout, ns_steps, dtype)
    from torch.distributed.tensor import distribute_tensor  # start-up time: DTensor, only sharded runs

    ortho, scale = orthogonalized_update(full_tensor(), layout, ns_steps, dtype)
    return distribute_tensor(ortho, update.device_mesh, update.placements, src_data_rank=None), scale


def _is_dtensor(t: Tensor) -> bool:
    return getattr(t, "full_tensor", None) is not None


def holds_whole_matrices(update: Tensor, layout: MatrixLayout) -> bool:
    """Whether each rank's shard of a stacked ``[E, a, b]`` update is a set of whole matrices: every mesh
    dimension either copies it or splits the stacking dimension 0 (FSDP's ``Shard(0)``, expert parallelism's
    ``Shard(0)``, and the strided ``Shard(0)`` FSDP puts over it). Newton-Schulz treats each matrix on its
    own, so such a shard is orthogonalised where it lies, with no communication."""
    if not layout.stacked:
        return False
    return all(p.is_replicate() or (not p.is_partial() and getattr(p, "dim", None) == 0) for p in update.placements)


def _row_split(update: Tensor) -> Optional[tuple[Any, int, int]]:
    """(process group, size, rows per rank) when ``update`` is split along its dimension 0 over a 1-D mesh in
    ``torch.chunk`` pieces (FSDP2's layout of every non-expert weight), else None."""
    from torch.distributed.tensor import Shard  # start-up time: DTensor, only sharded runs

    if update.device_mesh.ndim != 1 or len(update.placements) != 1 or update.placements[0] != Shard(0):
        return None
    size = update.device_mesh.size()
    return update.device_mesh.get_group(), size, -(-update.shape[0] // size)


def _owner_updates(
    items: list[tuple[int, Tensor, MatrixLayout]], ns_steps: int, ns_dtype: str
) -> dict[int, tuple[Tensor, float]]:
    """Orthogonalise each row-split update once, on an owner rank (round-robin over the updates of each
    group), and hand every rank its rows of the result: per update one gather to the owner and one scatter
    from it, instead of an all-gather and a Newton-Schulz on every rank. Per-head layouts apply to the
    whole matrix on the owner, as on one process."""
    from torch.distributed.tensor import DTensor  # start-up time: DTensor, only sharded runs

    plans = []  # (item, update, layout, group, size, rows per rank, owner's rank in the group)
    seen: dict[Any, int] = {}  # updates per group so far: the round-robin counter
    full: list[tuple[int, Tensor, MatrixLayout]] = []  # the whole updates this rank owns
    for i, update, layout in items:
        group, size, chunk = _row_split(update)
        owner = seen.get(group, 0) % size
        seen[group] = seen.get(group, 0) + 1
        local = update.to_local()
        padded = local.new_zeros(chunk, *local.shape[1:])  # [chunk, ...]: gloo gathers equal sizes
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(size)] if dist.get_rank(group) == owner else None
        dist.gather(padded, parts, dst=dist.get_global_rank(group, owner), group=group)
        if parts is not None:
            full.append((i, torch.cat(parts)[: update.shape[0]], layout))
        plans.append((i, update, layout, group, size, chunk, owner))
    done = _local_updates([(u, lay) for _, u, lay in full], ns_steps, ns_dtype)
    ortho_of = {i: ortho for (i, _, _), (ortho, _) in zip(full, done)}
    out: dict[int, tuple[Tensor, float]] = {}
    for i, update, layout, group, size, chunk, owner in plans:
        rows = update.to_local()
        mine = rows.new_empty(chunk, *update.shape[1:])  # [chunk, ...]
        pieces = None
        if i in ortho_of:
            padded = rows.new_zeros(chunk * size, *update.shape[1:])
            padded[: update.shape[0]] = ortho_of[i]
            pieces = list(padded.split(chunk))
        dist.scatter(mine, pieces, src=dist.get_global_rank(group, owner), group=group)
        ortho = DTensor.from_local(
            mine[: rows.shape[0]],
            update.device_mesh,
            update.placements,
            run_check=False,
            shape=update.shape,
            stride=update.stride(),
        )
        a, b = layout.block_shape(update.shape)
        out[i] = (ortho, 0.2 * math.sqrt(max(a, b)))
    return out


def _local_updates(
    items: list[tuple[Tensor, MatrixLayout]], ns_steps: int, ns_dtype: str
) -> list[tuple[Tensor, float]]:
    """``orthogonalized_update`` of plain tensors, blocks of one shape batched into one Newton-Schulz."""
    results: list[Optional[tuple[Tensor, float]]] = [None] * len(items)
    groups: dict[tuple, list[tuple[int, Tensor]]] = {}
    for i, (update, layout) in enumerate(items):
        blocks = layout.to_blocks(update)  # [n_i, a, b]
        groups.setdefault((update.device, *blocks.shape[-2:]), []).append((i, blocks))
    for (device, a, b), members in groups.items():
        stacked = torch.cat([blocks for _, blocks in members])  # [sum n_i, a, b]
        ortho = newton_schulz(stacked, ns_steps, dtype=ns_dtype_for(ns_dtype, device))
        for (i, blocks), part in zip(members, ortho.split([blocks.shape[0] for _, blocks in members])):
            update, layout = items[i]
            results[i] = (layout.from_blocks(part, update.shape).to(update.dtype), 0.2 * math.sqrt(max(a, b)))
    return results  # type: ignore[return-value]


def orthogonalized_updates(
    items: list[tuple[Tensor, MatrixLayout]], ns_steps: int = 5, ns_dtype: str = "bf16"
) -> list[tuple[Tensor, float]]:
    """``orthogonalized_update_any`` of many parameters at once, in order (a collective where updates are
    sharded: every rank calls it with the same parameters in the same order).

    Blocks of the same shape (the heads of every attention projection, the experts of every MoE layer)
    share one batched Newton-Schulz: the iteration treats each matrix on its own, so the result is the
    per-parameter one, in a few large products instead of hundreds of small ones. Sharded (DTensor) updates:

    * stacked expert weights whose shards hold whole experts (``holds_whole_matrices``) are orthogonalised
      where they lie, batched with the plain ones: no communication;
    * a weight split by rows over a 1-D mesh (FSDP2's layout) is orthogonalised once, by its owner rank
      (``_owner_updates``), and its rows scattered back: each rank runs 1 / world of those Newton-Schulz;
    * anything else is gathered and orthogonalised on every rank (``orthogonalized_update_any``).
    """
    from torch.distributed.tensor import DTensor  # start-up time: DTensor, only sharded runs

    results: list[Optional[tuple[Tensor, float]]] = [None] * len(items)
    local: list[tuple[int, Tensor, MatrixLayout, Optional[Tensor]]] = []  # (item, tensor, layout, DTensor it came from)
    owned: list[tuple[int, Tensor, MatrixLayout]] = []
    for i, (update, layout) in enumerate(items):
        if not _is_dtensor(update):
            local.append((i, update, layout, None))
        elif holds_whole_matrices(update, layout):
            local.append((i, update.to_local(), layout, update))
        elif _row_split(update) is not None:
            owned.append((i, update, layout))
        else:
            results[i] = orthogonalized_update_any(update, layout, ns_steps, ns_dtype_for(ns_dtype, update.device))
    for (i, _, layout, sharded), (ortho, scale) in zip(
        local, _local_updates([(t, lay) for _, t, lay, _ in local], ns_steps, ns_dtype)
    ):
        if sharded is not None:  # the scale is the block's, the same for every shard
            ortho = DTensor.from_local(
                ortho,
                sharded.device_mesh,
                sharded.placements,
                run_check=False,
                shape=sharded.shape,
                stride=sharded.stride(),
            )
        results[i] = (ortho, scale)
    for i, r in _owner_updates(owned, ns_steps, ns_dtype).items():
        results[i] = r
    return results  # type: ignore[return-value]


class Muon(torch.optim.Optimizer):
    """Muon for the groups marked ``use_muon=True``, AdamW for the rest; one ``lr`` schedule for both.

    Each Muon group carries ``layouts``: one ``(heads, axis, stacked)`` tuple per parameter, in order
    (plain tuples, so the optimizer state loads with ``torch.load(weights_only=True)``).
    """

    def __init__(
        self,
        param_groups: Iterable[dict],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        ns_dtype: str = "auto",
    ):
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_dtype=ns_dtype,
            betas=tuple(betas),
            eps=eps,
            use_muon=False,
        )
        super().__init__(list(param_groups), defaults)
        for group in self.param_groups:
            if group["use_muon"]:
                layouts = group.setdefault("layouts", [(1, 0, False)] * len(group["params"]))
                if len(layouts) != len(group["params"]):
                    raise ValueError("a Muon group needs one layout per parameter")
                group["layouts"] = [astuple(t) if isinstance(t, MatrixLayout) else tuple(t) for t in layouts]
                for i, (p, layout) in enumerate(zip(group["params"], group["layouts"])):
                    MatrixLayout(*layout).check(f"param {i}", p.shape)

    def __setstate__(self, state: dict) -> None:
        # load_state_dict lands here with the saved groups: those of checkpoints from before ns_dtype get
        # its default (torch's own optimizers fill options added later the same way)
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("ns_dtype", "auto")

    @torch.no_grad()
    def step(self, closure=None) -> Optional[Tensor]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group(group)
            else:
                self._adamw_group(group)
        return loss

    def _muon_group(self, group: dict) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        params, updates = [], []
        for p, layout in zip(group["params"], group["layouts"]):
            if p.grad is None:
                continue
            g = p.grad
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(g)
            buf = state["momentum_buffer"]
            buf.lerp_(g, 1 - mu)
            params.append(p)
            updates.append((g.lerp(buf, mu) if group["nesterov"] else buf, MatrixLayout(*layout)))
        for p, (ortho, scale) in zip(params, orthogonalized_updates(updates, group["ns_steps"], group["ns_dtype"])):
            p.mul_(1 - lr * wd)  # decoupled decay uses the unscaled lr (Moonlight, torch)
            p.add_(ortho, alpha=-lr * scale)

    def _adamw_group(self, group: dict) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            t = float(state["step"])
            m, v = state["exp_avg"], state["exp_avg_sq"]
            p.mul_(1 - lr * wd)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
            p.addcdiv_(m, denom, value=-lr / (1 - beta1**t))


@dataclass
class MuonConfig(OptimizerConfig):
    name: str = "muon"
    # tuned for the default run (a 2.4M-token budget of 256-byte rows): 6e-3 learned faster than 9e-3 and
    # 1.2e-2, and 2x the previous 3e-3 default; a 30-step warmup keeps most of the short run at the peak rate
    lr: float = 6e-3
    warmup_steps: int = 30
    momentum: float = 0.95
    nesterov: bool = True
    # Newton-Schulz iterations per update
    ns_steps: int = 5
    # the dtype they run in: bf16 (the reference implementations'), fp32, or auto: bf16 where the device
    # multiplies bf16 in hardware (GPUs, CPUs with AMX or AVX-512 BF16), fp32 where bf16 would be emulated
    ns_dtype: str = "auto"
    # orthogonalise each attention head's block of the head-indexed projections separately (K3's
    # Per-Head Muon, docs/k3.md §8.2); False: every matrix whole
    per_head: bool = False
    # which projections per_head splits: qkv (the K3 report's scope: query, key and value projections --
    # MLA q_b_proj / kv_b_proj, KDA and attention q/k/v_proj) or all (also output projections and gates)
    per_head_scope: str = "qkv"

    def validate(self, model: Any, key: str) -> None:
        super().validate(model, key)
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"{key}.momentum", f"must be in [0, 1), got {self.momentum}")
        if not 1 <= self.ns_steps < 100:
            raise ConfigError(f"{key}.ns_steps", f"must be in [1, 99], got {self.ns_steps}")
        if self.ns_dtype not in NS_DTYPES:
            raise ConfigError(
                f"{key}.ns_dtype", f"'{self.ns_dtype}' is not allowed; choose one of {', '.join(NS_DTYPES)}"
            )
        if self.per_head_scope not in PER_HEAD_SCOPES:
            raise ConfigError(
                f"{key}.per_head_scope",
                f"'{self.per_head_scope}' is not allowed; choose one of {', '.join(PER_HEAD_SCOPES)}",
            )


@OPTIMIZERS.register(
    "muon",
    MuonConfig,
    "Muon (Moonlight, RMS-matched to AdamW) on hidden matrices, per head optionally; AdamW on the rest.",
)
def build_muon(cfg: MuonConfig, model: nn.Module) -> Muon:
    muon, adamw = muon_partition(model, cfg.per_head, cfg.per_head_scope)
    groups = adamw_param_groups(model, adamw, cfg.weight_decay)
    if muon:
        groups.insert(
            0,
            {
                "params": [p for _, p, _ in muon],
                "layouts": [layout for _, _, layout in muon],
                "use_muon": True,
                "weight_decay": cfg.weight_decay,
            },
        )
    return Muon(
        groups,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        momentum=cfg.momentum,
        nesterov=cfg.nesterov,
        ns_steps=cfg.ns_steps,
        ns_dtype=cfg.ns_dtype,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
    )
