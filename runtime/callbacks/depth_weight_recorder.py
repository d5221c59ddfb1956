"""AttnRes depth weights: recorded during validation, logged as scalars and appended to ``depth_weights.json``.

For residual schemes that expose ``depth_weights()`` (``full_attnres``, ``block_attnres``) the callback
switches the scheme's ``record_weights`` on at validation start; at validation end it takes the matrix of
mean softmax weights (sublayers x sources, averaged over batch, positions and validation batches), logs
every entry as ``depth/<sublayer>/<source>`` (e.g. ``depth/L3.mlp/block1``) and appends
``{"step": ..., "sources": [...], "rows": [{"sublayer": "L0.attn", "weights": [...]}, ...]}`` to
``<run_dir>/depth_weights.json`` (``null`` where a read has no such source). Other schemes: no-op.
``python -m analysis.depth_weights RUN_DIR`` draws the heatmap.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Optional

import lightning as L
import torch

from components.residual.base import ResidualScheme

FILENAME = "depth_weights.json"


def find_scheme(module: torch.nn.Module) -> Optional[ResidualScheme]:
    """The first residual scheme among the submodules (the decoder's), or None."""
    for sub in module.modules():
        if isinstance(sub, ResidualScheme):
            return sub
    return None


def _key(label: str) -> str:
    return label.replace(" ", "")


class DepthWeights(L.Callback):
    """Records AttnRes depth weights over each validation and logs/stores their mean matrix.

    Args:
        run_dir: folder for ``depth_weights.json``; default ``trainer.default_root_dir``.
        log_scalars: also log every matrix entry through the trainer's loggers.
    """

    def __init__(self, run_dir: Optional[str] = None, log_scalars: bool = True):
        self.run_dir = run_dir
        self.log_scalars = log_scalars
        self.last: Optional[dict[str, Any]] = None

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        scheme = find_scheme(pl_module)
        if scheme is None:
            return
        scheme.reset_depth_weights()
        scheme.record_weights = True

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        scheme = find_scheme(pl_module)
        if scheme is None:
            return
        scheme.record_weights = False
        matrix = scheme.depth_weights()
        scheme.reset_depth_weights()
        if matrix is None or trainer.sanity_checking:
            return
        matrix = self._mean_over_ranks(trainer, matrix, pl_module.device)
        entry = {"step": int(trainer.global_step), **matrix}
        self.last = entry
        if not trainer.is_global_zero:
            return
        if self.log_scalars:
            metrics = {
                f"depth/{row['sublayer']}/{_key(src)}": w
                for row in entry["rows"]
                for src, w in zip(entry["sources"], row["weights"])
                if not math.isnan(w)
            }
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=entry["step"])
        self._append(self.run_dir or trainer.default_root_dir, entry)

    @staticmethod
    def _mean_over_ranks(trainer: L.Trainer, matrix: dict[str, Any], device: torch.device) -> dict[str, Any]:
        if getattr(trainer, "world_size", 1) <= 1:
            return matrix
        values = torch.tensor([row["weights"] for row in matrix["rows"]], dtype=torch.float64, device=device)  # [R, C]
        values = trainer.strategy.reduce(values, reduce_op="mean")  # NaN cells are NaN on every rank
        rows = [{"sublayer": row["sublayer"], "weights": v} for row, v in zip(matrix["rows"], values.tolist())]
        return {"sources": matrix["sources"], "rows": rows}

    @staticmethod
    def _append(run_dir: str, entry: dict[str, Any]) -> None:
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, FILENAME)
        history = []
        if os.path.exists(path):
            with open(path) as f:
                history = json.load(f)
        rows = [
            {"sublayer": r["sublayer"], "weights": [None if math.isnan(w) else w for w in r["weights"]]}
            for r in entry["rows"]
        ]
        history.append({"step": entry["step"], "sources": entry["sources"], "rows": rows})
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(history, f)
        os.replace(tmp, path)  # a crash mid-write never leaves a torn file
