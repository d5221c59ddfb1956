"""Refuse, before anything is written, a training run whose weights cannot fit on this machine, and name the
mesh that would fit it.

The floor counted (``runtime/memory_accounting.py``, from a meta-device build: no memory allocated): fp32
weights, fp32 gradients and the optimizer state -- AdamW two fp32 moments per parameter; Muon one momentum
on the matrices it orthogonalises and AdamW's two on the rest. Under ``trainer.strategy=fsdp2`` that state
is sharded over every rank of every node (routed experts over the ``trainer.expert_parallel`` groups as
whole experts) and each GPU must also hold the largest FSDP unit all-gathered, in the compute dtype; the
comparison is per GPU. Activations and buffers come on top, so passing the check is necessary, not
sufficient (``python -m analysis.parallel_plan`` estimates them); failing it means the run would die of
out-of-memory while materialising or gathering the model. A refusal names the smallest mesh whose whole
plan fits, from the same accounting.

The check runs in every process (the ranks Lightning spawns, and every torchrun / srun rank, re-run
train.py), before any rank is bound to its GPU. So it reads a GPU's size without creating a CUDA context,
and only from the device this rank will train on (its local rank's): a context on GPU 0 from every rank
would cost each 0.3-0.5 GiB there. A GPU run is ``trainer.accelerator`` gpu/cuda, or auto with a visible
CUDA device (what Lightning picks); anything else is compared with host RAM.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import torch

from components.registry import ConfigError
from runtime import memory_accounting as accounting

GPUS_PER_NODE = 8  # the node a refusal's suggestion assumes when the run does not say (a CPU run)


def training_floor_bytes(root: Any, inv: Optional[accounting.Inventory] = None) -> tuple[int, int]:
    """(bytes, parameters) of weights + gradients + optimizer state for ``root``'s model on one device."""
    inv = inv or accounting.inventory_for(root)
    return accounting.floor_bytes(inv)["state"], inv.total_params


def _mem_available_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def is_gpu_run(accelerator: str) -> bool:
    """Whether ``trainer.accelerator`` trains on CUDA devices here (auto: when one is visible, as Lightning
    resolves it). ``torch.cuda.is_available`` only counts devices (NVML or cudaGetDeviceCount): no context."""
    if accelerator in ("gpu", "cuda"):
        return True
    return accelerator == "auto" and torch.cuda.is_available()


def local_rank(env: Mapping[str, str] = os.environ) -> int:
    """This process's rank on its node: LOCAL_RANK (torchrun, the ranks Lightning spawns), else
    SLURM_LOCALID (srun), else 0 (a single process, or the rank that launches the others)."""
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        value = env.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 0


def local_device_index(devices: Any, visible: int, env: Mapping[str, str] = os.environ) -> int:
    """The CUDA device index this rank will train on: ``devices[local rank]`` for a list of indices (as
    Lightning assigns them), else the local rank; wrapped into the visible devices when the launcher gave
    each task its own (e.g. srun --gpus-per-task, where every rank sees its GPU as index 0)."""
    rank = local_rank(env)
    index = devices[rank] if isinstance(devices, (list, tuple)) and 0 <= rank < len(devices) else rank
    return index % visible if visible > 0 and index >= visible else index


def sharded_ranks(trainer: Any, visible: int) -> int:
    """Ranks ``trainer.strategy=fsdp2`` shards the model over (every device of every node); 1 otherwise."""
    if trainer.strategy != "fsdp2":
        return 1
    if isinstance(trainer.devices, (list, tuple)):
        devices = len(trainer.devices)
    else:
        devices = trainer.devices if isinstance(trainer.devices, int) and trainer.devices > 0 else max(visible, 1)
    return devices * trainer.num_nodes


def available_bytes(root: Any) -> tuple[Optional[int], str]:
    """Memory one rank's share of the model may use, and where (None: unknown, the check is skipped): one
    GPU's total memory on a GPU run, sharded or not; host RAM otherwise."""
    t = root.trainer
    if is_gpu_run(t.accelerator):
        if not torch.cuda.is_available():
            return None, "no CUDA device here"
        visible = torch.cuda.device_count()
        index = local_device_index(t.devices, visible)
        # Device properties, not torch.cuda.mem_get_info: mem_get_info runs cudaMemGetInfo under a device
        # guard, which creates a CUDA context (0.3-0.5 GiB) on the device asked for -- GPU 0 from every rank
        # before this fix. get_device_properties does run torch's _lazy_init (torch/cuda/__init__.py:
        # _lazy_init -> torch._C._cuda_init), but that initialises the CUDA runtime and device count, not a
        # context on any device; the properties come from cudaGetDeviceProperties, which needs none. Asking
        # only for this rank's own index keeps even that to the device the rank will use anyway. Total
        # memory is what mem_get_info(...)[1] returned, so the comparison is unchanged.
        per_device = torch.cuda.get_device_properties(index).total_memory
        shards = sharded_ranks(t, visible)
        where = (
            f"of each of the {shards} sharded GPUs" if shards > 1 else f"on one GPU ({per_device / 2**30:.1f} GiB each)"
        )
        return per_device, where
    return _mem_available_bytes(), "of memory available on this machine"


