"""AdamW over every parameter, with decoupled weight decay on matrices only (``param_groups.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from components.optim.base import OptimizerConfig
from components.optim.param_groups import adamw_param_groups, unique_trainable
from components.registry import OPTIMIZERS


@dataclass
class AdamWConfig(OptimizerConfig):
    name: str = "adamw"


@OPTIMIZERS.register(
    "adamw",
    AdamWConfig,
    "AdamW on every parameter; weight decay on matrices, not on gains, biases or marked parameters.",
)
def build_adamw(cfg: AdamWConfig, model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        adamw_param_groups(model, unique_trainable(model), cfg.weight_decay),
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
    )
