"""Learning-rate schedules: the multiplier of the peak learning rate at each optimizer step."""

from __future__ import annotations

import math

SCHEDULES = ("cosine", "constant", "linear")


def lr_lambda(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at ``step`` of ``total``: linear warmup, then the chosen
    decay. A function of the step alone, so a run's result never depends on the machine's speed."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
