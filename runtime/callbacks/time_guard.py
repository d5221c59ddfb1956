"""The wall-time guard: Lightning's ``Timer``, restarted by every process.

Lightning's own timer keeps its elapsed time in the checkpoint, so a run the guard ended would stop again
at its first step when resumed. The guard is there to bound one process on a slow or busy machine, not
the run's whole life: resuming with ``ckpt_path=last`` gets a full guard and finishes the run.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Timer


class TimeGuard(Timer):
    """Stops training after ``minutes`` of this process's wall time (checked after each step)."""

    def __init__(self, minutes: float):
        super().__init__(duration={"minutes": minutes}, interval="step")
        self.minutes = minutes

    @property
    def ran_out(self) -> bool:
        return (self.time_remaining() or 0.0) <= 0

    def state_dict(self) -> dict[str, Any]:
        return {}  # nothing carried into a resumed run: each process gets the whole guard

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass
