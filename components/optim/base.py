"""The optimizer contract: what the training module, the checkpoints and the tests may rely on.

Optimizers are a registry family (``optimizer=adamw``, ``optimizer=muon``): each member is one module
with its own config dataclass (subclassing ``OptimizerConfig``) and a factory
``build(cfg, model) -> torch.optim.Optimizer`` (:class:`OptimizerFactory`) registered with
``OPTIMIZERS``. A field one optimizer does not have is an unknown key for it
(``optimizer=adamw optimizer.ns_steps=5`` is refused).

What the factory returns, every member alike (tests/contracts/test_optimizers.py checks each one):

* a ``torch.optim.Optimizer`` over every trainable parameter of the model exactly once (tied weights
  once), starting at ``cfg.lr`` in every parameter group, so one learning-rate schedule (a
  ``LambdaLR`` over all groups) drives it;
* ``step(closure)`` that calls the closure (forward and backward: Lightning's training step) and
  returns its loss;
* weight decay as ``components/optim/param_groups.py`` decides: ``cfg.weight_decay`` on the parameters
  it decays (matrices no module declares in ``no_weight_decay()``), 0 on the rest, stated per parameter group;
* a ``state_dict`` that loads into a freshly built optimizer of the same config and model (plain
  tensors and numbers, readable with ``torch.load(weights_only=True)``), after which training goes on
  exactly as without the round trip: checkpoints resume and branch through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from components.config import ComponentConfig
from components.registry import ConfigError


@dataclass
class OptimizerConfig(ComponentConfig):
    lr: float = 3e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    # linear warmup before the schedule's decay (the schedule group, components/optim/schedules/): how
    # long a warmup the optimizer needs is part of its tuning
    warmup_steps: int = 100

    def validate(self, model: Any, key: str) -> None:
        if not self.lr > 0:
            raise ConfigError(f"{key}.lr", f"must be positive, got {self.lr}")
        if not (len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas)):
            raise ConfigError(f"{key}.betas", f"must be two numbers in [0, 1), got {list(self.betas)}")
        if self.warmup_steps < 0:
            raise ConfigError(f"{key}.warmup_steps", f"must be >= 0, got {self.warmup_steps}")


class OptimizerFactory(Protocol):
    """A registered optimizer: ``OPTIMIZERS.register(name, ConfigCls, summary)(build)``."""

    def __call__(self, cfg: OptimizerConfig, model: nn.Module) -> torch.optim.Optimizer: ...
