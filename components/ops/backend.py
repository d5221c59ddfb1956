"""Kernel back-ends: one vocabulary, one availability check, one resolver for every op that has a
fast kernel beside its PyTorch reference.

Vocabulary (a component's ``backend`` field, e.g. ``mixer.backend``, ``residual.backend``,
``ffn.activation_backend``):

* ``torch``: the PyTorch implementation (any device; the reference the kernels are tested against);
* ``fla``: flash-linear-attention's Triton kernels (KDA, AttnRes), CUDA only;
* ``triton``: this project's Triton kernels (``components/ops/triton/``: SiTU-GLU), CUDA, or the CPU
  under ``TRITON_INTERPRET=1`` for tests;
* ``auto``: the op's kernel where it applies (CUDA tensors, the kernel importable, the shapes it
  supports), ``torch`` otherwise.

Each op names the kernels it has (``KERNELS`` below); a config names one of those, ``torch`` or
``auto``. Which algorithm a layer runs (MoE dispatch: grouped GEMM, padded batched GEMM, loop) is a
different question with its own option, ``ffn.dispatch``.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Callable, Union

import torch

BACKENDS = ("torch", "fla", "triton", "auto")

# op -> the one kernel back-end it has besides torch
KERNELS = {
    "kda": "fla",
    "attnres": "fla",
    "situ_glu": "triton",
}

# the modules whose import proves a kernel back-end usable (importing them also initialises Triton)
_KERNEL_MODULES = {
    "fla": ("fla.ops.kda", "fla.ops.attnres.fused"),
    "triton": ("triton",),
}


def allowed_backends(op: str) -> tuple[str, ...]:
    """The choices a config may name for ``op``: ``torch``, its kernel, ``auto``."""
    return ("torch", KERNELS[op], "auto")


@functools.cache
def available(kernel: str) -> bool:
    """Whether a kernel back-end imports on this machine (checked once per process)."""
    if kernel == "torch":
        return True
    try:
        for module in _KERNEL_MODULES[kernel]:
            importlib.import_module(module)
    except Exception:  # ImportError, or Triton failing to initialise on this platform
        return False
    return True


def interpreting() -> bool:
    """Triton's CPU interpreter is on (``TRITON_INTERPRET=1``): Triton kernels accept CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_choice(op: str, choice: str) -> None:
    """ValueError unless ``choice`` is one of ``allowed_backends(op)``."""
    allowed = allowed_backends(op)
    if choice not in allowed:
        raise ValueError(f"{op}: backend '{choice}' is not allowed; choose one of {', '.join(allowed)}")


def resolve(op: str, choice: str, device: torch.device, applies: Union[bool, Callable[[], bool]] = True) -> str:
    """The back-end ``op`` runs with: ``torch`` or its kernel's name.

    ``applies``: whether the kernel supports this call's shapes and dtypes (the op knows; e.g. fla's
    AttnRes needs 16-byte rows), or a function that tells, called only when a kernel is in question (so
    CPU-only callers never import Triton). ``auto`` falls back to ``torch`` when the kernel does not apply, is
    not importable or the tensors are not on CUDA. An explicit kernel choice never falls back: it
    raises a RuntimeError naming the op and what is missing.
    """
    check_choice(op, choice)
    kernel = KERNELS[op]
    if choice == "torch":
        return "torch"
    on_device = device.type == "cuda" or (kernel == "triton" and interpreting())
    if choice == "auto":
        return kernel if on_device and _applies(applies) and available(kernel) else "torch"
    if not available(kernel):
        raise RuntimeError(
            f"{op}: backend '{kernel}' is not importable on this machine (install "
            f"{'fla-core' if kernel == 'fla' else 'triton'}); use backend torch or auto"
        )
    if not on_device:
        raise RuntimeError(
            f"{op}: backend '{kernel}' is a Triton kernel and needs CUDA tensors, got {device.type}; use backend torch "
            "or auto"
        )
    if not _applies(applies):
        raise RuntimeError(f"{op}: backend '{kernel}' does not support these inputs; use backend torch or auto")
    return kernel


def _applies(applies: Union[bool, Callable[[], bool]]) -> bool:
    return applies() if callable(applies) else applies
