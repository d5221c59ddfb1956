"""One record per (step, kind) in a run's metric logs, across restarts.

A run's loggers (``metrics.jsonl`` and W&B) see the same logging calls in the same order. After a resume
from a checkpoint at step C, Lightning repeats the steps between C and the kill, and the final validation
can repeat the last one of training; the ledger remembers the records already logged (``metrics.jsonl``
from earlier processes, then this process's) so that every logger drops a repeat and both logs keep
each step's record exactly once, in order. A record's kind (``record_kind``): a validation's, the
depth-weight recorder's (logged at the same step), or a training step's.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping

from runtime.json_records import read_json_lines

RecordKey = tuple[int, str]


def record_kind(metrics: Iterable[str]) -> str:
    """``val`` (a validation's record, its activation probe included), ``depth`` (the depth-weight recorder's
    record of the same validation, logged on its own) or ``train``."""
    keys = list(metrics)
    if any(k.startswith("val/") for k in keys):
        return "val"
    return "depth" if any(k.startswith("depth/") for k in keys) else "train"


def record_key(step: Any, metrics: Mapping[str, Any]) -> RecordKey:
    return int(step if step is not None else -1), record_kind(k for k in metrics if k != "step")


class MetricLedger:
    """The records one logger has written so far: ``earlier`` (what the run's ``metrics.jsonl`` held when
    this process started) and this process's. Each logger keeps its own ledger from the same ``earlier``
    records; they see the same calls, so they keep and drop the same ones."""

    def __init__(self, earlier: list[dict[str, Any]] | None = None):
        self.earlier = list(earlier or [])
        self._seen: set[RecordKey] = {record_key(r.get("step"), r) for r in self.earlier}

    @classmethod
    def from_metrics_file(cls, path: str) -> "MetricLedger":
        return cls(read_json_lines(path) if os.path.exists(path) else [])

    def is_new(self, step: Any, metrics: Mapping[str, Any]) -> bool:
        """True the first time a (step, kind) is logged (then remembered), False for a repeat."""
        key = record_key(step, metrics)
        if key in self._seen:
            return False
        self._seen.add(key)
        return True
