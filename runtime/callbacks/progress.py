"""The training progress bar: optimizer steps against the run's planned steps, with an ETA.

Lightning's own bars count micro-batches of an epoch; the datasets here are endless, so they read
"Epoch 0/-2" and cannot know how long the run is. This bar counts optimizer steps (what
``trainer.max_steps`` / ``trainer.max_tokens`` plan), starts at the resumed step, and estimates the
remaining time from this process's recent speed (an exponential moving average over updates, so the
compile time of the first steps fades out of the estimate).
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar


class StepProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, counting optimizer steps of the whole run instead of batches of an epoch."""

    def init_train_tqdm(self) -> Any:
        bar = super().init_train_tqdm()
        bar.bar_format = "{l_bar}{bar}| step {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
        bar.set_description("train")
        bar.smoothing = 0.1  # tqdm's moving-average weight of the latest rate (Lightning sets 0: since start)
        bar.unit = "step"
        return bar

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        bar = self.train_progress_bar
        bar.reset(total=trainer.max_steps)
        bar.initial = bar.n = trainer.global_step  # a resumed run: the rate counts this process's steps only
        bar.last_print_n = trainer.global_step
        bar.set_description("train")

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        bar = self.train_progress_bar
        step = trainer.global_step
        if bar is None or bar.disable or step == bar.n:
            return  # a micro-batch inside gradient accumulation
        if step % self.refresh_rate == 0 or step == trainer.max_steps:
            bar.update(step - bar.n)
            bar.set_postfix(self.get_metrics(trainer, pl_module))

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics
