"""The FFN contract: what the decoder, the optimizer, the reports and the trainer may call."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from components.nn.sublayer import Sublayer


class FFN(Sublayer):
    """Base class of every registered FFN (``FFNS.register``): ``forward(x [B, T, d]) -> [B, T, d]``.

    Constructor: ``FFN(cfg, ctx)`` with ``ctx`` a ``components.nn.build_context.BuildContext`` (as for mixers).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def active_params(self) -> int:
        """Weights one token multiplies by (all of them for a dense FFN)."""
        return self.num_params()

    # -- routed FFNs (analysis.model_report); None for dense FFNs -------------------------------------
    def routed_experts(self) -> Optional[nn.Module]:
        """The module holding the routed experts' weights, if any."""
        return None

    def router(self) -> Optional[nn.Module]:
        return None

    def unchosen_expert_params(self) -> int:
        """Stored parameters of the routed experts one token does not use."""
        return 0

    def latent_projections(self) -> Optional[tuple[nn.Module, nn.Module]]:
        """(down, up) projections around latent routed experts (LatentMoE); None otherwise."""
        return None
