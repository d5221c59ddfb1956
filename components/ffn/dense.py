"""Dense GLU feed-forward: ``down_proj(act(gate_proj(x), up_proj(x)))``.

Parameter names follow the K3 reference (``gate_proj``, ``up_proj``, ``down_proj``), so the same
module serves as K3's dense first-layer FFN and as its shared experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from components.ffn.base import FFN
from components.ffn.glu_activation import GLUActivationConfig
from components.nn.build_context import INIT_STD, BuildContext
from components.registry import FFNS, ConfigError


def default_hidden_dim(d_model: int, multiple: int = 64) -> int:
    """8/3 * d_model rounded up to a multiple (the parameter count of a 4 * d_model non-gated MLP)."""
    return multiple * -(-(8 * d_model // 3) // multiple)


@dataclass
class DenseFFNConfig(GLUActivationConfig):
    name: str = "dense"
    # None: 8/3 * d_model rounded up to a multiple of 64
    hidden_dim: Optional[int] = None

    def validate(self, model: Any, key: str) -> None:
        self.validate_activation(key)
        if self.hidden_dim is not None and self.hidden_dim <= 0:
            raise ConfigError(f"{key}.hidden_dim", f"must be positive, got {self.hidden_dim}")


class GLUProjections:
    """``down_proj(act(gate_proj(x), up_proj(x)))`` with bias-free projections, for an ``nn.Module``."""

    def _build_glu(
        self, d_model: int, hidden_dim: int, act: Any, init_std: float, out_init_std: Optional[float]
    ) -> None:
        self.act = act
        self.gate_proj = nn.Linear(d_model, hidden_dim, bias=False)
        self.up_proj = nn.Linear(d_model, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, d_model, bias=False)
        nn.init.normal_(self.gate_proj.weight, std=init_std)
        nn.init.normal_(self.up_proj.weight, std=init_std)
        nn.init.normal_(self.down_proj.weight, std=out_init_std or init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class GLUMLP(GLUProjections, nn.Module):
    """A GLU MLP as a building block (MoE shared experts)."""

    def __init__(
        self, d_model: int, hidden_dim: int, act: Any, init_std: float = INIT_STD, out_init_std: Optional[float] = None
    ):
        nn.Module.__init__(self)
        self._build_glu(d_model, hidden_dim, act, init_std, out_init_std)


@FFNS.register("dense", DenseFFNConfig)
class DenseFFN(GLUProjections, FFN):
    """Dense GLU FFN (SwiGLU, SiTU-GLU or GLU)."""

    def __init__(
        self,
        cfg: DenseFFNConfig,
        ctx: BuildContext,
    ):
        FFN.__init__(self, cfg, ctx)
        d_model = ctx.d_model
        self._build_glu(
            d_model, cfg.hidden_dim or default_hidden_dim(d_model), cfg.activation_fn(), ctx.init_std, ctx.out_init_std
        )
