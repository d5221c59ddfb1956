"""A W&B logger that can fail without taking the training run down with it."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.loggers import WandbLogger


class SafeWandbLogger(WandbLogger):
    """WandbLogger whose failures after start-up switch W&B off for the rest of the run (with one
    warning) instead of raising into the training loop; the local metrics.jsonl keeps every metric."""

    broken = False

    def guarded(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self.broken:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as err:  # network, quota, auth: none of them is worth a lost run
            self.broken = True
            print(
                f"warning: W&B {what} failed ({type(err).__name__}: {err}); W&B logging is off for the rest of this "
                "run, metrics.jsonl has everything"
            )
            return None

    def log_metrics(self, metrics: Any, step: Any = None) -> None:
        self.guarded("logging", super().log_metrics, metrics, step)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self.guarded("config logging", super().log_hyperparams, params, *args, **kwargs)

    def finalize(self, status: str) -> None:
        self.guarded("finalize", super().finalize, status)

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        self.guarded("checkpoint bookkeeping", super().after_save_checkpoint, checkpoint_callback)
