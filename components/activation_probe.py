"""The largest activations of a forward pass: what SiTU-GLU's softcaps exist to bound (docs/k3.md §5).

``largest_activations(model, input_ids)`` runs one eager, gradient-free forward of a decoder's layers and
returns the largest magnitudes it met:

* ``glu_max``: the GLU intermediate ``act(w1 x, w3 x)`` of every FFN (dense, shared and routed experts),
  the value SwiGLU lets grow with ``|x|^2`` and SiTU-GLU keeps below ``beta * linear_beta`` (100 at K3's
  4 and 25);
* ``ffn_out_max``: every FFN's output, the write into the residual stream.

Every GLU holder in the model keeps its activation in an ``act`` attribute (``components/ffn/dense.py``,
``components/ffn/experts.py``); the probe wraps those for the one pass, and hooks the FFNs' outputs.
Compiled layers run eagerly for the pass (``torch.compiler.set_stance("force_eager")``), so the hooks fire
and no graph is recompiled. On a model split over ranks (FSDP2, expert parallelism) the pass is a forward
like any other: every rank calls it, as validation does (``runtime/lit_module.py``).
"""

from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from components.ffn.base import FFN


def _glu_holders(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if callable(getattr(m, "act", None))]


@contextmanager
def _eager() -> Iterator[None]:
    if "torch._dynamo" not in sys.modules:  # nothing was compiled: nothing to switch off
        yield
        return
    with torch.compiler.set_stance("force_eager"):
        yield


def largest_activations(model: Any, input_ids: torch.Tensor, segments: Any = None) -> dict[str, float]:
    """``{"glu_max", "ffn_out_max"}`` over one forward of ``model.hidden_states(input_ids [B, T], segments)``."""
    largest = {"glu_max": 0.0, "ffn_out_max": 0.0}
    found: dict[str, list[torch.Tensor]] = {k: [] for k in largest}

    def recording(act: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(*args: Any, **kwargs: Any) -> torch.Tensor:
            z = act(*args, **kwargs)
            if z.numel():
                found["glu_max"].append(z.detach().abs().amax().float())
            return z

        return run

    def ffn_output(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        if isinstance(out, torch.Tensor) and out.numel():
            found["ffn_out_max"].append(out.detach().abs().amax().float())

    holders = _glu_holders(model)
    originals = [h.act for h in holders]
    with ExitStack() as stack:
        for module in model.modules():
            if isinstance(module, FFN):
                stack.callback(module.register_forward_hook(ffn_output).remove)
        try:
            for holder, act in zip(holders, originals):
                holder.act = recording(act)
            with torch.no_grad(), _eager():
                model.hidden_states(input_ids, segments=segments)
        finally:
            for holder, act in zip(holders, originals):
                holder.act = act
    for key, values in found.items():
        if values:
            largest[key] = float(torch.stack(values).max())
    return largest
