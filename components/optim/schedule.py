"""Learning-rate schedules: the multiplier of the peak learning rate at each optimizer step.

All start with a linear warmup. Then:

* ``cosine`` / ``linear``: decay from the peak to ``min_ratio`` over every remaining step;
* ``constant``: the peak throughout;
* ``wsd`` (warmup-stable-decay): the peak until the last ``decay_fraction`` of the run, then a decay to
  ``min_ratio`` shaped ``linear``, ``cosine`` or ``sqrt`` (1 - sqrt(progress): most of the drop early).
  Its stable phase does not depend on the run's length, so one long stable run can branch into
  cooldowns of several lengths (``init_from``), each equal to a run trained at that length from the start.
"""

from __future__ import annotations

import math

SCHEDULES = ("cosine", "constant", "linear", "wsd")
DECAY_SHAPES = ("linear", "cosine", "sqrt")


def decay_start(total: int, warmup: int, decay_fraction: float) -> int:
    """The first step of a WSD schedule's decay: the last ``decay_fraction`` of ``total`` steps, never
    before the warmup ends."""
    return max(warmup, total - int(round(decay_fraction * total)))


def _shaped(progress: float, shape: str, min_ratio: float) -> float:
    if shape == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    if shape == "sqrt":
        return 1.0 - (1.0 - min_ratio) * math.sqrt(progress)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_lambda(
    step: int,
    warmup: int,
    total: int,
    schedule: str,
    min_ratio: float,
    decay_fraction: float = 0.2,
    decay_shape: str = "linear",
) -> float:
    """Multiplier of the peak learning rate at ``step`` of ``total``: linear warmup, then the chosen
    decay. A function of the step alone, so a run's result never depends on the machine's speed."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    if schedule == "wsd":
        start = decay_start(total, warmup, decay_fraction)
        if step < start:
            return 1.0
        return _shaped(min(1.0, (step - start) / max(1, total - start)), decay_shape, min_ratio)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return _shaped(progress, "linear" if schedule == "linear" else "cosine", min_ratio)
