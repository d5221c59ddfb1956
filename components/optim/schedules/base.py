"""The schedule contract: the multiplier of the peak learning rate at each optimizer step.

Every schedule starts with a linear warmup over the optimizer's ``warmup_steps`` (how long a warmup an
optimizer needs is part of its tuning: Muon 30, AdamW 100) and then follows its own decay. A member is
one module with a config dataclass (subclassing ``ScheduleConfig``) and a ``Schedule`` subclass
registered with ``SCHEDULES``; ``conf/schedule/<name>.yaml`` selects it. The multiplier is a function
of the step alone, so a run's result never depends on the machine's speed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from components.config import ComponentConfig
from components.registry import ConfigError, Registry

SCHEDULES = Registry("schedule", "schedule", "components.optim.schedules", "components.optim.schedules.base:Schedule")
DECAY_SHAPES = ("linear", "cosine", "sqrt")


@dataclass
class ScheduleConfig(ComponentConfig):
    pass


@dataclass
class DecayingScheduleConfig(ScheduleConfig):
    # the decay ends at lr * min_lr_ratio
    min_lr_ratio: float = 0.1

    def validate(self, model: Any, key: str) -> None:
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"{key}.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")


def shaped(progress: float, shape: str, min_ratio: float) -> float:
    """A decay from 1 at ``progress`` 0 to ``min_ratio`` at 1: linear, cosine, or sqrt (1 - sqrt(progress):
    most of the drop early)."""
    if shape == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    if shape == "sqrt":
        return 1.0 - (1.0 - min_ratio) * math.sqrt(progress)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class Schedule:
    """Base class of every registered schedule: ``Schedule(cfg)``, then ``multiplier(step, warmup, total)``."""

    def __init__(self, cfg: ScheduleConfig):
        self.cfg = cfg

    def multiplier(self, step: int, warmup: int, total: int) -> float:
        """Multiplier of the peak learning rate at ``step`` (0-based) of ``total``: linear warmup, then
        ``after_warmup``."""
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        return self.after_warmup(step, warmup, total)

    def after_warmup(self, step: int, warmup: int, total: int) -> float:
        raise NotImplementedError
