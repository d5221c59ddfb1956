"""Which parameter goes to which optimizer, with which weight decay.

AdamW: every parameter; decoupled weight decay on matrices (2-D and up) except those a module declares in
``no_weight_decay()`` (KDA's decay parameters, AttnRes queries); never on norm gains or biases.

Muon (Moonlight partition, docs/k3.md §8.1): hidden matrices -- every 2-D weight with both sides > 1,
and the stacked matrices a module declares in ``muon_layouts()`` (expert weights) -- go to Muon; the
token embedding, the output head and everything else (norm gains, biases, KDA's A_log / dt_bias,
depthwise conv kernels [P, 1, W], single-vector "matrices") go to AdamW, under the same learning rate
and decay. With ``per_head`` the head blocks modules declare are orthogonalised separately (§8.2): only
the query/key/value projections' (``scope="qkv"``, the K3 report's), or every declared block (``"all"``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from components.nn.matrix_layout import HasMatrixLayouts, MatrixLayout
from components.nn.weight_decay import HasNoWeightDecay


def declared_no_decay(model: nn.Module) -> set[str]:
    """Full names of the parameters every module of ``model`` keeps out of weight decay (``no_weight_decay()``)."""
    out: set[str] = set()
    for prefix, module in model.named_modules():
        if isinstance(module, HasNoWeightDecay):
            out.update(f"{prefix}.{local}" if prefix else local for local in module.no_weight_decay())
    return out


def unique_trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Named trainable parameters, tied weights once."""
    seen, out = set(), []
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def decayed_parameter_ids(model: nn.Module) -> set[int]:
    """``id`` of every trainable parameter of ``model`` that weight decay applies to: matrices (2-D and up)
    no module declares in ``no_weight_decay()``."""
    skip = declared_no_decay(model)
    return {id(p) for name, p in unique_trainable(model) if p.ndim >= 2 and name not in skip}


def adamw_param_groups(
    model: nn.Module, params: list[tuple[str, nn.Parameter]], weight_decay: float
) -> list[dict[str, Any]]:
    """A decayed and a not-decayed group of ``params`` (named as in ``model.named_parameters()``)."""
    skip = declared_no_decay(model)
    decays = {name: p.ndim >= 2 and name not in skip for name, p in params}
    decay = [p for name, p in params if decays[name]]
    no_decay = [p for name, p in params if not decays[name]]
    return [
        g
        for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if g["params"]
    ]


def declared_layouts(model: nn.Module) -> dict[str, MatrixLayout]:
    """Full parameter name -> layout, from every module's ``muon_layouts()``."""
    out: dict[str, MatrixLayout] = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, HasMatrixLayouts):
            continue
        for local, layout in module.muon_layouts().items():
            out[f"{prefix}.{local}" if prefix else local] = layout
    return out


PER_HEAD_SCOPES = ("qkv", "all")


def muon_partition(
    model: nn.Module, per_head: bool, scope: str = "qkv"
) -> tuple[list[tuple[str, nn.Parameter, MatrixLayout]], list[tuple[str, nn.Parameter]]]:
    """(Muon parameters with their layouts, AdamW parameters)."""
    if scope not in PER_HEAD_SCOPES:
        raise ValueError(f"per-head scope must be one of {', '.join(PER_HEAD_SCOPES)}, got {scope!r}")
    outside = {id(model.embed.weight), id(model.lm_head.weight)}
    layouts = declared_layouts(model)
    muon, adamw = [], []
    for name, p in unique_trainable(model):
        layout = layouts.get(name)
        if layout is not None:
            split = per_head and (scope == "all" or layout.qkv)
            layout = (
                MatrixLayout(layout.heads, layout.axis, layout.stacked)
                if split
                else MatrixLayout(stacked=layout.stacked)
            )
        if layout is None and p.ndim == 2 and min(p.shape) > 1:
            layout = MatrixLayout()
        if id(p) in outside or layout is None:
            adamw.append((name, p))
        else:
            layout.check(name, p.shape)
            muon.append((name, p, layout))
    return muon, adamw
