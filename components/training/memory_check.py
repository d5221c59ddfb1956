"""Refuse, before anything is written, a training run whose weights cannot fit on this machine.

The floor counted: fp32 weights, fp32 gradients and the optimizer state (AdamW: two moments; Muon: one
momentum for its matrices, two moments for the rest; counted as two) -- 16 bytes per parameter, from a
meta-device build (no memory allocated). Activations come on top, so passing the check is necessary,
not sufficient; failing it means the run would die of out-of-memory while materialising the model.
Fully sharded training (``trainer.strategy=fsdp``) divides the floor across all devices of all nodes.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from components.registry import ConfigError

BYTES_PER_PARAM = 16  # weight + gradient + two optimizer moments, fp32


def training_floor_bytes(root: Any) -> tuple[int, int]:
    """(bytes, parameters) of weights + gradients + optimizer state for ``root``'s model."""
    from components.nn.meta_model import build_on_meta

    model = build_on_meta(root)
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


def available_bytes(root: Any) -> tuple[Optional[int], str]:
    """Memory one copy of the model may use, and where (None: unknown, the check is skipped)."""
    t = root.trainer
    if t.accelerator in ("gpu", "cuda"):
        if not torch.cuda.is_available():
            return None, "no CUDA device here"
        per_device = torch.cuda.mem_get_info(0)[1]
        devices = t.devices if isinstance(t.devices, int) and t.devices > 0 else torch.cuda.device_count()
        shards = devices * t.num_nodes if "fsdp" in str(t.strategy) else 1
        return per_device * shards, f"on {'the ' + str(shards) + ' sharded GPUs' if shards > 1 else 'one GPU'} ({per_device / 2**30:.1f} GiB each)"
    available = _mem_available_bytes()
    return available, "of memory available on this machine"


def check_fits(root: Any) -> None:
    """Raise ConfigError naming the model when its training floor exceeds the memory available."""
    if not getattr(root.trainer, "memory_check", True):
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
