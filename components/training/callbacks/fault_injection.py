"""Deliberate crashes for testing crash safety: ``K3_KILL_AFTER_MICROBATCH=N`` SIGKILLs every rank
right after micro-batch N of the run (0-based position in the training stream) has run its forward
and backward -- with gradient accumulation, possibly in the middle of an optimizer step.

Only active when the variable is set; a resumed run (which starts past N) never triggers it again.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Optional

import lightning as L

KILL_ENV = "K3_KILL_AFTER_MICROBATCH"


class FaultInjection(L.Callback):
    def __init__(self, kill_after: Optional[int]):
        self.kill_after = kill_after
        self.position = 0

    @classmethod
    def from_env(cls) -> Optional["FaultInjection"]:
        value = os.environ.get(KILL_ENV)
        return cls(int(value)) if value else None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.position = trainer.datamodule.start_batch if trainer.datamodule is not None else 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.position == self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        self.position += 1
