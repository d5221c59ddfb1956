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
  it decays (matrices not marked ``_no_weight_decay``), 0 on the rest, stated per parameter group;
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
from components.optim.schedule import DECAY_SHAPES, SCHEDULES
from components.registry import ConfigError


@dataclass
class OptimizerConfig(ComponentConfig):
    lr: float = 3e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 100
    # after warmup: cosine or linear decay from lr to lr * min_lr_ratio over the remaining steps,
    # constant, or wsd (warmup-stable-decay: lr until the last decay_fraction of the run, then a
    # decay_shape decay to lr * min_lr_ratio) (components/optim/schedule.py)
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    # wsd only: the share of all steps spent decaying, and the decay's shape (linear, cosine, sqrt)
    decay_fraction: float = 0.2
    decay_shape: str = "linear"

    def validate(self, model: Any, key: str) -> None:
        if not self.lr > 0:
            raise ConfigError(f"{key}.lr", f"must be positive, got {self.lr}")
        if not (len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas)):
            raise ConfigError(f"{key}.betas", f"must be two numbers in [0, 1), got {list(self.betas)}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"{key}.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0:
            raise ConfigError(f"{key}.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(
                f"{key}.schedule", f"'{self.schedule}' is not allowed; choose one of {', '.join(SCHEDULES)}"
            )
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError(f"{key}.decay_fraction", f"must be in (0, 1], got {self.decay_fraction}")
        if self.decay_shape not in DECAY_SHAPES:
            raise ConfigError(
                f"{key}.decay_shape", f"'{self.decay_shape}' is not allowed; choose one of {', '.join(DECAY_SHAPES)}"
            )


class OptimizerFactory(Protocol):
    """A registered optimizer: ``OPTIMIZERS.register(name, ConfigCls, summary)(build)``."""

    def __call__(self, cfg: OptimizerConfig, model: nn.Module) -> torch.optim.Optimizer: ...
