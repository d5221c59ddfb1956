"""How the trainer compiles a decoder: as one graph, layer by layer, or not at all.

A model whose sublayers all declare ``compile_friendly = True`` compiles as one graph. A model with
eager islands (KDA's chunked kernel, whose chunk size comes from the data; the MoE router's balancing
statistics, and expert dispatches whose sizes come from the routing: padded_bmm, capacity-limited or
non-bf16 grouped_mm; dropless bf16 grouped_mm and the blocked dispatch have fixed shapes and compile)
compiles *layer by layer*: each decoder layer is its own compiled region, the islands run eagerly between its
graphs, and everything around them (projections, norms, short convolutions, gates, activations, residual reads)
is fused; the residual scheme's final read and the output norm are one more region.
Layers of the same kind share compiled code; a new variant is compiled only when the layer's inputs
differ in kind (KDA or MLA, dense or routed FFN, how many AttnRes blocks it reads), so the number of
compilations is bounded by the model's distinct layer shapes, never by its depth alone.
"""

from __future__ import annotations

import shutil
from typing import Any, Callable

import torch
import torch._dynamo

from components.model import Decoder

COMPILE_MODES = ("off", "model", "layers")


def has_cpp_compiler() -> bool:
    """Whether TorchInductor's CPU back-end can build kernels here (a C++ compiler on PATH)."""
    return any(shutil.which(cc) for cc in ("c++", "g++", "clang++"))


def compile_mode(trainer_cfg: Any, model: Decoder) -> str:
    """``trainer.compile`` (true / false / auto) resolved for this model: ``off``, ``model`` (one graph)
    or ``layers`` (one region per decoder layer, for models with eager islands). ``auto`` compiles on a
    GPU, or on a CPU where a C++ compiler is on PATH (TorchInductor's CPU back-end needs one)."""
    choice = str(trainer_cfg.compile).lower()
    if choice == "false":
        return "off"
    if choice == "auto" and trainer_cfg.accelerator not in ("gpu", "cuda") and not has_cpp_compiler():
        return "off"
    return "layers" if model.compile_unfriendly() else "model"


def distinct_layer_kinds(model: Decoder) -> int:
    """Upper bound on the compiled variants of one layer's code: (mixer, FFN) kinds times the residual
    states a layer can see (AttnRes reads a growing number of blocks)."""
    kinds = {(type(layer.mixer).__name__, type(layer.ffn).__name__) for layer in model.layers}
    return len(kinds) * (len(model.layers) + 1)


def compiled_hidden(
    model: Decoder, mode: str, backend: str = "inductor", compile_finish: bool = True
) -> Callable[..., torch.Tensor]:
    """The model's hidden-state function under ``mode``. ``layers`` compiles each layer in place
    (``nn.Module.compile``: parameter and state-dict names are unchanged) and the residual scheme's final
    read (``compile_finish=False``: left eager, as a benchmark's reference row runs it). ``backend`` is
    torch.compile's (tests use ``aot_eager``: the same graphs, breaks and autograd, without generating
    kernels)."""
    if mode == "off":
        return model.hidden_states
    if mode == "model":
        return torch.compile(model.hidden_states, dynamic=False, backend=backend)
    if mode != "layers":
        raise ValueError(f"compile mode must be one of {COMPILE_MODES}, got {mode!r}")
    # each graph break inside a layer leaves a resume function whose guards see the layer's kind; allow
    # one compiled variant per kind instead of falling back to eager after the default 8
    limit = distinct_layer_kinds(model) + 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    for layer in model.layers:
        layer.compile(dynamic=False, backend=backend)
    for depth in model.mtp:  # training-only MTP depths: one more layer each
        depth.compile(dynamic=False, backend=backend)
    # the residual scheme's final read and the output norm: for Attention Residuals a softmax over every
    # block summary, as much elementwise work as a layer's read (eagerly about 5% of a k3_small step)
    residual = model.residual
    if compile_finish and "finish" not in residual.__dict__:  # not compiled yet (a model handed here twice keeps one)
        residual.finish = torch.compile(residual.finish, dynamic=False, backend=backend)
    return model.hidden_states
