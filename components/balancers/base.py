"""The protocol every load balancer follows.

Routed FFN layers report their router statistics; a balancer turns them into an auxiliary loss term
(added to the training loss) and/or a selection-bias update applied once per optimizer step, after the
statistics of the whole step (all micro-batches, all data-parallel ranks) are known. A model without
routed layers simply never calls it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from components.balancers.load_stats import finish_step


class Balancer(nn.Module):
    def __init__(self, cfg: Any):
        super().__init__()
        self.cfg = cfg

    def attach(self, model: nn.Module) -> None:
        """Called once after the model is built, before the first forward (e.g. to turn on the
        router statistics this balancer needs)."""

    def aux_loss(self, model: nn.Module) -> Optional[torch.Tensor]:
        """Loss term for the current micro-batch, or None."""
        return None

    def step(self, model: nn.Module) -> dict[str, float]:
        """Called after each optimizer step; returns metrics to log (MaxVio of every routed layer)."""
        return finish_step(model)