def _gpus_per_node(trainer: Any) -> int:
    if isinstance(trainer.devices, (list, tuple)):
        return len(trainer.devices)
    if isinstance(trainer.devices, int) and trainer.devices > 0 and is_gpu_run(trainer.accelerator):
        return trainer.devices
    return GPUS_PER_NODE


def mesh_overrides(plan: accounting.MemoryPlan, gpus_per_node: int) -> str:
    """The trainer overrides that train on ``plan``'s mesh."""
    nodes, per_node = (plan.gpus // gpus_per_node, gpus_per_node) if plan.gpus >= gpus_per_node else (1, plan.gpus)
    out = "trainer=gpu" if plan.gpus == 1 else f"trainer=fsdp2 trainer.devices={per_node} trainer.num_nodes={nodes}"
    if plan.ep > 1:
        out += f" trainer.expert_parallel={plan.ep}"
    if plan.activation_checkpointing:
        out += " trainer.activation_checkpointing=true"
    return out


def suggest_mesh(root: Any, inv: accounting.Inventory, capacity: Optional[int]) -> str:
    """One sentence naming the smallest mesh whose whole plan fits (GPUs of ``capacity`` bytes; None: a CPU
    run, for which H100 and H200 nodes are named)."""
    t = root.trainer
    seq = root.data.seq_len
    per_node = _gpus_per_node(t)
    if capacity is None:
        gpus = [(gpu.name, gpu.memory_bytes, "bf16-mixed") for gpu in accounting.GPUS.values()]
    else:
        precision = t.precision if t.precision in ("32-true", "32", "bf16-mixed", "bf16-true") else "bf16-mixed"
        gpus = [(f"{capacity / 2**30:.1f} GiB GPUs", capacity, precision)]
    parts = []
    for name, memory, precision in gpus:
        fit = accounting.smallest_fit(inv, memory, seq, 1, precision, per_node)
        if fit is None:
            parts.append(f"no mesh of {name} up to 16,384 GPUs fits it at data.seq_len={seq}")
        else:
            parts.append(f"on {name}, {fit.gpus:,} GPUs: {mesh_overrides(fit, per_node)}")
    return (
        f"The smallest mesh that fits it (micro-batch 1, activations included; python -m analysis.parallel_plan "
        f"<same overrides> --gpu h100|h200 --seq {seq}): " + "; ".join(parts) + "."
    )


def check_fits(root: Any) -> None:
    """Raise ConfigError naming the model, and the mesh that would fit it, when its floor exceeds the
    memory of one rank."""
    t = root.trainer
    if not t.memory_check:
        return
    available, where = available_bytes(root)
    if available is None:
        return
    gpu = is_gpu_run(t.accelerator)
    shards = sharded_ranks(t, torch.cuda.device_count()) if gpu else 1
    if shards == 1:
        need, n = training_floor_bytes(root)
        if need <= available:
            return
        inv = accounting.inventory_for(root)
        what = (
            f"training this model needs at least {need / 2**30:,.1f} GiB for weights, gradients and optimizer "
            f"state ({n:,} parameters: fp32 weights and gradients, {_state_words(inv)})"
        )
    else:
        inv = accounting.inventory_for(root)
        ep = t.expert_parallel
        floor = accounting.floor_bytes(inv, shards, ep, t.precision)
        if floor["total"] <= available:
            return
        unit = accounting.gathered_peak(inv, ep)["largest_unit"]
        what = (
            f"training this model needs at least {floor['total'] / 2**30:,.1f} GiB per GPU on {shards} sharded GPUs "
            f"(expert_parallel {ep}): {floor['state'] / 2**30:,.1f} GiB of weights, gradients and optimizer state "
            f"({inv.total_params:,} parameters sharded: fp32 weights and gradients, {_state_words(inv)}) and "
            f"{floor['largest_unit'] / 2**30:,.1f} GiB for its largest unit ({unit}) all-gathered"
        )
    suggestion = suggest_mesh(root, inv, available if gpu else None)
    raise ConfigError(
        "model",
        f"{what}, more than the {available / 2**30:,.1f} GiB {where}. {suggestion} "
        "Inspect it without training: python -m analysis.model_report <same overrides>; or train a scaled-down "
        "configuration (e.g. experiment=k3_small); trainer.memory_check=false skips this check",
    )


def _state_words(inv: accounting.Inventory) -> str:
    if inv.muon_params:
        return f"Muon's fp32 momentum on {inv.muon_params:,} matrix parameters, AdamW's two moments on the rest"
    return "AdamW's two fp32 moments"
