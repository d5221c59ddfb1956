"""Dense GLU feed-forward: ``down_proj(act(gate_proj(x), up_proj(x)))``.

Parameter names follow the K3 reference (``gate_proj``, ``up_proj``, ``down_proj``), so the same
module serves as K3's dense first-layer FFN and as its shared experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from components.ops.activations import GLU_ACTIVATIONS, glu_activation
from components.registry import FFNS, ConfigError


@dataclass
class GLUActivationConfig:
    """Activation fields shared by every FFN: ``glu``, ``swiglu`` or ``situ_glu`` (K3)."""

    activation: str = "situ_glu"
    # SiTU-GLU softcaps: gate cap beta (K3: 4) and value cap linear_beta (K3: 25; None = uncapped)
    situ_beta: float = 4.0
    situ_linear_beta: Optional[float] = 25.0

    def activation_fn(self):
        if self.activation == "situ_glu":
            return glu_activation("situ_glu", beta=self.situ_beta, linear_beta=self.situ_linear_beta)
        return glu_activation(self.activation)

    def validate_activation(self, key: str) -> None:
        if self.activation not in GLU_ACTIVATIONS:
            raise ConfigError(f"{key}.activation", f"unknown activation '{self.activation}'; choose one of {', '.join(sorted(GLU_ACTIVATIONS))}")
        if self.situ_beta <= 0:
            raise ConfigError(f"{key}.situ_beta", f"must be positive, got {self.situ_beta}")
        if self.situ_linear_beta is not None and self.situ_linear_beta <= 0:
            raise ConfigError(f"{key}.situ_linear_beta", f"must be positive or null, got {self.situ_linear_beta}")


def default_hidden_dim(d_model: int, multiple: int = 64) -> int:
    """8/3 * d_model rounded up to a multiple (the parameter count of a 4 * d_model non-gated MLP)."""
    return multiple * -(-(8 * d_model // 3) // multiple)


@dataclass
class DenseFFNConfig(GLUActivationConfig):
    name: str = "dense"
    # None: 8/3 * d_model rounded up to a multiple of 64
    hidden_dim: Optional[int] = None

    def validate(self, root: Any, key: str) -> None:
        self.validate_activation(key)
        if self.hidden_dim is not None and self.hidden_dim <= 0:
            raise ConfigError(f"{key}.hidden_dim", f"must be positive, got {self.hidden_dim}")


class GLUMLP(nn.Module):
    """``down_proj(act(gate_proj(x), up_proj(x)))`` with bias-free projections."""

    def __init__(self, d_model: int, hidden_dim: int, act: Any, init_std: float = 0.02, out_init_std: Optional[float] = None):
        super().__init__()
        self.act = act
        self.gate_proj = nn.Linear(d_model, hidden_dim, bias=False)
        self.up_proj = nn.Linear(d_model, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, d_model, bias=False)
        nn.init.normal_(self.gate_proj.weight, std=init_std)
        nn.init.normal_(self.up_proj.weight, std=init_std)
        nn.init.normal_(self.down_proj.weight, std=out_init_std or init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


@FFNS.register("dense", DenseFFNConfig)
class DenseFFN(GLUMLP):
    """Dense GLU FFN (SwiGLU, SiTU-GLU or GLU)."""

    def __init__(self, cfg: DenseFFNConfig, d_model: int, layer_idx: int = 0, init_std: float = 0.02, out_init_std: Optional[float] = None):
        hidden = cfg.hidden_dim or default_hidden_dim(d_model)
        super().__init__(d_model, hidden, cfg.activation_fn(), init_std, out_init_std)
        self.cfg = cfg
        self.layer_idx = layer_idx

    def active_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
