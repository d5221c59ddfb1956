"""Per-GPU memory of a training run on a device mesh, counted from the meta-device model.

One accounting for the pre-flight check (``runtime/memory_check.py``) and the parallelism planner
(``analysis/parallel_plan.py``). The mesh is the one ``trainer=fsdp2`` builds: ``gpus`` data-parallel
ranks, with ``trainer.expert_parallel=ep`` unflattened into ``(efsdp, ep)``. Every routed expert weight
``[E, out, in]`` is split over ``ep`` (``E / ep`` whole experts per rank) and FSDP-sharded over ``efsdp``;
every other parameter is FSDP-sharded over all ``gpus`` ranks; each decoder layer, the embedding, the head
and each MTP depth is its own FSDP unit (what is left -- final norm, residual-scheme weights -- is the
root's). FSDP2 shards dimension 0 and pads it to a multiple of the group, so a rank holds
``ceil(rows / group)`` rows.

Exact (from the parameters' shapes): the sharded weights (fp32), gradients (fp32) and optimizer state --
AdamW two fp32 moments per number; Muon one fp32 momentum on the matrices it orthogonalises
(``components/optim/param_groups.py::muon_partition``) and AdamW's two on the rest -- and the size of
every FSDP unit.

Estimated (stated rules, not measurements of this model):

* gathered units: forward holds a unit and the prefetched next one in the compute dtype; backward holds a
  unit, its unsharded gradients and the prefetched previous unit, so the peak is
  ``max_i(2 P_i + P_(i-1))``; the root's parameters stay gathered throughout. A layer and its routed
  experts count as one unit (under expert parallelism the experts are a unit of their own, nested in the
  layer's and gathered over ``efsdp`` while the layer runs: the same peak, or less);
* activations: per token and layer, ``ACTIVATION_FACTOR`` x the inputs and outputs of every matrix product
  (``top_k`` rows for routed experts), in the compute dtype. The products' inputs and outputs alone are
  0.97-1.09x what the torch reference paths of K3's layer kinds save for backward on the CPU (weights left
  out); with the factor the estimate is 1.2-1.4x (``tests/analysis/test_parallel_plan.py`` holds it within
  1-1.5x). Fused GPU kernels save less than the reference paths. With activation checkpointing
  each decoder layer keeps its input (d numbers per token; the residual scheme's sources -- block AttnRes's
  block summaries -- once) and one layer is recomputed at a time (MTP depths are not checkpointed). The
  head keeps fp32 log-probabilities ``[tokens, vocab]`` for its loss and each MTP depth its own, and one
  head's backward holds their gradient in fp32 and in the compute dtype; KDA's backward rebuilds its
  chunk states ``[T / 64, H, K, V]`` in fp32;
* communication: the all-to-all of one MoE layer (send ``tokens x top_k`` rows in the routed width, receive
  ``RECEIVE_SKEW`` times that for imbalanced routing) and the reduce-scatter input of the largest unit
  (its gradient in fp32);
* optimizer step (after backward, activations freed): Muon gathers each sharded non-expert matrix whole
  on one owner rank (round-robin), which holds every matrix it owns and its orthogonalised result in fp32
  -- at least the largest matrix, on average ``1 / gpus`` of them -- and iterates on one at a time with
  ``NS_COPIES`` copies in the Newton-Schulz dtype; local experts iterate in place; AdamW's foreach update
  needs one fp32 temporary of its local shard;
* runtime reserve: ``RESERVE_FIXED`` (CUDA context, NCCL and cuBLAS workspaces) plus ``RESERVE_FRACTION``
  of the GPU (caching-allocator fragmentation).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Optional

from torch import nn

from components.model import build_on_meta
from components.optim.param_groups import muon_partition, unique_trainable

GiB = 2**30
FP32 = 4

ACTIVATION_FACTOR = 1.25  # a margin over the matrix-product rule (module docstring)
RECEIVE_SKEW = 1.5
KDA_CHUNK = 64  # tokens per chunk of the chunked KDA kernels
NS_COPIES = 3  # Newton-Schulz: the iterate, its Gram matrix product and the next iterate
RESERVE_FIXED = 3 * GiB
RESERVE_FRACTION = 0.05


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int  # as torch.cuda.get_device_properties reports it


# the capacity PyTorch reports (its out-of-memory messages' "total capacity") for the 80 GB and 141 GB parts
GPUS = {
    "h100": GPU("H100 80GB", int(79.11 * GiB)),
    "h200": GPU("H200 141GB", int(139.81 * GiB)),
}


@dataclass(frozen=True)
class ParamShape:
    """``count`` parameters of one shape, placement and optimizer state."""

    rows: int  # dimension 0, the one FSDP2 shards (the expert dimension of routed experts)
    row_numbers: int  # numbers per row
    count: int
    expert: bool
    state_buffers: int  # fp32 optimizer buffers per number

    @property
    def numbers(self) -> int:
        return self.count * self.rows * self.row_numbers


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: ``dense`` numbers gathered whole, ``experts`` numbers of routed experts (all E)."""

    name: str
    dense: int
    experts: int

    def gathered(self, ep: int) -> int:
        return self.dense + self.experts // ep


