"""Heatmap of AttnRes depth weights from a run folder's ``depth_weights.json``.

    python -m analysis.depth_weights RUN_DIR [--out depth.png] [--step N]

Rows are the reads in depth order (``L0.attn``, ``L0.mlp``, ..., ``final``), columns the sources
(embedding, completed blocks, partial sum for block AttnRes; every sublayer output for full AttnRes);
each cell is the mean softmax weight of that source in that read over one validation. Blank cells are
sources the read does not have yet. Default: the last validation in the file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Optional

import numpy as np

FILENAME = "depth_weights.json"


def load(run_dir: str) -> list[dict[str, Any]]:
    path = run_dir if run_dir.endswith(".json") else os.path.join(run_dir, FILENAME)
    with open(path) as f:
        return json.load(f)


def pick(history: list[dict[str, Any]], step: Optional[int]) -> dict[str, Any]:
    if not history:
        raise ValueError("depth_weights.json holds no validation yet")
    if step is None:
        return history[-1]
    for entry in reversed(history):
        if entry["step"] == step:
            return entry
    raise ValueError(f"no validation at step {step}; steps present: {', '.join(str(e['step']) for e in history)}")


def matrix(entry: dict[str, Any]) -> tuple[np.ndarray, list[str], list[str]]:
    """(weights [rows, sources] with NaN for absent sources, row labels, source labels)."""
    rows = entry["rows"]
    values = np.array([[math.nan if w is None else w for w in r["weights"]] for r in rows], dtype=np.float64)
    return values, [r["sublayer"] for r in rows], list(entry["sources"])


def plot(entry: dict[str, Any], out: str, title: Optional[str] = None) -> str:
    import matplotlib  # start-up time: matplotlib, only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # start-up time: matplotlib, only when a plot is drawn

    values, row_labels, src_labels = matrix(entry)
    n_rows, n_cols = values.shape
    fig_w = min(4.0 + 0.55 * n_cols, 24.0)
    fig_h = min(2.5 + 0.28 * n_rows, 40.0)
    fig, ax = plt.subplots(figsize=(fig_w, fig_h), constrained_layout=True)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#f0f0f0")  # grey: absent sources
    im = ax.imshow(
        np.ma.masked_invalid(values),
        cmap=cmap,
        vmin=0.0,
        vmax=max(float(np.nanmax(values)), 1e-9),
        aspect="auto",
        interpolation="nearest",
    )
    fig.colorbar(im, ax=ax, label="mean softmax weight", shrink=min(1.0, 10.0 / fig_h))

    # label every row/column while they stay readable, else every k-th
    row_step = max(1, math.ceil(n_rows / 60))
    col_step = max(1, math.ceil(n_cols / 40))
    ax.set_yticks(range(0, n_rows, row_step), [row_labels[i] for i in range(0, n_rows, row_step)], fontsize=8)
    ax.set_xticks(
        range(0, n_cols, col_step),
        [src_labels[i] for i in range(0, n_cols, col_step)],
        rotation=45,
        ha="right",
        fontsize=8,
    )
    if n_rows * n_cols <= 400:
        for i in range(n_rows):
            for j in range(n_cols):
                v = values[i, j]
                if not math.isnan(v):
                    ax.text(
                        j,
                        i,
                        f"{v:.2f}",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if v < 0.6 * np.nanmax(values) else "black",
                    )
    ax.set_xlabel("source")
    ax.set_ylabel("read (sublayer input)")
    ax.set_title(title or f"AttnRes depth weights, step {entry['step']}")
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="run folder (or a depth_weights.json path)")
    p.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/depth_weights.png)")
    p.add_argument("--step", type=int, default=None, help="validation step to draw (default: the last)")
    args = p.parse_args(argv)
    try:
        entry = pick(load(args.run_dir), args.step)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    base = os.path.dirname(args.run_dir) if args.run_dir.endswith(".json") else args.run_dir
    out = plot(entry, args.out or os.path.join(base, "depth_weights.png"))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
