"""Activation checkpointing of whole decoder layers (``Decoder.set_activation_checkpointing``).

``checkpointed(fn, *args)`` runs ``fn`` under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``:
autograd saves only the inputs of the call and re-runs ``fn`` in backward when it needs the activations.
The recomputation sees the same weights, the same inputs and the same RNG state, so it produces the same
values and the gradients are those of the plain call.

A recomputation still runs Python: a module that accumulates statistics in its training forward (MoE
routers' expert loads and QB histograms, ``components/ffn/router.py``) would count its micro-batch twice.
``recomputing()`` is True while autograd re-runs a checkpointed call, and such modules skip recording then:
the first forward already recorded exactly what the recomputation would.

Under ``torch.compile`` the compiled backward recomputes inside its own graph (no Python runs again), so
the marker is not needed there and the plain checkpoint is used.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

_state = threading.local()  # autograd may recompute on its own (per-device) thread: a flag per thread


def recomputing() -> bool:
    """Whether the running code is a checkpointed forward being recomputed in backward."""
    return getattr(_state, "depth", 0) > 0


@contextmanager
def _recomputation() -> Iterator[None]:
    _state.depth = getattr(_state, "depth", 0) + 1
    try:  # recomputation may stop early by an exception once it has what backward needs
        yield
    finally:
        _state.depth -= 1


def _contexts() -> tuple[AbstractContextManager, AbstractContextManager]:
    """(context of the first forward, context of the recomputation) for ``checkpoint(context_fn=...)``."""
    return nullcontext(), _recomputation()


def checkpointed(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, its activations recomputed in backward instead of saved."""
    if torch.compiler.is_compiling():
        return checkpoint(fn, *args, use_reentrant=False)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=_contexts)
