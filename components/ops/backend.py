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

import importlib
import os
from typing import Callable, Union

import torch

from components.nn.eager_island import compile_constant

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


# kernel -> whether it imports here: each kernel's modules are imported once per process, at the first
# question (never inside a compiled graph: see _decide)
_AVAILABLE: dict[str, bool] = {}


def available(kernel: str) -> bool:
    """Whether a kernel back-end imports on this machine (checked once per process)."""
    if kernel == "torch":
        return True
    if kernel not in _AVAILABLE:
        try:
            for module in _KERNEL_MODULES[kernel]:
                importlib.import_module(module)
        except Exception:  # ImportError, or Triton failing to initialise on this platform
            _AVAILABLE[kernel] = False
        else:
            _AVAILABLE[kernel] = True
    return _AVAILABLE[kernel]


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

    Inside a compiled graph this costs nothing: the part that depends on the machine (``_decide``) is a
    constant to TorchDynamo, and ``applies`` reads only shapes and dtypes, which the graph's guards fix.
    """
    check_choice(op, choice)
    if choice == "torch":
        return "torch"
    decided = _decide(op, choice, device.type)
    if decided.startswith("!"):
        raise RuntimeError(decided[1:])
    if decided == "torch" or _applies(applies):
        return decided
    if choice == "auto":
        return "torch"
    raise RuntimeError(f"{op}: backend '{decided}' does not support these inputs; use backend torch or auto")


@compile_constant
def _decide(op: str, choice: str, device_type: str) -> str:
    """What the machine decides for a kernel ``choice`` (``auto`` or the op's kernel) of ``op`` on a
    ``device_type`` tensor, before the call's own shapes are looked at: ``torch``, the kernel's name (if
    it applies to the call), or ``!`` and the error an explicit choice raises. Fixed per process (the
    kernel imports or not; Triton's interpreter is on or not), hence a constant to TorchDynamo: it runs
    once while a graph is traced, and its importing never enters the graph."""
    kernel = KERNELS[op]
    on_device = device_type == "cuda" or (kernel == "triton" and interpreting())
    if choice == "auto":
        return kernel if on_device and available(kernel) else "torch"
    if not available(kernel):
        return (
            f"!{op}: backend '{kernel}' is not importable on this machine (install "
            f"{'fla-core' if kernel == 'fla' else 'triton'}); use backend torch or auto"
        )
    if not on_device:
        return (
            f"!{op}: backend '{kernel}' is a Triton kernel and needs CUDA tensors, got {device_type}; use backend "
            "torch or auto"
        )
    return kernel


def _applies(applies: Union[bool, Callable[[], bool]]) -> bool:
    return applies() if callable(applies) else applies
