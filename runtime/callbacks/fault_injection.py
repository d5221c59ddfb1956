"""Deliberate crashes for testing crash safety: SIGKILL every rank right after micro-batch N of the
run (0-based position in the training stream) has run its forward and backward -- with gradient
accumulation, possibly in the middle of an optimizer step.

Selected through config, never present otherwise::

    python train.py ... '+callbacks.kill={_target_: runtime.callbacks.fault_injection.FaultInjection, kill_after: 5}'

A resumed run (which starts past N) never triggers it again.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import lightning as L


class FaultInjection(L.Callback):
    def __init__(self, kill_after: int):
        self.kill_after = kill_after
        self.position = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.position = trainer.datamodule.start_batch if trainer.datamodule is not None else 0

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.position == self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        self.position += 1
