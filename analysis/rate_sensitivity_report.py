"""Learning-rate sensitivity of a decision's two arms: final loss against the rate over a wide sweep, per arm,
and the width of each arm's stable basin (as in Wortsman et al. 2023, "Small-scale proxies for large-scale
Transformer training instabilities").

    python -m analysis.rate_sensitivity_report FOLDER_OR_CSV [--tolerance 0.02] [--out DIR]

Reads ``sensitivity.csv`` (one row per run: ``decision``, ``arm``, ``seed``, ``lr``, ``val_bpb``; an empty
or non-finite ``val_bpb`` is a diverged run) and writes ``sensitivity.json``, ``sensitivity.md`` and
``loss_vs_rate.png``.

Per arm, the seeds' mean final loss at each rate (a rate where any seed diverged counts as diverged):

* ``basin_octaves``: the width, in factors of two of the rate, of the contiguous range around the best
  rate where the mean loss stays within ``tolerance`` of the best; each end found by linear interpolation
  in log rate between the last rate inside and the first outside (at the last inside where the next
  diverged). An end at the edge of the sweep makes the width a lower bound (``open_low`` / ``open_high``).
* ``sensitivity``: Wortsman et al.'s LR sensitivity, the mean over the swept rates of
  ``min(loss, cap) - best``, with ``cap`` the largest finite mean loss in the table (both arms), which a
  diverged rate counts as.
* the same width per seed, to show how far one seed's curve moves it.

A wider basin (and a lower sensitivity) is what a decision made for stability should buy: the same loss
over more rates.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np

from analysis.plotting import pyplot
from analysis.scaling_fit import ARMS, seed_order
from runtime.cli import ToolError, finite_float, new_output_path, reports_errors

SENSITIVITY_FILE = "sensitivity.csv"
COLORS = {"baseline": "#1f77b4", "variant": "#d62728"}


def basin(log2_rates: np.ndarray, losses: np.ndarray, tolerance: float) -> dict[str, Any]:
    """The stable basin of one curve (rates ascending; non-finite losses diverged): its ends in log2 rate,
    width in octaves, the best rate and loss, and whether each end is open (at the sweep's edge)."""
    finite = np.isfinite(losses)
    if not finite.any():
        empty = dict.fromkeys(("best_lr", "best_loss", "low", "high"))
        return {**empty, "basin_octaves": 0.0, "open_low": False, "open_high": False, "reason": "every rate diverged"}
    best = int(np.argmin(np.where(finite, losses, np.inf)))
    threshold = losses[best] + tolerance

    def end(step: int) -> tuple[float, bool]:
        i = best
        while 0 <= i + step < len(losses) and finite[i + step] and losses[i + step] <= threshold:
            i += step
        if not 0 <= i + step < len(losses):
            return float(log2_rates[i]), True
        nxt = i + step
        if not finite[nxt]:
            return float(log2_rates[i]), False
        frac = (threshold - losses[i]) / (losses[nxt] - losses[i])
        return float(log2_rates[i] + frac * (log2_rates[nxt] - log2_rates[i])), False

    low, open_low = end(-1)
    high, open_high = end(+1)
    return {
        "best_lr": float(2.0 ** log2_rates[best]),
        "best_loss": float(losses[best]),
        "low": float(2.0**low),
        "high": float(2.0**high),
        "basin_octaves": high - low,
        "open_low": open_low,
        "open_high": open_high,
    }


def sensitivity(losses: np.ndarray, cap: float) -> float:
    """Wortsman et al.'s LR sensitivity: mean over rates of ``min(loss, cap) - best`` (diverged: ``cap``)."""
    capped = np.where(np.isfinite(losses), np.minimum(losses, cap), cap)
    return float(np.mean(capped) - np.min(capped))


def read_table(path: Path) -> tuple[str, list[dict[str, Any]]]:
    try:
        with open(path, newline="") as f:
            raw = list(csv.DictReader(f))
    except OSError as err:
        raise ToolError(f"{path}: cannot read it ({err})") from None
    if not raw:
        raise ToolError(f"{path.name}: no runs")
    missing = [c for c in ("decision", "arm", "seed", "lr", "val_bpb") if c not in raw[0]]
    if missing:
        raise ToolError(f"{path.name}: missing column(s) {', '.join(missing)}")
    rows = []
    for line, r in enumerate(raw, start=2):
        if r["arm"] not in ARMS:
            raise ToolError(f"{path.name} line {line}: arm {r['arm']!r} is neither baseline nor variant")
        try:
            lr = float(r["lr"])
            loss = float(r["val_bpb"]) if (r["val_bpb"] or "").strip() else math.nan
        except ValueError:
            raise ToolError(f"{path.name} line {line}: lr or val_bpb is not a number") from None
        if not lr > 0:
            raise ToolError(f"{path.name} line {line}: lr must be positive")
        rows.append({"arm": r["arm"], "seed": r["seed"], "lr": lr, "loss": loss if math.isfinite(loss) else math.nan})
    return raw[0]["decision"], rows


def analyse(rows: list[dict[str, Any]], tolerance: float) -> dict[str, Any]:
    """Per arm: the rates, mean losses, the basin, the sensitivity and the per-seed basins."""
    rates = sorted({r["lr"] for r in rows})
    log2 = np.log2(rates)
    means, per_seed = {}, {}
    for arm in ARMS:
        seeds = sorted({r["seed"] for r in rows if r["arm"] == arm}, key=seed_order)
        grid = np.full((len(seeds), len(rates)), np.nan)  # [seeds, rates]
        for r in rows:
            if r["arm"] == arm:
                grid[seeds.index(r["seed"]), rates.index(r["lr"])] = r["loss"]
        means[arm] = np.where(np.isnan(grid).any(0), np.inf, grid.mean(0) if len(seeds) else np.inf)
        per_seed[arm] = {s: np.where(np.isnan(grid[i]), np.inf, grid[i]) for i, s in enumerate(seeds)}
    finite = [m[np.isfinite(m)] for m in means.values()]
    cap = float(max(float(f.max()) for f in finite if len(f))) if any(len(f) for f in finite) else math.nan
    out: dict[str, Any] = {"tolerance": tolerance, "rates": rates, "cap": cap, "arms": {}}
    for arm in ARMS:
        entry = basin(log2, means[arm], tolerance)
        entry["sensitivity"] = sensitivity(means[arm], cap) if math.isfinite(cap) else None
        entry["mean_loss"] = [float(v) if math.isfinite(v) else None for v in means[arm]]
        entry["per_seed_octaves"] = {
            str(s): basin(log2, c, tolerance)["basin_octaves"] for s, c in per_seed[arm].items()
        }
        out["arms"][arm] = entry
    b, v = out["arms"]["baseline"], out["arms"]["variant"]
    out["basin_difference_octaves"] = v["basin_octaves"] - b["basin_octaves"]
    out["difference_is_a_bound"] = bool(b["open_low"] or b["open_high"] or v["open_low"] or v["open_high"])
    return out


def markdown(decision: str, result: dict[str, Any]) -> str:
    lines = [
        f"# Learning-rate sensitivity: {decision}\n",
        f"Final `val_bpb` against the rate, mean over seeds; the basin is where it stays within "
        f"{result['tolerance']:g} of the arm's best, its width in factors of two (octaves).\n",
        "| arm | best rate | best loss | basin | width (octaves) | per seed | sensitivity |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, e in result["arms"].items():
        if e["best_lr"] is None:
            lines.append(f"| {arm} | — | — | — | 0 | — | — |")
            continue
        ge = ">= " if e["open_low"] or e["open_high"] else ""
        seeds = ", ".join(f"{w:.2f}" for w in e["per_seed_octaves"].values())
        lines.append(
            f"| {arm} | {e['best_lr']:.3g} | {e['best_loss']:.4f} | {e['low']:.3g} - {e['high']:.3g} | "
            f"{ge}{e['basin_octaves']:.2f} | {seeds} | {e['sensitivity']:.4f} |"
        )
    diff = result["basin_difference_octaves"]
    bound = " (a bound: a basin reaches the sweep's edge)" if result["difference_is_a_bound"] else ""
    lines.append(f"\nBasin width, variant minus baseline: {diff:+.2f} octaves{bound}.")
    return "\n".join(lines) + "\n"


def plot(decision: str, result: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    rates = result["rates"]
    for arm, e in result["arms"].items():
        color = COLORS[arm]
        runs = [r for r in rows if r["arm"] == arm and math.isfinite(r["loss"])]
        ax.scatter([r["lr"] for r in runs], [r["loss"] for r in runs], s=10, color=color, alpha=0.4)
        mean = [v if v is not None else np.nan for v in e["mean_loss"]]
        ax.plot(rates, mean, "o-", color=color, label=f"{arm}: basin {e['basin_octaves']:.2f} octaves")
        if e["best_lr"] is not None:
            ax.axvspan(e["low"], e["high"], color=color, alpha=0.1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("learning rate")
    ax.set_ylabel("final val_bpb (mean over seeds)")
    ax.set_title(f"{decision}: loss against learning rate, tolerance {result['tolerance']:g}", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    @reports_errors("analysis.rate_sensitivity_report")
    def run(argv):
        p = argparse.ArgumentParser(prog="analysis.rate_sensitivity_report", description=__doc__.splitlines()[0])
        p.add_argument("table", help=f"a sensitivity folder (holding {SENSITIVITY_FILE}) or the CSV itself")
        p.add_argument("--tolerance", type=finite_float(0.0, above=True), default=0.02, help="basin tolerance (0.02)")
        p.add_argument("--out", type=new_output_path, default=None, help="output folder (default: the table's)")
        args = p.parse_args(argv)
        path = Path(args.table)
        path = path / SENSITIVITY_FILE if path.is_dir() else path
        if not path.is_file():
            raise ToolError(f"{args.table}: no {SENSITIVITY_FILE} there")
        decision, rows = read_table(path)
        result = analyse(rows, args.tolerance)
        out = Path(args.out) if args.out else path.parent
        out.mkdir(parents=True, exist_ok=True)
        (out / "sensitivity.json").write_text(json.dumps({"decision": decision, **result}, indent=1) + "\n")
        (out / "sensitivity.md").write_text(markdown(decision, result))
        plot(decision, result, rows, out / "loss_vs_rate.png")
        print(markdown(decision, result).strip().splitlines()[-1])
        return 0

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
