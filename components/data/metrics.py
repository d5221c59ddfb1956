"""What a dataset reports at validation: its metric contract, and the one bits-per-byte formula.

A ``MetricContract`` names the metrics validation logs (``val/<name>``), the primary one a run is judged
by, and whether higher is better; the run summary records it, and ``analysis.compare`` ranks runs by it.

Bits per byte = (summed next-token loss over the counted targets) / ln 2 / (the bytes those targets
stand for). A dataset's ``ByteAccounting`` says, per token id, how many bytes it stands for and whether
its loss counts: the byte corpus counts only byte targets (its file separator is trained on but is not a
byte); prepared text counts every target, end-of-document tokens standing for no bytes (a model pays for
knowing where documents end, as a compressor does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from components.objective import IGNORE_INDEX


@dataclass(frozen=True)
class MetricContract:
    # the metric a run is judged by (a key of the validation metrics)
    primary: str
    higher_is_better: bool = False
    # the validation metrics reported (per-source or per-segment breakdowns add ``<name>/<metric>`` keys)
    reports: tuple[str, ...] = ("loss", "ppl")

    def record(self) -> dict[str, Any]:
        """The contract as the run summary stores it (``summary.json["metric"]``)."""
        return {"primary": self.primary, "higher_is_better": self.higher_is_better, "reports": list(self.reports)}

    @classmethod
    def from_record(cls, record: Optional[dict[str, Any]]) -> "MetricContract":
        """The contract a summary recorded; a summary without one reports the loss only."""
        if not record:
            return LOSS
        return cls(record["primary"], bool(record["higher_is_better"]), tuple(record.get("reports", ())))

    def best(self, values: list[float]) -> Optional[float]:
        return (max(values) if self.higher_is_better else min(values)) if values else None


LOSS = MetricContract("loss")
BITS_PER_BYTE = MetricContract("bpb", reports=("loss", "ppl", "bpb"))
ACCURACY = MetricContract("accuracy", higher_is_better=True, reports=("loss", "ppl", "accuracy"))


def bits_per_byte(loss_sum: float, num_bytes: float) -> float:
    """Summed loss in nats over the bytes it predicted -> bits per byte."""
    return loss_sum / max(num_bytes, 1e-9) / math.log(2)


class ByteAccounting:
    """Per token id: the bytes it stands for (``lengths [vocab]``, float64) and whether its loss counts
    toward bits per byte (``counted [vocab]``, bool; default every id)."""

    def __init__(self, lengths: torch.Tensor, counted: Optional[torch.Tensor] = None):
        self._tables = {"cpu": (lengths.double(), counted)}

    def _on(self, device: torch.device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        key = str(device)
        if key not in self._tables:
            lengths, counted = self._tables["cpu"]
            self._tables[key] = (lengths.to(device), None if counted is None else counted.to(device))
        return self._tables[key]

    def sums(self, targets: torch.Tensor, token_loss: torch.Tensor) -> dict[str, torch.Tensor]:
        """``targets``, ``token_loss`` ``[B, T]`` -> the counted loss and the bytes it predicted."""
        lengths, counted = self._on(targets.device)
        scored = targets != IGNORE_INDEX
        ids = targets.clamp(min=0)
        if counted is not None:
            scored = scored & counted[ids]
        return {"bpb_loss_sum": (token_loss * scored).sum(), "bytes": (lengths[ids] * scored).sum()}

    @staticmethod
    def finish(sums: dict[str, float]) -> float:
        return bits_per_byte(sums["bpb_loss_sum"], sums["bytes"])
