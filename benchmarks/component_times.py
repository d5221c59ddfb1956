"""Where an eager training step spends its time, per component, forward and backward.

Wall-clock spans between module hooks: a forward pre-hook and hook around each module's forward, a full
backward pre-hook and hook around its backward (on the CPU every op is synchronous, so the span is the
module's own work). Spans of modules nested in others are subtracted from their parents, so each row is
exclusive and the rows add up to the measured step. KDA's chunked kernel is timed inside its autograd
function (forward and hand-written backward; the batched form's or the native CPU kernel's), the
optimizer's Newton-Schulz inside Muon.

Rows: the component kinds of the model (``kda mixer``: the projections, convolutions, gates and norms
around the kernel; ``kda chunk kernel``; ``mla mixer``; ``router``; ``routed experts``; ``shared experts``;
``latent projections``: a LatentMoE's down/up projections and norm; ``dense ffn``; ``mtp``: the MTP depth's
own layers), ``residual, norms`` (what a decoder layer does around its mixer and FFN: RMSNorms and the
residual scheme's reads and writes), ``embedding, head, loss`` and the rest of the forward and backward,
``optimizer`` (Muon's Newton-Schulz on its own row) and the balancer's update.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from components.ops import kda as kda_ops
from components.ops import kda_cpu
from components.optim import muon

# module class name -> row; the first match walking up the module's class names
KINDS = {
    "KimiDeltaAttention": "kda mixer",
    "MLA": "mla mixer",
    "Attention": "attention mixer",
    "Router": "router",
    "RoutedExperts": "routed experts",
    "GLUMLP": "shared experts",
    "LatentMoEFFN": "latent projections",
    "StableLatentMoEFFN": "latent projections",
    "MoEFFN": "moe ffn (combine)",
    "DenseFFN": "dense ffn",
    "MTPDepth": "mtp (norms, projection)",
    "DecoderLayer": "residual, norms",
}


def _row(module: nn.Module) -> str | None:
    for cls in type(module).__mro__:
        if cls.__name__ in KINDS:
            return KINDS[cls.__name__]
    return None


class _Spans:
    """Exclusive time per row: a stack of open spans; a closing span's time is charged to its row and
    taken out of its parent's."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.stack: list[list] = []  # [row, start, time of children]

    def open(self, row: str) -> None:
        self.stack.append([row, time.perf_counter(), 0.0])

    def close(self, row: str) -> None:
        if not self.stack or self.stack[-1][0] != row:
            return  # unmatched (a module whose backward hook did not fire): drop it
        name, start, children = self.stack.pop()
        span = time.perf_counter() - start
        self.totals[name] += span - children
        if self.stack:
            self.stack[-1][2] += span


@contextmanager
def _wrapped(owner: object, attr: str, wrap: Callable) -> Iterator[None]:
    original = owner.__dict__[attr]
    setattr(owner, attr, wrap(original))
    try:
        yield
    finally:
        setattr(owner, attr, original)


def component_times(
    model: nn.Module, step: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor, steps: int = 2
) -> tuple[dict[str, float], float]:
    """Seconds per step by row (exclusive, averaged over ``steps`` eager steps of ``step(ids)``) and the
    measured seconds per step. The step must run the model eagerly (hooks do not fire in compiled code)."""
    spans = _Spans()
    handles = []
    for module in model.modules():
        row = _row(module)
        if row is None:
            continue
        handles += [
            module.register_forward_pre_hook(lambda m, a, r=row: spans.open(r)),
            module.register_forward_hook(lambda m, a, o, r=row: spans.close(r)),
            module.register_full_backward_pre_hook(lambda m, g, r=row: spans.open(r)),
            module.register_full_backward_hook(lambda m, gi, go, r=row: spans.close(r)),
        ]

    def timed(row: str) -> Callable:
        def wrap(fn: Callable) -> Callable:
            inner = fn.__func__ if isinstance(fn, staticmethod) else fn

            def run(*args, **kwargs):
                spans.open(row)
                try:
                    return inner(*args, **kwargs)
                finally:
                    spans.close(row)

            return staticmethod(run) if isinstance(fn, staticmethod) else run

        return wrap

    step(ids)  # warm: allocator, first-call costs
    try:
        with (
            _wrapped(kda_ops._ChunkKDA, "forward", timed("kda chunk kernel")),
            _wrapped(kda_ops._ChunkKDA, "backward", timed("kda chunk kernel")),
            _wrapped(kda_cpu._NativeChunkKDA, "forward", timed("kda chunk kernel")),
            _wrapped(kda_cpu._NativeChunkKDA, "backward", timed("kda chunk kernel")),
            _wrapped(muon, "newton_schulz", timed("optimizer: Newton-Schulz")),
            _wrapped(muon.Muon, "step", timed("optimizer: the rest")),
        ):
            spans.totals.clear()
            spans.open("embedding, head, loss, other")
            t0 = time.perf_counter()
            for _ in range(steps):
                step(ids)
            total = (time.perf_counter() - t0) / steps
            spans.close("embedding, head, loss, other")
    finally:
        for h in handles:
            h.remove()
    return {row: t / steps for row, t in spans.totals.items()}, total


def print_table(rows: dict[str, float], total: float, tokens: int) -> None:
    print(f"{'component':32s} {'ms/step':>9s} {'share':>7s}")
    for row, sec in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"{row:32s} {sec * 1e3:9.1f} {sec / total:7.1%}")
    print(f"{'step (measured)':32s} {total * 1e3:9.1f} {'':>7s}  {tokens / total:,.0f} tokens/s")
