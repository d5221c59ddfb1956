"""Learning-rate schedules: the multiplier of the peak learning rate at each optimizer step."""

from __future__ import annotations

import math

SCHEDULES = ("cosine", "constant", "linear")


def lr_lambda(step: int, warmup: int, total: int, schedule: str, min_ratio: float, time_fraction: float = 0.0) -> float:
    """Multiplier of the peak learning rate at ``step``: linear warmup, then the chosen decay.

    The decay follows whichever is further along, steps or ``time_fraction`` (the share of a time
    budget used so far), so a run capped by wall time still ends fully decayed on a slower machine.
    """
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, max((step - warmup) / max(1, total - warmup), time_fraction))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
