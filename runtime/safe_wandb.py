"""A W&B logger that can fail without taking the training run down with it, and whose history is the
run's ``metrics.jsonl``, row for row, across restarts."""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only

from runtime.metric_ledger import MetricLedger
from runtime.wandb_offline import STEP_KEY

# the best value of these in the run's W&B summary, beside the last ("min" or "max")
BEST_OF = {"val/loss": "min", "val/bpb": "min", "val/ppl": "min", "val/accuracy": "max"}


class SafeWandbLogger(WandbLogger):
    """WandbLogger whose failures after start-up switch W&B off for the rest of the run (with one
    warning) instead of raising into the training loop; the local metrics.jsonl keeps every metric.

    Each logging call is one history row whose W&B step (``_step``) is the row's number in the run, so a
    resumed run's rows continue the earlier segments' numbering (offline too, where W&B cannot know it);
    ``ledger`` (the records ``metrics.jsonl`` held at start) drops the calls a resumed run repeats, as the
    JSONL logger does, and ``replay`` writes the earlier records W&B never received."""

    broken = False

    def __init__(self, *args: Any, ledger: Optional[MetricLedger] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.ledger = ledger or MetricLedger()
        self.next_row = 0
        self.replayed = 0

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

    # -- history --------------------------------------------------------------------------------------
    def write_row(self, metrics: dict[str, Any], step: int) -> None:
        """One history row at the trainer's ``step``, numbered after every row the run already has."""
        self.experiment.log({**metrics, STEP_KEY: step}, step=self.next_row)
        self.next_row += 1

    @rank_zero_only
    def log_metrics(self, metrics: Any, step: Any = None) -> None:
        if step is None or not self.ledger.is_new(step, metrics):
            return
        self.guarded("logging", self.write_row, dict(metrics), int(step))

    @rank_zero_only
    def start(self, rows_before: int, missing: list[dict[str, Any]]) -> None:
        """After the run has started: number rows from ``rows_before`` (what W&B already holds: earlier
        segments, or the server's count), then replay ``missing`` (``metrics.jsonl`` records it lacks)."""
        self.guarded("start", self._start, rows_before, missing)

    def _start(self, rows_before: int, missing: list[dict[str, Any]]) -> None:
        run = self.experiment
        self.next_row = max(rows_before, int(getattr(run, "step", 0) or 0))
        for key, best in BEST_OF.items():
            run.define_metric(key, step_metric=STEP_KEY, summary=f"{best},last")
        for record in missing:
            self.write_row({k: v for k, v in record.items() if k != "step"}, int(record["step"]))
            self.replayed += 1

    @rank_zero_only
    def finish_summary(self, summary: dict[str, Any]) -> None:
        """The run's whole ``summary.json`` record into its W&B summary (compute, precision, baselines,
        ``ended_by``, the metric contract, final validation, ...)."""
        if summary:
            self.guarded("summary", self.experiment.summary.update, dict(summary))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self.guarded("config logging", super().log_hyperparams, params, *args, **kwargs)

    def finalize(self, status: str) -> None:
        self.guarded("finalize", super().finalize, status)

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        self.guarded("checkpoint bookkeeping", super().after_save_checkpoint, checkpoint_callback)
