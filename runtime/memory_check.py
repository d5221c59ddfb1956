"""Refuse, before anything is written, a training run whose weights cannot fit on this machine.

The floor counted: fp32 weights, fp32 gradients and the optimizer state (AdamW: two moments; Muon: one
momentum for its matrices, two moments for the rest; counted as two) -- 16 bytes per parameter, from a
meta-device build (no memory allocated). Activations come on top, so passing the check is necessary,
not sufficient; failing it means the run would die of out-of-memory while materialising the model.
Fully sharded training (``trainer.strategy=fsdp``) divides the floor across all devices of all nodes.

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

BYTES_PER_PARAM = 16  # weight + gradient + two optimizer moments, fp32


def training_floor_bytes(root: Any) -> tuple[int, int]:
    """(bytes, parameters) of weights + gradients + optimizer state for ``root``'s model."""
    from components.model import build_on_meta

    model = build_on_meta(root.decoder_config())
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return n * BYTES_PER_PARAM, n


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


def available_bytes(root: Any) -> tuple[Optional[int], str]:
    """Memory one copy of the model may use, and where (None: unknown, the check is skipped)."""
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
        if isinstance(t.devices, (list, tuple)):
            devices = len(t.devices)
        else:
            devices = t.devices if isinstance(t.devices, int) and t.devices > 0 else visible
        shards = devices * t.num_nodes if "fsdp" in str(t.strategy) else 1
        return (
            per_device * shards,
            f"on {'the ' + str(shards) + ' sharded GPUs' if shards > 1 else 'one GPU'} ({per_device / 2**30:.1f} GiB "
            "each)",
        )
    available = _mem_available_bytes()
    return available, "of memory available on this machine"


def check_fits(root: Any) -> None:
    """Raise ConfigError naming the model when its training floor exceeds the memory available."""
    if not root.trainer.memory_check:
        return
    available, where = available_bytes(root)
    if available is None:
        return
    need, n = training_floor_bytes(root)
    if need > available:
        raise ConfigError(
            "model",
            f"training this model needs at least {need / 2**30:,.1f} GiB for weights, gradients and optimizer state "
            f"({n:,} parameters x {BYTES_PER_PARAM} B), more than the {available / 2**30:,.1f} GiB {where}. "
            "Inspect it without training: python -m analysis.model_report <same overrides>; or train a scaled-down "
            "configuration (e.g. experiment=k3_small); trainer.memory_check=false skips this check",
        )
