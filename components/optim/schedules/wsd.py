"""Warmup-stable-decay: the peak until the last ``decay_fraction`` of the run, then a decay to
``min_lr_ratio`` shaped ``linear``, ``cosine`` or ``sqrt``.

Its stable phase does not depend on the run's length, so one long stable run can branch into cooldowns
of several lengths (``init_from``), each equal to a run trained at that length from the start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from components.optim.schedules.base import DECAY_SHAPES, SCHEDULES, DecayingScheduleConfig, Schedule, shaped
from components.registry import ConfigError


@dataclass
class WSDConfig(DecayingScheduleConfig):
    name: str = "wsd"
    # the share of all steps spent decaying, and the decay's shape (linear, cosine, sqrt)
    decay_fraction: float = 0.2
    decay_shape: str = "linear"

    def validate(self, model: Any, key: str) -> None:
        super().validate(model, key)
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError(f"{key}.decay_fraction", f"must be in (0, 1], got {self.decay_fraction}")
        if self.decay_shape not in DECAY_SHAPES:
            raise ConfigError(
                f"{key}.decay_shape", f"'{self.decay_shape}' is not allowed; choose one of {', '.join(DECAY_SHAPES)}"
            )


def decay_start(total: int, warmup: int, decay_fraction: float) -> int:
    """The first step of the decay: the last ``decay_fraction`` of ``total`` steps, never before the
    warmup ends."""
    return max(warmup, total - int(round(decay_fraction * total)))


@SCHEDULES.register("wsd", WSDConfig, "Warmup, the peak, then a decay over the last decay_fraction of the run.")
class WSD(Schedule):
    def after_warmup(self, step: int, warmup: int, total: int) -> float:
        start = decay_start(total, warmup, self.cfg.decay_fraction)
        if step < start:
            return 1.0
        return shaped(min(1.0, (step - start) / max(1, total - start)), self.cfg.decay_shape, self.cfg.min_lr_ratio)
