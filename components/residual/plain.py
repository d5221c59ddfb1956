"""Plain pre-norm residual stream: ``x <- x + sublayer(norm(x))``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from components.config import ComponentConfig
from components.registry import RESIDUALS
from components.residual.base import ResidualScheme


@dataclass
class PlainResidualConfig(ComponentConfig):
    name: str = "plain"


@RESIDUALS.register("plain", PlainResidualConfig)
class PlainResidual(ResidualScheme):
    """Pre-norm residual: every sublayer adds its output to one running sum."""

    def start(self, x0: torch.Tensor) -> torch.Tensor:
        return x0

    def read(self, state: torch.Tensor, sublayer: int, norm: Optional[nn.Module] = None) -> torch.Tensor:
        return state if norm is None else norm(state)

    def write(self, state: torch.Tensor, sublayer: int, out: torch.Tensor) -> torch.Tensor:
        return state + out

    def finish(self, state: torch.Tensor, norm: Optional[nn.Module] = None) -> torch.Tensor:
        return state if norm is None else norm(state)