@dataclass(frozen=True)
class LayerActivations:
    name: str
    numbers_per_token: int  # saved for backward without checkpointing, all sublayers (estimate)
    recurrent_state: int  # a KDA-style state per sequence (chunk states rebuilt in backward), 0 if none
    checkpointed: bool  # recomputed in backward under trainer.activation_checkpointing (decoder layers)


@dataclass(frozen=True)
class Inventory:
    """What the accounting needs of one model and optimizer, counted once from the meta-device build."""

    total_params: int
    expert_params: int
    muon_params: int  # matrices the optimizer orthogonalises (0 for AdamW)
    adamw_params: int
    optimizer: str
    shapes: tuple[ParamShape, ...]
    units: tuple[Unit, ...]  # in forward order: embedding, layers, head, MTP depths
    root: int  # numbers outside every unit (gathered for the whole step)
    layers: tuple[LayerActivations, ...]
    d_model: int
    vocab_size: int
    heads: int  # the head's loss plus one per MTP depth
    num_experts: int  # of the largest MoE layer (0: no routed experts)
    experts_divisor: int  # the greatest common divisor of the MoE layers' expert counts: what ep must divide
    top_k: int
    routed_width: int  # the width (token, slot) rows travel in: the latent width for LatentMoE
    moe_layers: int
    residual_sources: int  # [tokens, d] tensors the residual scheme keeps across layers (1: the plain stream)
    largest_muon_matrix: int  # numbers of the largest non-expert matrix Muon orthogonalises
    nonexpert_muon_params: int  # numbers of all the non-expert matrices Muon orthogonalises
    expert_matrix: int  # numbers of one expert's largest matrix

    def expert_parallel_sizes(self) -> list[int]:
        """Every ep that divides the expert count (1 only without routed experts)."""
        n = self.experts_divisor
        return [e for e in range(1, n + 1) if n % e == 0] if n else [1]


def _unit_of(name: str) -> str:
    parts = name.split(".")
    if parts[0] in ("layers", "mtp"):
        return f"{parts[0]}.{parts[1]}"
    return {"embed": "embed", "lm_head": "lm_head"}.get(parts[0], "root")


def _matmul_numbers(module: nn.Module, top_k: int, expert_ids: set[int]) -> int:
    """Inputs plus outputs of every matrix product of ``module`` per token (``top_k`` rows for experts)."""
    n = 0
    for p in module.parameters():
        if p.ndim < 2:
            continue
        if id(p) in expert_ids:  # [E, out, in]
            n += top_k * (p.shape[1] + math.prod(p.shape[2:]))
        else:  # [out, in...]
            n += p.shape[0] + math.prod(p.shape[1:])
    return n


