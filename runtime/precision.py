"""``trainer.precision=auto``: bf16 mixed precision where the hardware multiplies bf16 natively, fp32 elsewhere.

bf16 autocast pays on a CPU only where its matrix units take bf16 operands; elsewhere bf16 products are
emulated, many times slower than fp32 (components/ops/bf16_support.py). ``auto`` resolves once, when the
config is validated, so the run's config, its W&B record and its summary name the precision it trained in.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from components.ops.bf16_support import cpu_has_native_bf16
from runtime.memory_check import is_gpu_run

AUTO = "auto"
BF16 = "bf16-mixed"
FP32 = "32-true"


def resolve_precision(precision: str, accelerator: str) -> str:
    """The Lightning precision ``precision`` stands for on ``accelerator``: ``auto`` is ``bf16-mixed`` on a GPU
    (every GPU this project targets has bf16 tensor cores) and on a CPU with native bf16 products, ``32-true``
    on any other CPU; any other value is returned as given."""
    if precision != AUTO:
        return precision
    return BF16 if is_gpu_run(accelerator) or cpu_has_native_bf16() else FP32


def describe_precision(precision: str, accelerator: str) -> str:
    """One line for the run's log: the (resolved) precision, and a warning where bf16 would be emulated."""
    if is_gpu_run(accelerator) or cpu_has_native_bf16():
        return precision
    if "bf16" in precision:
        return (
            f"{precision} -- warning: this CPU has no native bf16 matrix products (no AMX or AVX-512 BF16), "
            "bf16 products run far slower than fp32 here; trainer.precision=auto or 32-true trains in fp32"
        )
    return f"{precision} (this CPU has no native bf16 matrix products)" if precision == FP32 else precision


MIXED_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def forward_autocast(precision: str, device: Any) -> contextlib.AbstractContextManager:
    """The autocast a run of ``precision`` computed its forward under (Lightning's mixed-precision plugin), for
    a forward outside the trainer that must reproduce the run's validation: a no-op for true precisions."""
    dtype = MIXED_DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)
