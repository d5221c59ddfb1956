"""How a weight splits into the independent matrices an orthogonalising optimizer (Muon) updates.

A module whose parameters hold several matrices -- attention projections with one block per head,
stacked expert weights ``[E, a, b]`` -- says so by subclassing :class:`HasMatrixLayouts` and returning
``{parameter name: MatrixLayout}`` from ``muon_layouts()``. The layout is a fact about the weight's
shape, so it lives with the model; the optimizer only reads it (``components/optim/param_groups.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class MatrixLayout:
    """How a parameter splits into the matrices Muon orthogonalises independently.

    heads: number of equal blocks along ``axis`` (0: rows = output features, 1: columns = input
    features of an ``nn.Linear`` weight); 1 means the whole matrix.
    stacked: the leading dimension indexes independent matrices (``[E, a, b]`` expert weights).
    qkv: the head blocks are a query, key or value projection's (the K3 report's Per-Head Muon scope:
    MLA q_b_proj / kv_b_proj, KDA and attention q/k/v_proj; not output projections or gates).
    """

    heads: int = 1
    axis: int = 0
    stacked: bool = False
    qkv: bool = False

    def to_blocks(self, t: Tensor) -> Tensor:
        """``[rows, cols]`` or ``[E, rows, cols]`` -> ``[N, a, b]`` independent matrices."""
        if not self.stacked:
            t = t.unsqueeze(0)
        E, rows, cols = t.shape
        h = self.heads
        if h == 1:
            return t
        if self.axis == 0:
            return t.reshape(E * h, rows // h, cols)
        return t.reshape(E, rows, h, cols // h).permute(0, 2, 1, 3).reshape(E * h, rows, cols // h)

    def from_blocks(self, blocks: Tensor, shape: torch.Size) -> Tensor:
        h = self.heads
        E = shape[0] if self.stacked else 1
        rows, cols = shape[-2], shape[-1]
        if h == 1 or self.axis == 0:
            return blocks.reshape(shape)
        return blocks.reshape(E, h, rows, cols // h).permute(0, 2, 1, 3).reshape(shape)

    def block_shape(self, shape: torch.Size) -> tuple[int, int]:
        rows, cols = shape[-2], shape[-1]
        return (rows // self.heads, cols) if self.axis == 0 else (rows, cols // self.heads)

    def check(self, name: str, shape: torch.Size) -> None:
        want = 3 if self.stacked else 2
        if len(shape) != want:
            raise ValueError(f"{name}: layout {self} needs a {want}-D parameter, got shape {tuple(shape)}")
        if self.axis not in (0, 1) or shape[-2 + self.axis] % self.heads:
            raise ValueError(f"{name}: {self.heads} head blocks do not divide axis {self.axis} of shape {tuple(shape)}")


class HasMatrixLayouts(nn.Module):
    """A module that declares the matrix layouts of some of its own parameters (names relative to it)."""

    def muon_layouts(self) -> dict[str, MatrixLayout]:
        """Parameter name -> layout, for parameters that are not one plain matrix; {} by default."""
        return {}
