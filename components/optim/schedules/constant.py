"""The peak learning rate after the warmup, to the end."""

from __future__ import annotations

from dataclasses import dataclass

from components.optim.schedules.base import SCHEDULES, Schedule, ScheduleConfig


@dataclass
class ConstantConfig(ScheduleConfig):
    name: str = "constant"


@SCHEDULES.register("constant", ConstantConfig, "Warmup, then the peak learning rate throughout.")
class Constant(Schedule):
    def after_warmup(self, step: int, warmup: int, total: int) -> float:
        return 1.0
