"""Loss-free balancing by a sign update of the selection bias (DeepSeek-V3 / K2), docs/k3.md §6.3.

After each optimizer step, per routed layer: ``b_j += u * sign(q - l_j)`` with ``l_j`` the load of expert j
summed over every micro-batch of the step and every data-parallel rank (one all-reduce), and
``q = sum_j l_j / E = M k / E`` the ideal load. Overloaded experts get a lower bias, underloaded ones a
higher one; an exactly balanced expert is left alone (sign 0). The bias is not centred (as in DeepSeek-V3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from components.balancers.base import Balancer
from components.balancers.load_stats import find_routers, maxvio_metrics, reduced_loads
from components.config import ComponentConfig
from components.registry import BALANCERS, ConfigError


@dataclass
class SignSGDConfig(ComponentConfig):
    name: str = "signsgd"
    # bias update speed u (DeepSeek-V3: 1e-3)
    update_rate: float = 1e-3

    def validate(self, model: Any, key: str) -> None:
        if not self.update_rate >= 0:
            raise ConfigError(f"{key}.update_rate", f"must be >= 0, got {self.update_rate}")


@BALANCERS.register("signsgd", SignSGDConfig)
class SignSGDBalancer(Balancer):
    """Loss-free balancing: bias += u * sign(ideal load - load) after every optimizer step."""

    @torch.no_grad()
    def step(self, model: nn.Module) -> dict[str, float]:
        routers = find_routers(model)
        if not routers:
            return {}
        loads, tokens = reduced_loads(routers)  # [L, E], [L]; identical on every rank
        metrics = maxvio_metrics(routers, loads, tokens)
        for i, r in enumerate(routers):
            if tokens[i] > 0:
                load = loads[i, : r.num_experts]  # [E]
                q = load.mean()  # = M k / E
                bias = r.e_score_correction_bias
                bias += (self.cfg.update_rate * torch.sign(q - load)).to(bias.dtype)
            r.reset_stats()
        return metrics
