"""Dense GLU feed-forward: ``down_proj(act(gate_proj(x), up_proj(x)))``.

Parameter names follow the K3 reference (``gate_proj``, ``up_proj``, ``down_proj``), so the same
module serves as K3's dense first-layer FFN and as its shared experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from components.config import ComponentConfig
from components.ffn.base import FFN
from components.nn.build_context import INIT_STD, BuildContext
from components.ops.activations import GLU_ACTIVATIONS, glu_activation
from components.ops.backend import allowed_backends
from components.registry import FFNS, ConfigError


@dataclass
class GLUActivationConfig(ComponentConfig):
    """Activation fields shared by every FFN: ``glu``, ``swiglu`` or ``situ_glu`` (K3)."""

    activation: str = "situ_glu"
    # SiTU-GLU softcaps: gate cap beta (K3: 4) and value cap linear_beta (K3: 25; None = uncapped)
    situ_beta: float = 4.0
    situ_linear_beta: Optional[float] = 25.0
    # SiTU-GLU back-end: torch (reference), triton (fused kernel, CUDA) or auto (components/ops/backend.py)
    activation_backend: str = "auto"

    def activation_fn(self):
        if self.activation == "situ_glu":
            return glu_activation(
                "situ_glu", beta=self.situ_beta, linear_beta=self.situ_linear_beta, backend=self.activation_backend
            )
        return glu_activation(self.activation)

    def kernel_backends(self) -> dict[str, str]:
        return {"activation_backend": self.activation_backend} if self.activation == "situ_glu" else {}

    def validate_activation(self, key: str) -> None:
        if self.activation not in GLU_ACTIVATIONS:
            raise ConfigError(
                f"{key}.activation",
                f"unknown activation '{self.activation}'; choose one of {', '.join(sorted(GLU_ACTIVATIONS))}",
            )
        if self.situ_beta <= 0:
            raise ConfigError(f"{key}.situ_beta", f"must be positive, got {self.situ_beta}")
        if self.situ_linear_beta is not None and self.situ_linear_beta <= 0:
            raise ConfigError(f"{key}.situ_linear_beta", f"must be positive or null, got {self.situ_linear_beta}")
        if self.activation_backend not in allowed_backends("situ_glu"):
            raise ConfigError(
                f"{key}.activation_backend",
                f"'{self.activation_backend}' is not allowed; choose one of {', '.join(allowed_backends('situ_glu'))}",
            )


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
