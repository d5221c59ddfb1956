"""Routed mixture-of-experts FFNs: ``moe`` (full width), ``latent_moe``, ``stable_latent_moe`` (K3).

Parameter names follow the K3 reference (``KimiSparseMoeBlock``, docs/k3.md §4.2/4.3):

* ``gate.weight [E, d]`` (router, fp32) and ``gate.e_score_correction_bias [E]`` (buffer)
* ``experts.w1 / w3 [E, m, d_e]``, ``experts.w2 [E, d_e, m]`` (K3 ``experts.{i}.w1.weight`` = ``w1[i]``)
* ``shared_experts.{gate_proj, up_proj, down_proj}``: ONE full-width GLU of hidden ``num_shared * m``
* latent variants: ``routed_expert_down_proj [d_l, d]``, ``routed_expert_up_proj [d, d_l]``
* stable variant: ``routed_expert_norm.weight [d_l]`` (RMSNorm, eps 1e-5)

Forward (x = the normed FFN input, full width)::

    idx, w = gate(x)                               # router always reads full-width x
    z = routed_expert_down_proj(x)                 # latent variants; z = x otherwise
    u = sum_{j in idx} w_j * experts_j(z)          # fp32 weighting, cast back
    u = routed_expert_norm(u)                      # stable variant: on the aggregated routed output
    y = routed_expert_up_proj(u) + shared_experts(x)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from components.ffn.base import FFN
from components.ffn.dense import GLUMLP
from components.ffn.experts import DISPATCH_CHOICES, RoutedExperts
from components.ffn.glu_activation import GLUActivationConfig
from components.ffn.router import ROUTER_ACTIVATIONS, Router
from components.nn.build_context import BuildContext
from components.nn.rmsnorm import RMSNorm
from components.registry import FFNS, ConfigError

ROUTED_EXPERT_NORM_EPS = 1e-5  # K3 rms_norm_eps


@dataclass
class MoEFFNConfig(GLUActivationConfig):
    name: str = "moe"
    num_experts: int = 8
    top_k: int = 2
    # per-expert hidden width m (K3: 3072)
    expert_hidden_dim: int = 128
    # shared experts are fused into one GLU of hidden num_shared_experts * expert_hidden_dim (0 = none)
    num_shared_experts: int = 1
    router_activation: str = "sigmoid"
    # renormalise the chosen experts' scores to sum to 1 (when top_k > 1)
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    # None: dropless; else each expert takes at most ceil(capacity_factor * tokens * top_k / num_experts)
    capacity_factor: Optional[float] = None
    # expert dispatch backend: auto (grouped_mm where it applies and is trusted, else blocked), grouped_mm,
    # blocked, padded_bmm, loop
    dispatch: str = "auto"

    def validate(self, model: Any, key: str) -> None:
        self.validate_activation(key)
        if self.num_experts < 1:
            raise ConfigError(f"{key}.num_experts", f"must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"{key}.top_k", f"must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.expert_hidden_dim < 1:
            raise ConfigError(f"{key}.expert_hidden_dim", f"must be >= 1, got {self.expert_hidden_dim}")
        if self.num_shared_experts < 0:
            raise ConfigError(f"{key}.num_shared_experts", f"must be >= 0, got {self.num_shared_experts}")
        if self.router_activation not in ROUTER_ACTIVATIONS:
            raise ConfigError(
                f"{key}.router_activation",
                f"must be one of {', '.join(ROUTER_ACTIVATIONS)}, got '{self.router_activation}'",
            )
        if not self.routed_scaling_factor > 0:
            raise ConfigError(f"{key}.routed_scaling_factor", f"must be positive, got {self.routed_scaling_factor}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ConfigError(
                f"{key}.capacity_factor", f"must be positive or null (dropless), got {self.capacity_factor}"
            )
        if self.dispatch not in DISPATCH_CHOICES:
            raise ConfigError(f"{key}.dispatch", f"must be one of {', '.join(DISPATCH_CHOICES)}, got '{self.dispatch}'")


@dataclass
class LatentMoEConfig(MoEFFNConfig):
    name: str = "latent_moe"
    # width the routed experts work in (K3: 3584 = d_model / 2); None = d_model // 2
    latent_dim: Optional[int] = None

    def resolved_latent_dim(self, d_model: int) -> int:
        return self.latent_dim if self.latent_dim is not None else d_model // 2

    def validate(self, model: Any, key: str) -> None:
        super().validate(model, key)
        d_model = model.d_model
        if self.resolved_latent_dim(d_model) < 1:
            what = (
                f"got {self.latent_dim}" if self.latent_dim is not None else f"null gives d_model // 2 = {d_model // 2}"
            )
            raise ConfigError(f"{key}.latent_dim", f"must be >= 1 ({what})")


@dataclass
class StableLatentMoEConfig(LatentMoEConfig):
    name: str = "stable_latent_moe"


@FFNS.register("moe", MoEFFNConfig)
class MoEFFN(FFN):
    """Routed GLU experts (sigmoid top-k router with selection bias) + shared experts, full width."""

    latent = False
    stable = False
    # the router's balancing statistics (and data-sized expert dispatches) are eager islands: compiled per layer
    compile_friendly = False

    def __init__(
        self,
        cfg: MoEFFNConfig,
        ctx: BuildContext,
    ):
        super().__init__(cfg, ctx)
        d_model, init_std, out_init_std = ctx.d_model, ctx.init_std, ctx.out_init_std
        out_std = out_init_std or init_std
        act = cfg.activation_fn()
        d_e = cfg.resolved_latent_dim(d_model) if self.latent else d_model
        self.gate = Router(
            d_model,
            cfg.num_experts,
            cfg.top_k,
            cfg.router_activation,
            cfg.renormalize,
            cfg.routed_scaling_factor,
            init_std,
            ctx.layer_idx,
        )
        if self.latent:
            self.routed_expert_down_proj = nn.Linear(d_model, d_e, bias=False)
            nn.init.normal_(self.routed_expert_down_proj.weight, std=init_std)
        # the expert down-projection writes the residual stream only in the full-width variant
        self.experts = RoutedExperts(
            cfg.num_experts,
            d_e,
            cfg.expert_hidden_dim,
            act,
            init_std,
            init_std if self.latent else out_std,
            cfg.capacity_factor,
            cfg.dispatch,
        )
        if self.stable:
            self.routed_expert_norm = RMSNorm(d_e, ROUTED_EXPERT_NORM_EPS)
        if self.latent:
            self.routed_expert_up_proj = nn.Linear(d_e, d_model, bias=False)
            nn.init.normal_(self.routed_expert_up_proj.weight, std=out_std)
        self.shared_experts = (
            GLUMLP(d_model, cfg.num_shared_experts * cfg.expert_hidden_dim, act, init_std, out_std)
            if cfg.num_shared_experts > 0
            else None
        )

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed path alone: ``[..., d] -> [..., d]`` (without the shared experts)."""
        h = x.reshape(-1, x.shape[-1])  # [N, d]
        indices, weights, _ = self.gate(x)  # [N, k], [N, k] fp32; x keeps [B, T] for sequence-wise stats
        z = self.routed_expert_down_proj(h) if self.latent else h  # [N, d_e]
        u = self.experts(z, indices, weights)  # [N, d_e]
        if self.stable:
            u = self.routed_expert_norm(u)
        y = self.routed_expert_up_proj(u) if self.latent else u  # [N, d]
        return y.view_as(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.routed(x)  # [B, T, d]
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y

    def active_params(self) -> int:
        """Parameters one token multiplies by: everything except the unchosen experts.

        The selection bias is a buffer and not counted (K3's reference keeps it as a parameter: add E).
        """
        return self.num_params() - self.unchosen_expert_params()

    def unchosen_expert_params(self) -> int:
        return (self.cfg.num_experts - self.cfg.top_k) * self.experts.expert_params()

    def routed_experts(self) -> RoutedExperts:
        return self.experts

    def router(self) -> Router:
        return self.gate

    def latent_projections(self) -> Optional[tuple[nn.Module, nn.Module]]:
        return (self.routed_expert_down_proj, self.routed_expert_up_proj) if self.latent else None


@FFNS.register("latent_moe", LatentMoEConfig)
class LatentMoEFFN(MoEFFN):
    """LatentMoE: routed experts in a latent width between down/up projections; router and shared experts full width."""

    latent = True


@FFNS.register("stable_latent_moe", StableLatentMoEConfig)
class StableLatentMoEFFN(LatentMoEFFN):
    """K3 Stable LatentMoE: LatentMoE + RMSNorm on the aggregated routed output before the up-projection."""

    stable = True