def inventory(model: nn.Module, optimizer_cfg: Any) -> Inventory:
    """Count ``model`` (a Decoder, on the meta device) for the optimizer ``optimizer_cfg`` builds."""
    params = unique_trainable(model)
    blocks = [*model.layers, *model.mtp]
    expert_ids: set[int] = set()
    num_experts, top_k, width, moe_layers, expert_matrix = set(), 0, 0, 0, 0
    for block in blocks:
        experts = block.ffn.routed_experts()
        if experts is None:
            continue
        moe_layers += 1
        expert_ids.update(id(p) for p in experts.parameters())
        num_experts.add(experts.num_experts)
        per_expert = experts.expert_params()
        top_k = max(top_k, experts.num_experts - block.ffn.unchosen_expert_params() // per_expert)
        width = max(width, experts.d_in)
        expert_matrix = max(expert_matrix, *(p[0].numel() for p in experts.parameters()))
    muon_ids: set[int] = set()
    if getattr(optimizer_cfg, "name", "adamw") == "muon":
        muon, _ = muon_partition(model, optimizer_cfg.per_head, optimizer_cfg.per_head_scope)
        muon_ids = {id(p) for _, p, _ in muon}
    groups: dict[tuple[int, int, bool, int], int] = {}
    units: dict[str, list[int]] = {}
    root = 0
    muon_n = largest_muon = nonexpert_muon = 0
    for name, p in params:
        rows = p.shape[0] if p.ndim else 1
        key = (rows, p.numel() // max(rows, 1), id(p) in expert_ids, 1 if id(p) in muon_ids else 2)
        groups[key] = groups.get(key, 0) + 1
        if id(p) in muon_ids:
            muon_n += p.numel()
            if id(p) not in expert_ids:
                largest_muon = max(largest_muon, p.numel())
                nonexpert_muon += p.numel()
        unit = _unit_of(name)
        if unit == "root":
            root += p.numel()
            continue
        dense_experts = units.setdefault(unit, [0, 0])
        dense_experts[1 if id(p) in expert_ids else 0] += p.numel()
    order = ["embed", *(f"layers.{i}" for i in range(len(model.layers))), "lm_head"]
    order += [f"mtp.{k}" for k in range(len(model.mtp))]
    layers = []
    for prefix, block, checkpointed in [
        *((f"layers.{i}", b, True) for i, b in enumerate(model.layers)),
        *((f"mtp.{k}", b, False) for k, b in enumerate(model.mtp)),
    ]:
        k = top_k if block.ffn.routed_experts() is not None else 0
        numbers = round(ACTIVATION_FACTOR * _matmul_numbers(block, k, expert_ids))
        layers.append(LayerActivations(prefix, numbers, block.mixer.recurrent_state_numbers(), checkpointed))
    total = sum(p.numel() for _, p in params)
    experts_total = sum(p.numel() for _, p in params if id(p) in expert_ids)
    return Inventory(
        total_params=total,
        expert_params=experts_total,
        muon_params=muon_n,
        adamw_params=total - muon_n,
        optimizer=getattr(optimizer_cfg, "name", "adamw"),
        shapes=tuple(ParamShape(r, n, c, e, b) for (r, n, e, b), c in sorted(groups.items())),
        units=tuple(Unit(u, *units[u]) for u in order if u in units),
        root=root,
        layers=tuple(layers),
        d_model=model.d_model,
        vocab_size=model.vocab_size,
        heads=1 + len(model.mtp),
        num_experts=max(num_experts, default=0),
        experts_divisor=math.gcd(*num_experts) if num_experts else 0,
        top_k=top_k,
        routed_width=width,
        moe_layers=moe_layers,
        residual_sources=max((n for _, n in model.residual.sources_per_read() or ()), default=1),
        largest_muon_matrix=largest_muon,
        nonexpert_muon_params=nonexpert_muon,
        expert_matrix=expert_matrix,
    )


def inventory_for(root: Any) -> Inventory:
    """The inventory of a validated run config's model and optimizer."""
    return inventory(build_on_meta(root.decoder_config()), root.optimizer)


@dataclass(frozen=True)
class Mesh:
    gpus: int
    ep: int = 1
    activation_checkpointing: bool = False
    micro_batch: int = 1  # sequences per rank per micro-step
    seq_len: int = 4096

    @property
    def efsdp(self) -> int:
        return self.gpus // self.ep

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len

    def check(self, inv: Inventory) -> None:
        if self.gpus < 1 or self.ep < 1 or self.gpus % self.ep:
            raise ValueError(f"ep {self.ep} must divide the {self.gpus} GPUs")
        if self.ep > 1 and inv.experts_divisor % self.ep:
            raise ValueError(f"ep {self.ep} must divide every MoE layer's experts ({inv.experts_divisor} divides them)")


def compute_bytes(precision: str) -> int:
    """Bytes per number of gathered parameters and activations: bf16 under bf16 precisions (FSDP2's
    mixed-precision policy gathers bf16), else fp32."""
    return 2 if "bf16" in str(precision) else FP32


def sharded_numbers(inv: Inventory, gpus: int, ep: int = 1) -> dict[str, int]:
    """Numbers one rank holds (the fullest rank: FSDP2 pads dimension 0 to the group), and fp32 optimizer
    buffers' numbers: ``params``, ``expert_params``, ``optimizer``."""
    efsdp = gpus // ep
    params = experts = state = 0
    for s in inv.shapes:
        if s.expert:
            local = s.count * math.ceil(math.ceil(s.rows / ep) / efsdp) * s.row_numbers
            experts += local
        else:
            local = s.count * math.ceil(s.rows / gpus) * s.row_numbers
        params += local
        state += local * s.state_buffers
    return {"params": params, "expert_params": experts, "optimizer": state}


def gathered_peak(inv: Inventory, ep: int) -> dict[str, Any]:
    """The largest unit gathered, and the FSDP peak in numbers: forward ``P_i + P_(i+1)``, backward
    ``2 P_i + P_(i-1)`` (parameters, their unsharded gradients, the prefetched unit), plus the root."""
    sizes = [u.gathered(ep) for u in inv.units]
    largest = max(range(len(sizes)), key=sizes.__getitem__) if sizes else None
    forward = max((sizes[i] + (sizes[i + 1] if i + 1 < len(sizes) else 0) for i in range(len(sizes))), default=0)
    backward = max((2 * sizes[i] + (sizes[i - 1] if i else 0) for i in range(len(sizes))), default=0)
    return {
        "largest_unit": inv.units[largest].name if largest is not None else None,
        "largest_unit_numbers": sizes[largest] if largest is not None else 0,
        "peak_numbers": max(forward, backward) + inv.root,
    }


def activation_bytes(inv: Inventory, mesh: Mesh, act_bytes: int) -> int:
    """Activation memory of one micro-batch on one rank (the estimate in the module docstring)."""
    t = mesh.tokens
    kept = sum(
        inv.d_model if mesh.activation_checkpointing and layer.checkpointed else layer.numbers_per_token
        for layer in inv.layers
    )
    recomputed = max((la.numbers_per_token for la in inv.layers if la.checkpointed), default=0)
    working = recomputed if mesh.activation_checkpointing else 0
    chunk_states = max((la.recurrent_state for la in inv.layers), default=0) * math.ceil(mesh.seq_len / KDA_CHUNK)
    logits = inv.heads * inv.vocab_size * FP32 * t  # fp32 log-probabilities each head's loss keeps
    logits_backward = inv.vocab_size * (FP32 + act_bytes) * t  # one head's gradient, fp32 and cast
    stream = (inv.residual_sources + 1) * inv.d_model  # the residual scheme's sources, the embedding output
    chunk_bytes = chunk_states * mesh.micro_batch * FP32
    return (kept + working + stream) * t * act_bytes + logits + logits_backward + chunk_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU of one mesh (the fullest rank)."""

    gpus: int
    ep: int
    efsdp: int
    activation_checkpointing: bool
    micro_batch: int
    seq_len: int
    experts_gathered: int  # whole experts of each MoE layer an ep rank runs (E / ep)
    experts_stored: int  # whole experts of each MoE layer one rank stores (E / ep sharded over efsdp, padded)
    params_per_rank: int  # numbers
    expert_params_per_rank: int
    largest_unit: Optional[str]
    largest_unit_params: int
    weights: int
    gradients: int
    optimizer_state: int
    gathered_units: int
    activations: int
    all_to_all: int
    reduce_scatter: int
    optimizer_step: int
    reserve: int
    total: int
    capacity: int

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fits": self.fits}


def plan(inv: Inventory, mesh: Mesh, capacity: int, precision: str = "bf16-mixed", ns_bytes: int = 2) -> MemoryPlan:
    """Per-GPU memory of training ``inv``'s model on ``mesh`` with GPUs of ``capacity`` bytes."""
    mesh.check(inv)
    b = compute_bytes(precision)
    shard = sharded_numbers(inv, mesh.gpus, mesh.ep)
    gather = gathered_peak(inv, mesh.ep)
    state = (shard["params"] * 2 + shard["optimizer"]) * FP32
    a2a = 0
    if mesh.ep > 1 and inv.moe_layers:
        a2a = round(mesh.tokens * inv.top_k * inv.routed_width * b * (1 + RECEIVE_SKEW))
    reduce_scatter = gather["largest_unit_numbers"] * FP32
    training = gather["peak_numbers"] * b + activation_bytes(inv, mesh, b) + a2a + reduce_scatter
    # an owner holds its gathered matrices and their results in fp32 (one process: nothing gathered)
    owned = max(inv.largest_muon_matrix, math.ceil(inv.nonexpert_muon_params / mesh.gpus)) if mesh.gpus > 1 else 0
    owner = owned * 2 * FP32 + inv.largest_muon_matrix * NS_COPIES * ns_bytes
    experts_local = math.ceil(math.ceil(inv.num_experts / mesh.ep) / mesh.efsdp) if inv.num_experts else 0
    local_experts = experts_local * inv.expert_matrix * NS_COPIES * ns_bytes
    adamw_local = (shard["optimizer"] - shard["params"]) * FP32  # numbers with two buffers: one temporary each
    step = max(owner, local_experts, adamw_local) if inv.muon_params else shard["params"] * FP32
    reserve = RESERVE_FIXED + round(RESERVE_FRACTION * capacity)
    return MemoryPlan(
        gpus=mesh.gpus,
        ep=mesh.ep,
        efsdp=mesh.efsdp,
        activation_checkpointing=mesh.activation_checkpointing,
        micro_batch=mesh.micro_batch,
        seq_len=mesh.seq_len,
        experts_gathered=inv.num_experts // mesh.ep if inv.num_experts else 0,
        experts_stored=experts_local,
        params_per_rank=shard["params"],
        expert_params_per_rank=shard["expert_params"],
        largest_unit=gather["largest_unit"],
        largest_unit_params=gather["largest_unit_numbers"],
        weights=shard["params"] * FP32,
        gradients=shard["params"] * FP32,
        optimizer_state=shard["optimizer"] * FP32,
        gathered_units=gather["peak_numbers"] * b,
        activations=activation_bytes(inv, mesh, b),
        all_to_all=a2a,
        reduce_scatter=reduce_scatter,
        optimizer_step=step,
        reserve=reserve,
        total=state + max(training, step) + reserve,
        capacity=capacity,
    )


def floor_bytes(inv: Inventory, gpus: int = 1, ep: int = 1, precision: str = "32-true") -> dict[str, int]:
    """What no run on this mesh can do without, per GPU: the sharded weights, gradients and optimizer
    state, and (sharded, ``gpus`` > 1) the largest unit gathered in the compute dtype."""
    shard = sharded_numbers(inv, gpus, ep)
    state = (shard["params"] * 2 + shard["optimizer"]) * FP32
    unit = gathered_peak(inv, ep)["largest_unit_numbers"] * compute_bytes(precision) if gpus > 1 else 0
    return {"state": state, "largest_unit": unit, "total": state + unit}


def candidate_gpu_counts(gpus_per_node: int, max_gpus: int) -> list[int]:
    """Meshes a cluster offers: powers of two within one node, then whole nodes."""
    counts = [g for g in (2**i for i in range(gpus_per_node.bit_length())) if g < gpus_per_node]
    counts += list(range(gpus_per_node, max_gpus + 1, gpus_per_node))
    return counts


def smallest_fit(
    inv: Inventory,
    capacity: int,
    seq_len: int,
    micro_batch: int = 1,
    precision: str = "bf16-mixed",
    gpus_per_node: int = 8,
    max_gpus: int = 16384,
    checkpointing: Iterable[bool] = (False, True),
) -> Optional[MemoryPlan]:
    """The plan with the fewest GPUs that fits (ties broken by ``preference``), or None. Memory per GPU never
    grows with the GPU count at a fixed ep and checkpointing (shards only shrink; units, activations and
    buffers do not depend on it), so each (ep, checkpointing) pair is a binary search over the candidate
    counts that ep divides."""
    best: Optional[MemoryPlan] = None
    counts = candidate_gpu_counts(gpus_per_node, max_gpus)
    for ac in checkpointing:
        for ep in inv.expert_parallel_sizes():
            options = [g for g in counts if g % ep == 0]
            lo, hi = 0, len(options)
            while lo < hi:
                mid = (lo + hi) // 2
                if plan(inv, Mesh(options[mid], ep, ac, micro_batch, seq_len), capacity, precision).fits:
                    hi = mid
                else:
                    lo = mid + 1
            if lo == len(options):
                continue
            found = plan(inv, Mesh(options[lo], ep, ac, micro_batch, seq_len), capacity, precision)
            if best is None or preference(found, gpus_per_node) < preference(best, gpus_per_node):
                best = found
    return best


def preference(p: MemoryPlan, gpus_per_node: int) -> tuple[int, bool, bool, int]:
    """Which of two fitting plans to take: fewer GPUs; then no activation checkpointing (no recompute);
    then an ep group that tiles the nodes (ep divides the node or is whole nodes, so no all-to-all group
    straddles a node boundary unevenly); then the smaller ep (fewer all-to-all peers)."""
    aligned = gpus_per_node % p.ep == 0 or p.ep % gpus_per_node == 0
    return (p.gpus, p.activation_checkpointing, not aligned, p.ep)


def traffic_bytes(inv: Inventory, mesh: Mesh, precision: str = "bf16-mixed") -> dict[str, int]:
    """Bytes one rank receives per micro-step (ring collectives: ``(g - 1) / g`` of the gathered size over a
    group of ``g``): FSDP all-gathers every unit in forward and again in backward (units reshard after
    forward) and reduce-scatters every gradient in fp32; non-expert parameters over all ranks, experts over
    efsdp. Each MoE layer's all-to-all runs four times (dispatch and combine, forward and backward) and twice
    more when activation checkpointing recomputes the forward; ``(ep - 1) / ep`` of its rows leave the rank."""
    mesh.check(inv)
    b = compute_bytes(precision)
    dense, experts = inv.total_params - inv.expert_params, inv.expert_params // mesh.ep
    w, f = (mesh.gpus - 1) / mesh.gpus, (mesh.efsdp - 1) / mesh.efsdp
    exchanges = 6 if mesh.activation_checkpointing else 4
    rows = mesh.tokens * inv.top_k * inv.moe_layers * inv.routed_width * b
    return {
        "all_gather": round(2 * b * (dense * w + experts * f)),
        "reduce_scatter": round(FP32 * (dense * w + experts * f)),
        "all_to_all": round(exchanges * rows * (mesh.ep - 1) / mesh.ep),
    }
