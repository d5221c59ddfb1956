"""Deliberate failures for testing crash safety, selected through config and never present otherwise.

``FaultInjection``: SIGKILL every rank right after micro-batch N of the run (0-based position in the
training stream) has run its forward and backward -- with gradient accumulation, possibly in the middle
of an optimizer step. A resumed run (which starts past N) never triggers it again::

    python train.py ... '+callbacks.kill={_target_: runtime.callbacks.fault_injection.FaultInjection, kill_after: 5}'

``DiskFull``: the disk fills up during the run's Nth checkpoint write (1-based; a periodic checkpoint and
``last.ckpt`` are one write each): part of the file is written, then the write fails with ``ENOSPC``::

    python train.py ... '+callbacks.full={_target_: runtime.callbacks.fault_injection.DiskFull, at_write: 3}'
"""

from __future__ import annotations

import errno
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


class DiskFull(L.Callback):
    def __init__(self, at_write: int):
        self.at_write = at_write
        self.writes = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        io = trainer.strategy.checkpoint_io
        if getattr(io, "filled_by", None) is self:  # setup runs again for the final validation
            return
        write = io.write_file  # runtime/checkpoints/write.py's AtomicCheckpointIO

        def write_or_fill_up(checkpoint: dict, path: str) -> None:
            self.writes += 1
            if self.writes != self.at_write:
                return write(checkpoint, path)
            with open(path, "wb") as f:
                f.write(b"PK\x03\x04" + bytes(4096))  # the start of a checkpoint, then no space
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

        io.write_file, io.filled_by = write_or_fill_up, self
