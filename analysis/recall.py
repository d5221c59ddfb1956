"""Associative recall per test segment, as the Zoology and Kimi Linear papers show it.

Runs trained on ``data=mqar`` with ``test_segments`` report ``val/accuracy/T<len>_P<pairs>`` per segment.
``analysis.compare`` calls this module for them and writes:

* ``recall.md`` / ``recall.csv``: per run its line (the mixer point), width, depth, decoding state size and the
  final accuracy of every segment;
* runs that differ only in a tuned setting (``optimizer.lr``) are one point at their best, as Zoology
  reports each architecture and width at its best learning rate: the run with the highest mean accuracy
  over the segments stands for the point, and the table names the value that won;
* ``recall_width.png``: accuracy against model width, one panel per segment, one line per mixer;
* ``recall_state.png``: accuracy against the decoding state one sequence of the segment's length holds
  (growing K/V or latent caches at that length plus fixed recurrent states, summed over layers), one
  line per mixer: attention's cache grows with the sequence, KDA's state does not.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

from analysis.plotting import pyplot

SEGMENT = re.compile(r"^accuracy/T(\d+)_P(\d+)$")
WIDTH_KEY = "model.d_model"
DEPTH_KEY = "model.n_layers"
TUNED_KEYS = ("optimizer.lr",)  # searched over, not compared: a point is shown at its best value


def segments(runs: list[Any]) -> list[tuple[int, int]]:
    """(length, pairs) of every test segment any run reports, shortest and fewest first."""
    found = {
        (int(m.group(1)), int(m.group(2))) for r in runs for k in r.summary.get("val", {}) if (m := SEGMENT.match(k))
    }
    return sorted(found)


def _line(run: Any) -> str:
    """What a line of the plots stands for: the run's options other than its size (its mixer point)."""
    rest = {k: v for k, v in run.varied.items() if k not in (WIDTH_KEY, DEPTH_KEY, "seed", *TUNED_KEYS)}
    return ", ".join(f"{v}" if k == "point" else f"{k}={v}" for k, v in rest.items()) or run.label


def width(run: Any) -> Optional[int]:
    value = run.summary.get("d_model", run.varied.get(WIDTH_KEY))
    return int(value) if value is not None else None


def depth(run: Any) -> Optional[int]:
    value = run.summary.get("n_layers", run.varied.get(DEPTH_KEY))
    return int(value) if value is not None else None


def state_numbers(run: Any, seq_len: int) -> Optional[int]:
    state = run.summary.get("decode_state_numbers")
    if not state:
        return None
    return int(state["per_token"]) * seq_len + int(state["fixed"])


def accuracy(run: Any, seg: tuple[int, int]) -> Optional[float]:
    value = run.summary.get("val", {}).get(f"accuracy/T{seg[0]}_P{seg[1]}")
    return float(value) if value is not None else None


def _mean_accuracy(run: Any, segs: list[tuple[int, int]]) -> Optional[float]:
    values = [a for s in segs if (a := accuracy(run, s)) is not None]
    return sum(values) / len(values) if values else None


def best_runs(runs: list[Any]) -> list[Any]:
    """The runs that report recall, one per (line, width, depth, seed): where runs differ only in a tuned
    setting, the one with the highest mean accuracy over the test segments."""
    segs = segments(runs)
    best: dict[tuple[str, Optional[int], Optional[int], Any], tuple[float, Any]] = {}
    for r in runs:
        score = _mean_accuracy(r, segs)
        if score is None:
            continue
        key = (_line(r), width(r), depth(r), r.varied.get("seed"))
        if key not in best or score > best[key][0]:
            best[key] = (score, r)
    return sorted(
        (r for _, r in best.values()),
        key=lambda r: (_line(r), width(r) or 0, depth(r) or 0, str(r.varied.get("seed", ""))),
    )


def table(runs: list[Any]) -> Optional[tuple[list[str], list[list[Any]]]]:
    segs = segments(runs)
    if not segs:
        return None
    tuned = [k for k in TUNED_KEYS if any(k in r.varied for r in runs)]
    header = [
        "mixer",
        "d_model",
        "n_layers",
        *[f"best {k}" for k in tuned],
        "state numbers per token",
        "fixed state numbers",
        *[f"T{t} P{p}" for t, p in segs],
    ]
    rows = []
    for r in best_runs(runs):
        state = r.summary.get("decode_state_numbers") or {}
        rows.append(
            [
                _line(r),
                width(r),
                depth(r),
                *[r.varied.get(k) for k in tuned],
                state.get("per_token"),
                state.get("fixed"),
                *[accuracy(r, s) for s in segs],
            ]
        )
    return header, rows


def _panels(plt: Any, n: int) -> tuple[Any, list[Any]]:
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), constrained_layout=True, squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def plot(runs: list[Any], out: Path, x_of: str) -> Optional[Path]:
    """``x_of``: "width" (recall_width.png) or "state" (recall_state.png)."""
    segs = segments(runs)
    if not segs:
        return None
    runs = best_runs(runs)

    def line_of(run: Any) -> str:  # against width, runs of several depths are one line per depth
        return f"{_line(run)}, {depth(run)} layers" if x_of == "width" and several_depths else _line(run)

    several_depths = len({depth(r) for r in runs}) > 1
    plt = pyplot()
    fig, axes = _panels(plt, len(segs))
    lines = sorted({line_of(r) for r in runs})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, seg in zip(axes, segs):
        for i, name in enumerate(lines):
            points = []
            for r in runs:
                if line_of(r) != name or accuracy(r, seg) is None:
                    continue
                x = width(r) if x_of == "width" else state_numbers(r, seg[0])
                if x is not None:
                    points.append((x, accuracy(r, seg)))
            if points:
                xs, ys = zip(*sorted(points))
                ax.plot(xs, ys, marker="o", color=colors[i % len(colors)], label=name)
        ax.set_title(f"{seg[0]} tokens, {seg[1]} key-value pairs", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("model width (d_model)" if x_of == "width" else "decoding state per sequence (numbers)")
        ax.set_ylabel("recall accuracy")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("MQAR recall " + ("against model width" if x_of == "width" else "against decoding state size"))
    path = out / f"recall_{x_of}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
