"""Which parameter goes to which optimizer, with which weight decay.

AdamW: every parameter; decoupled weight decay on matrices (2-D and up) except those a module marks
``_no_weight_decay`` (KDA's decay parameters, AttnRes queries); never on norm gains or biases.

Muon (Moonlight partition, docs/k3.md §8.1): hidden matrices -- every 2-D weight with both sides > 1,
and the stacked matrices a module declares in ``muon_layouts()`` (expert weights) -- go to Muon; the
token embedding, the output head and everything else (norm gains, biases, KDA's A_log / dt_bias,
depthwise conv kernels [P, 1, W], single-vector "matrices") go to AdamW, under the same learning rate
and decay. With ``per_head`` the head blocks modules declare are orthogonalised separately (§8.2): only
the query/key/value projections' (``scope="qkv"``, the K3 report's), or every declared block (``"all"``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from components.nn.matrix_layout import HasMatrixLayouts, MatrixLayout


def decays(p: torch.Tensor) -> bool:
    """Whether AdamW-style decoupled weight decay applies to ``p``: matrices not marked ``_no_weight_decay``."""
    return p.ndim >= 2 and not getattr(p, "_no_weight_decay", False)


def unique_trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Named trainable parameters, tied weights once."""
    seen, out = set(), []
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def adamw_param_groups(params: list[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict[str, Any]]:
    decay = [p for _, p in params if decays(p)]
    no_decay = [p for _, p in params if not decays(p)]
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
