"""Cosine decay from the peak to ``min_lr_ratio`` over every step after the warmup."""

from __future__ import annotations

from dataclasses import dataclass

from components.optim.schedules.base import SCHEDULES, DecayingScheduleConfig, Schedule, shaped


@dataclass
class CosineConfig(DecayingScheduleConfig):
    name: str = "cosine"


@SCHEDULES.register("cosine", CosineConfig, "Warmup, then a cosine decay to lr * min_lr_ratio at the last step.")
class Cosine(Schedule):
    def after_warmup(self, step: int, warmup: int, total: int) -> float:
        return shaped(min(1.0, (step - warmup) / max(1, total - warmup)), "cosine", self.cfg.min_lr_ratio)
