"""A Lightning logger that appends every logged metric to ``metrics.jsonl`` in the run folder.

One JSON object per logging call (``{"step": ..., "train/loss": ...}``), flushed at once, so the file
is readable while the run goes on and after a crash; the analysis tools read it when W&B is absent. A
resumed run appends to the file and leaves out what it already holds: a step repeated after the
checkpoint, a final validation at the step of the last one (``runtime/metric_ledger.py``), so each step's
training and validation record appears once, in order.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional

from lightning.pytorch.loggers.logger import Logger, rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only

from runtime.json_records import read_json_lines
from runtime.metric_ledger import MetricLedger


class JSONLLogger(Logger):
    def __init__(self, save_dir: str, name: str = "run", version: str = "0"):
        super().__init__()
        self._save_dir = save_dir
        self._name = name
        self._version = version
        self.path = os.path.join(save_dir, "metrics.jsonl")
        self.ledger = MetricLedger.from_metrics_file(self.path)

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> str:
        return self._version

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        return self

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        os.makedirs(self._save_dir, exist_ok=True)
        with open(os.path.join(self._save_dir, "hparams.json"), "w") as f:
            json.dump(params if isinstance(params, Mapping) else vars(params), f, indent=1, default=str)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        if not self.ledger.is_new(step, metrics):
            return
        os.makedirs(self._save_dir, exist_ok=True)
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: str) -> list[dict[str, float]]:
    """Records of a ``metrics.jsonl`` file (a torn line from a crash is skipped)."""
    return read_json_lines(path)
