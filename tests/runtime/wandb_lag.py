"""A W&B writer that has fallen behind, for resume tests: the last ``rows`` history rows are held back
(written only once ``rows`` newer ones arrive), so a SIGKILL loses them as a lagging writer process would::

    '+callbacks.lag={_target_: tests.runtime.wandb_lag.LaggingWandbWriter, rows: 5}'
"""

from __future__ import annotations

from typing import Any

import lightning as L

from runtime.safe_wandb import SafeWandbLogger


class LaggingWandbWriter(L.Callback):
    def __init__(self, rows: int):
        self.rows = rows
        self.held: list[tuple[dict[str, Any], int]] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, SafeWandbLogger) and not getattr(logger, "lagging", False):
                write = logger.write_row

                def lagging(metrics: dict[str, Any], step: int, write: Any = write) -> None:
                    self.held.append((metrics, step))
                    if len(self.held) > self.rows:
                        write(*self.held.pop(0))

                logger.write_row = lagging
                logger.lagging = True
