"""The report of a scaling ladder: a decision's two arms trained at several sizes, fitted against compute
(analysis/scaling_fit.py) and reported as a compute multiplier with its uncertainty.

    python -m analysis.ladder_report LADDER_DIR_OR_CSV [--target-flops X] [--confidence 0.9] [--bootstrap N]
        [--out DIR] [--metric val_bpb|val_loss] [--decision NAME] [--tokens-per-param X] [--seed 0]

Reads the ladder table (``LADDER_DIR/ladder.csv``, or the CSV named) and writes into ``--out`` (default:
the table's folder):

* ``fits.json``: the fits, ``k`` and the exponent difference with intervals, the fit-free multiplier at
  each rung, the rollout check, the A/A null and the extrapolations (``Comparison.summary()``), and per
  cell the mean and spread of the metric over seeds;
* ``table.md``: the same as tables, with learning rates and the runs whose rate sat at the edge of its
  sweep;
* ``loss_vs_compute.png``: the metric against compute (log-log) per arm, seeds and means, the shared-
  exponent fit with its bootstrap band, dashed beyond the largest rung up to the extrapolation targets;
* ``multiplier.png``: the fit-free multiplier per rung, ``k`` and the per-arm-exponent multiplier with
  their bands, against compute, and the 1.0 line;
* ``residuals.png``: each run's and each cell mean's residual from the shared fit;
* ``stability_<column>.png``: each stability metric present against compute, per arm.

The ladder table, one row per finished run (other columns are ignored):

=====================  ============================================================================
column                 meaning
=====================  ============================================================================
decision               the decision the ladder measures (e.g. ``block_attnres``); one per table, or
                       choose with ``--decision``
arm                    ``baseline`` or ``variant``
rung                   the size's name; rungs are ordered by the baseline's compute
seed                   the run's seed; the same seed in both arms sees the same batches (paired)
non_embedding_params   parameters outside the embedding and the output head
active_params          parameters used per token (routed experts counted at top-k)
train_tokens           tokens trained on
train_flops            training compute in FLOPs: the ``C`` of the fits (K3: 6 x active parameters x
                       tokens, plus what the compute accounting adds)
val_bpb                final validation bits per byte (the metric fitted by default)
val_loss               final validation loss, nats per token (``--metric val_loss``)
lr                     the learning rate the run trained with
run_dir                the run's folder
=====================  ============================================================================

Optional columns: ``lr_edge`` (empty, ``false``, ``no``, ``none`` or ``0``: the chosen rate was inside
its sweep; ``low``, ``high``, ``true``, ``yes`` or ``1``: at that edge of it), ``tokens_per_param``
(the run's token multiple; a table holding several, from cooldown branches, needs
``--tokens-per-param``), and the stability metrics ``max_activation`` (largest activation),
``grad_norm_spikes`` (gradient-norm spikes counted) and ``maxvio`` (the busiest expert's overload at the
end), which may be empty where a run has none.

A table the report cannot use (missing file or column, a value that is not a number, a duplicated run,
an arm with fewer than two rungs) is refused with one line naming it, exit status 2, and nothing is
written.
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

from analysis import scaling_fit
from analysis.plotting import pyplot
from analysis.scaling_fit import ARMS, Comparison, Ladder, Run
from runtime.cli import ToolError, finite_float, int_at_least, new_output_path, reports_errors

LADDER_FILE = "ladder.csv"
REQUIRED = (
    "decision",
    "arm",
    "rung",
    "seed",
    "non_embedding_params",
    "active_params",
    "train_tokens",
    "train_flops",
    "val_bpb",
    "val_loss",
    "lr",
    "run_dir",
)
NUMBERS = ("non_embedding_params", "active_params", "train_tokens", "train_flops", "val_bpb", "val_loss", "lr")
POSITIVE = ("train_flops", "val_bpb", "val_loss")
STABILITY = ("max_activation", "grad_norm_spikes", "maxvio")
METRICS = ("val_bpb", "val_loss")
EDGE_NO, EDGE_YES = ("", "false", "no", "none", "0"), ("low", "high", "true", "yes", "1")
FIGURES = ("loss_vs_compute.png", "multiplier.png", "residuals.png")
COLORS = {"baseline": "#1f77b4", "variant": "#d62728"}


# -- reading ---------------------------------------------------------------------------------------------
def ladder_csv(path: str) -> Path:
    """The ladder table a path names: the file itself, or ``ladder.csv`` in the folder."""
    p = Path(path)
    if p.is_dir():
        p = p / LADDER_FILE
        if not p.is_file():
            raise ToolError(f"{path}: no {LADDER_FILE} in this folder")
    elif not p.is_file():
        raise ToolError(f"{path}: no such file or folder")
    return p


def _number(row: dict, column: str, line: int, name: str, optional: bool = False) -> float:
    text = (row.get(column) or "").strip()
    if optional and text == "":
        return float("nan")
    try:
        value = float(text)
    except ValueError:
        raise ToolError(f"{name} line {line}: {column} {text!r} is not a number") from None
    if not math.isfinite(value):
        raise ToolError(f"{name} line {line}: {column} {text!r} is not a finite number")
    if column in POSITIVE and value <= 0:
        raise ToolError(f"{name} line {line}: {column} {text!r} must be positive")
    return value


def read_rows(
    path: Path,
    decision: Optional[str] = None,
    tokens_per_param: Optional[float] = None,
    minimum_rungs: Optional[dict[str, int]] = None,
    one_multiple: bool = True,
) -> tuple[str, list[dict[str, Any]]]:
    """The decision and its runs, checked: every required column, numbers where numbers belong, one row
    per (arm, rung, seed), each arm with at least ``minimum_rungs[arm]`` rungs (2 for a ladder). A
    ``ToolError`` names the first problem. With ``one_multiple`` a table of several token multiples needs
    ``tokens_per_param`` to choose one (a local comparison's points are several multiples by design)."""
    name = path.name
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
            raw = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise ToolError(f"{path}: cannot read it as CSV ({err})") from None
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise ToolError(f"{name}: missing column(s) {', '.join(missing)}")
    if not raw:
        raise ToolError(f"{name}: no runs")
    decisions = sorted({(r["decision"] or "").strip() for r in raw})
    if decision is not None:
        if decision not in decisions:
            raise ToolError(f"{name}: no runs of decision {decision!r} (it holds {', '.join(decisions)})")
    elif len(decisions) > 1:
        raise ToolError(
            f"{name}: holds {len(decisions)} decisions ({', '.join(decisions)}); choose one with --decision"
        )
    else:
        decision = decisions[0]
    multiples = "tokens_per_param" in header
    rows, seen = [], {}
    for line, r in enumerate(raw, start=2):
        if (r["decision"] or "").strip() != decision:
            continue
        arm = (r["arm"] or "").strip()
        if arm not in ARMS:
            raise ToolError(f"{name} line {line}: arm {arm!r} is neither baseline nor variant")
        rung, seed = (r["rung"] or "").strip(), (r["seed"] or "").strip()
        if not rung or not seed:
            raise ToolError(f"{name} line {line}: {'rung' if not rung else 'seed'} is empty")
        row: dict[str, Any] = {"arm": arm, "rung": rung, "seed": seed, "run_dir": (r["run_dir"] or "").strip()}
        row["line"] = line
        for column in NUMBERS:
            row[column] = _number(r, column, line, name)
        for column in STABILITY:
            if column in header:
                row[column] = _number(r, column, line, name, optional=True)
        if multiples:
            row["tokens_per_param"] = _number(r, "tokens_per_param", line, name)
        if "lr_edge" in header:
            edge = (r["lr_edge"] or "").strip().lower()
            if edge not in EDGE_NO + EDGE_YES:
                raise ToolError(f"{name} line {line}: lr_edge {edge!r} is none of low, high, true, false or empty")
            row["lr_edge"] = "" if edge in EDGE_NO else edge
        rows.append(row)
    if multiples:
        values = sorted({r["tokens_per_param"] for r in rows})
        if tokens_per_param is None and len(values) > 1 and one_multiple:
            listed = ", ".join(f"{v:g}" for v in values)
            raise ToolError(f"{name}: holds several token multiples ({listed}); choose one with --tokens-per-param")
        if tokens_per_param is not None:
            rows = [r for r in rows if math.isclose(r["tokens_per_param"], tokens_per_param, rel_tol=1e-9)]
            if not rows:
                listed = ", ".join(f"{v:g}" for v in values)
                raise ToolError(f"{name}: no runs at --tokens-per-param {tokens_per_param:g} (it holds {listed})")
    elif tokens_per_param is not None:
        raise ToolError(f"{name}: --tokens-per-param given, but the table has no tokens_per_param column")
    for r in rows:
        key = (r["arm"], r["rung"], r["seed"])
        if key in seen:
            raise ToolError(f"{name} lines {seen[key]} and {r['line']}: the same run ({', '.join(key)}) twice")
        seen[key] = r["line"]
    for arm in ARMS:
        rungs = sorted({r["rung"] for r in rows if r["arm"] == arm})
        need = (minimum_rungs or {}).get(arm, 2)
        if len(rungs) < need:
            listed = f" ({', '.join(rungs)})" if rungs else ""
            what = "a ladder" if minimum_rungs is None else "this table"
            raise ToolError(f"{name}: the {arm} has {len(rungs)} rung(s){listed}; {what} needs at least {need}")
    return decision, rows


def build_ladder(rows: list[dict[str, Any]], metric: str = "val_bpb") -> Ladder:
    return Ladder(Run(r["arm"], r["rung"], r["seed"], r["train_flops"], r[metric]) for r in rows)


# -- formatting ------------------------------------------------------------------------------------------
def _g(v: Optional[float], digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.{digits}g}"


def _verdict_text(e: dict[str, Any]) -> str:
    """An estimate's verdict, or why it has none."""
    if e.get("verdict"):
        return e["verdict"]
    return f"no verdict ({e['verdict_withheld']})" if e.get("verdict_withheld") else "no verdict"


def _signed(v: Optional[float], decimals: int = 4) -> str:
    return "—" if v is None else f"{v:+.{decimals}f}"


def _estimate(e: dict[str, Any], digits: int = 4) -> str:
    """``value [lower, upper]``, an unbounded end as inf, or why there is none."""
    lo, hi = e["interval"]
    if e["estimate"] is None and lo is None and hi is None:
        return f"— ({e.get('reason', 'failed')})"
    value = _g(e["estimate"], digits)
    if lo is None and hi is None and e["status"] != "ok":
        return f"{value} (no interval: {e.get('reason', '')})"
    low = _g(lo, digits) if lo is not None else "—"
    high = _g(hi, digits) if hi is not None else "inf"
    return f"{value} [{low}, {high}]"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _plain_log_axis(axis) -> None:
    """Tick labels of a log axis as plain numbers (2.4, not 2.4 x 10^0): loss and multiplier ranges span
    less than a decade."""
    from matplotlib.ticker import FuncFormatter  # start-up time: matplotlib, only when a plot is drawn

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def cell_stats(rows: list[dict[str, Any]], ladder: Ladder, metric: str) -> list[dict[str, Any]]:
    """Per rung and arm: sizes, compute, the metric's mean and spread over seeds, rates and stability."""
    out = []
    for rung in ladder.rungs:
        for arm in ARMS:
            runs = sorted(
                (r for r in rows if r["arm"] == arm and r["rung"] == rung),
                key=lambda r: scaling_fit.seed_order(r["seed"]),
            )
            if not runs:
                continue
            entry: dict[str, Any] = {"rung": rung, "arm": arm, "seeds": [r["seed"] for r in runs]}
            for column in ("non_embedding_params", "active_params", "train_tokens", "train_flops"):
                entry[column] = float(np.mean([r[column] for r in runs]))
            for column in METRICS:
                values = np.array([r[column] for r in runs])
                entry[f"{column}_mean"] = float(values.mean())
                entry[f"{column}_sd"] = float(values.std(ddof=1)) if len(values) > 1 else None
            entry["lr"] = sorted({r["lr"] for r in runs})
            if any("lr_edge" in r for r in runs):
                entry["lr_edge"] = sorted({r["lr_edge"] for r in runs if r.get("lr_edge")})
            for column in STABILITY:
                values = [r[column] for r in runs if column in r and not math.isnan(r[column])]
                if values:
                    entry[column] = float(np.mean(values))
            out.append(entry)
    return out


def markdown_report(decision: str, metric: str, cells: list[dict], comparison: Comparison, figures: list[str]) -> str:
    s = comparison.summary()
    parts = [
        f"# Ladder: {decision}\n",
        f"Metric fitted: final `{metric}` against training FLOPs. Intervals: {s['confidence']:.0%} percentile, "
        f"{s['bootstrap']} bootstrap replicates ({s['bootstrap_method']} resampled"
        + (", paired across arms" if s["paired_rungs"] else "")
        + f"), widened x{s['t_widening']:.3g} for {s['degrees_of_freedom']} seed degrees of freedom; "
        f"Huber delta {s['huber_delta']:.3g} on log residuals ({s['huber_delta_note']}).\n",
        "## Runs per arm and rung\n",
    ]
    edge_column = any("lr_edge" in c for c in cells)
    header = ["rung", "arm", "non-emb params", "active params", "tokens", "FLOPs", "seeds"]
    header += [f"{metric} mean", f"{metric} sd", "lr"]
    rows = []
    for c in cells:
        lr = ", ".join(f"{v:.3g}" for v in c["lr"])
        if edge_column and c.get("lr_edge"):
            lr += f" (at the {'/'.join(c['lr_edge'])} edge of its sweep)"
        rows.append(
            [
                c["rung"],
                c["arm"],
                f"{c['non_embedding_params']:,.0f}",
                f"{c['active_params']:,.0f}",
                f"{c['train_tokens']:,.0f}",
                f"{c['train_flops']:.3g}",
                len(c["seeds"]),
                f"{c[f'{metric}_mean']:.4f}",
                _g(c[f"{metric}_sd"], 2),
                lr,
            ]
        )
    parts.append(_table(header, rows))

    parts.append("\n## Compute multiplier at each rung (no fit)\n")
    parts.append(
        "The compute the baseline needs to reach the variant's loss (its means interpolated in log-log), "
        "over the variant's compute; above 1 the variant is ahead.\n\n"
    )
    rows = []
    for r in s["rung_multipliers"]:
        note = r.get("reason", "")
        if "at_least" in r:
            note += f" (so at least {r['at_least']:.3g})"
        if "at_most" in r:
            note += f" (so at most {r['at_most']:.3g})"
        value = _estimate(r, 4) if r["estimate"] is not None else _interval_only(r)
        rows.append([r["rung"], _signed(r.get("gap")), value, r["verdict"] or "—", note])
    parts.append(_table(["rung", f"{metric} gap (baseline - variant)", "multiplier", "verdict", "note"], rows))

    parts.append("\n## Fits\n")
    k, da = s["k"], s["exponent_difference"]
    parts.append(f"- compute multiplier `k` (shared exponent and E): {_estimate(k)}: **{_verdict_text(k)}**\n")
    parts.append(f"- exponent difference (variant - baseline, shared E): {_estimate(da, 3)}: {_verdict_text(da)}\n")
    rows = []
    for name, f in s["fits"].items():
        if f["status"] == "ok":
            params = ", ".join(f"{p}={_g(f[p])}" for p in scaling_fit.MODELS[f["model"]])
            rows.append([name, "ok", params + (f" ({f['note']})" if f.get("note") else "")])
        else:
            rows.append([name, "failed", f["reason"]])
    parts.append("\n" + _table(["fit", "status", "parameters (A at c_ref)"], rows))

    parts.append("\n## Rollout check\n")
    ro = s["rollout"]
    held = ", ".join(f"the {arm}'s {rung}" for arm, rung in ro["held_out"].items() if rung is not None)
    parts.append(
        f"Each arm's largest rung ({held}) is predicted by each two-arm fit of the rungs below it. A fit misses "
        f"when the {ro['confidence']:.0%} bootstrap interval of an arm's error (seeds resampled, the smaller "
        "rungs refitted) excludes zero; a check that cannot run for an arm withholds as a miss does.\n\n"
    )
    rows = []
    for model in ("shared", "free"):
        entry = ro[model]
        for arm in ARMS:
            e = entry.get(arm, {})
            lo_hi = e.get("error_interval")
            check = {True: "**misses**", False: "passes"}.get(e.get("misses"), f"not run: {e.get('reason', '')}")
            rows.append(
                [
                    model,
                    arm,
                    e.get("held_out_rung", "—"),
                    f"{e['predicted']:.4f}" if "predicted" in e else "—",
                    f"{e['observed']:.4f}" if "observed" in e else "—",
                    _signed(e.get("error")),
                    f"[{_signed(lo_hi[0])}, {_signed(lo_hi[1])}]" if lo_hi else "—",
                    _g(e.get("seed_spread"), 2),
                    _g(e.get("error_in_spreads"), 2),
                    check,
                ]
            )
    header = ["fit", "arm", "held out", "predicted", "observed", "error", "error interval", "seed sd"]
    parts.append(_table(header + ["|error| / sd", "check"], rows))

    parts.append("\n## A/A null\n")
    aa = s["aa"]
    if "k" in aa:
        covers = aa.get("covers_1")
        covers_text = {True: "covers 1, as it must", False: "**does not cover 1**", None: "no interval"}[covers]
        parts.append(
            f"Baseline seeds split in two halves posing as two arms ({aa['bootstrap_method']} resampled), at "
            f"{aa['confidence']:.0%}: k = {_estimate(aa['k'])}: {covers_text}.\n"
        )
    else:
        parts.append(f"Not run: {aa['reason']}.\n")

    parts.append("\n## Guards on the fitted verdicts\n")
    parts.append(
        "A fitted statistic (k, the exponent difference, the extrapolations) names a sign only where every "
        "guard passed; the fit-free multipliers per rung do not rest on a fit and keep theirs.\n\n"
    )
    rows = [[name, "passed" if g["passed"] else f"**withholds**: {g['reason']}"] for name, g in s["guards"].items()]
    parts.append(_table(["guard", "result"], rows))

    parts.append("\n## Extrapolation\n")
    rows = []
    for x in s["extrapolations"]:
        rows.append(
            [
                x["label"],
                f"{x['compute']:.3g}",
                f"{x['factor']:.3g}",
                _estimate(x["gap_shared"], 3),
                _estimate(x["multiplier_shared"], 4),
                _estimate(x["gap_free"], 3),
                _estimate(x["multiplier_free"], 4),
            ]
        )
    header = ["target", "FLOPs", "x largest", "gap (shared)", "multiplier (shared)", "gap (free)"]
    parts.append(_table(header + ["multiplier (free)"], rows))

    present = [m for m in STABILITY if any(m in c for c in cells)]
    if present:
        parts.append("\n## Stability metrics (mean over seeds)\n")
        rows = [[c["rung"], c["arm"], *[_g(c.get(m)) for m in present]] for c in cells]
        parts.append(_table(["rung", "arm", *present], rows))
    if edge_column:
        flagged = [c for c in cells if c.get("lr_edge")]
        parts.append("\n## Learning rates at the edge of their sweep\n")
        if flagged:
            parts += [f"- {c['arm']} {c['rung']}: lr {c['lr']} at the {'/'.join(c['lr_edge'])} edge\n" for c in flagged]
        else:
            parts.append("None: every chosen rate was inside its sweep.\n")
    parts.append("\n## Figures\n")
    parts += [f"- `{f}`\n" for f in figures]
    return _spaced("".join(parts))


def _spaced(text: str) -> str:
    """One blank line around every heading and table, none doubled."""
    out: list[str] = []
    for line in text.strip().split("\n"):
        prev = out[-1] if out else ""
        boundary = line.startswith("#") or prev.startswith("#") or line.startswith("|") != prev.startswith("|")
        if prev and line and boundary:
            out.append("")
        if line or prev:
            out.append(line)
    return "\n".join(out) + "\n"


def _interval_only(r: dict) -> str:
    lo, hi = r["interval"]
    if lo is None and hi is None:
        return "— [inf, inf]" if r.get("verdict") else "—"
    return f"— [{_g(lo) if lo is not None else '—'}, {_g(hi) if hi is not None else 'inf'}]"


# -- figures ---------------------------------------------------------------------------------------------
def _runs_by_arm(ladder: Ladder, arm: str) -> tuple[np.ndarray, np.ndarray]:
    pairs = [(r.compute, r.loss) for r in ladder.runs() if r.arm == arm]
    return np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])


def _means_by_arm(ladder: Ladder, arm: str) -> tuple[np.ndarray, np.ndarray]:
    cells = [ladder.cell(arm, r) for r in ladder.rungs if ladder.cell(arm, r) is not None]
    return np.array([c.compute for c in cells]), np.array([c.mean for c in cells])


def plot_loss(comparison: Comparison, metric: str, decision: str, path: Path) -> None:
    plt = pyplot()
    ladder, curves = comparison.ladder, comparison.curves
    grid, c_max = curves["compute"], curves["c_max"]
    inside, beyond = grid <= c_max * 1.0001, grid >= c_max * 0.9999
    fig, ax = plt.subplots(figsize=(7, 5), constrained_layout=True)
    for i, arm in enumerate(ARMS):
        color = COLORS[arm]
        ax.scatter(*_runs_by_arm(ladder, arm), s=12, color=color, alpha=0.4)
        screened = [(r["rung"], r["loss"]) for r in comparison.screened if r["arm"] == arm]
        if screened and comparison.measured is not None:  # runs left out of the fits as diverged: crosses
            compute = [comparison.measured.cell(arm, rung).compute for rung, _ in screened]
            ax.scatter(compute, [loss for _, loss in screened], marker="x", s=30, color=color, label=f"{arm}: screened")
        ax.plot(*_means_by_arm(ladder, arm), "o", color=color, label=f"{arm} (mean over seeds)")
        if comparison.shared.ok:
            fitted = comparison.shared.predict(grid, i)
            ax.plot(grid[inside], fitted[inside], "-", color=color, lw=1.5)
            ax.plot(grid[beyond], fitted[beyond], "--", color=color, lw=1.5)
            if "band" in curves:
                ax.fill_between(grid, curves["band"][0, i], curves["band"][1, i], color=color, alpha=0.15, lw=0)
    for c, label in curves["targets"]:
        ax.axvline(c, color="0.6", ls=":", lw=1)
        ax.annotate(label, (c, 1), xycoords=("data", "axes fraction"), fontsize=7, rotation=90, va="top", ha="right")
    ax.set_xscale("log")
    ax.set_yscale("log")
    _plain_log_axis(ax.yaxis)
    ax.set_xlabel("training compute (FLOPs)")
    ax.set_ylabel(f"final {metric}")
    title = f"{decision}: {metric} against compute"
    if comparison.shared.ok:
        title += f", k = {comparison.k.estimate:.3g}"
    else:
        title += f" (shared fit failed: {comparison.shared.reason})"
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_multiplier(comparison: Comparison, decision: str, path: Path) -> None:
    plt = pyplot()
    curves, s = comparison.curves, comparison.summary()
    grid, c_max = curves["compute"], curves["c_max"]
    inside, beyond = grid <= c_max * 1.0001, grid >= c_max * 0.9999
    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    ax.axhline(1.0, color="black", lw=1, ls="--", label="1.0 (no difference)")
    k = comparison.k
    if k.estimate is not None:
        ax.plot(grid, np.full(len(grid), k.estimate), color="#2ca02c", lw=1.5, label="k (shared exponent)")
        if k.lower is not None and k.upper is not None and math.isfinite(k.upper):
            ax.fill_between(grid, k.lower, k.upper, color="#2ca02c", alpha=0.15, lw=0)
    if comparison.free.ok:
        m = scaling_fit.free_multiplier(comparison.free, grid)
        ax.plot(grid[inside], m[inside], "-", color="#9467bd", lw=1.2, label="per-arm exponents")
        ax.plot(grid[beyond], m[beyond], "--", color="#9467bd", lw=1.2)
        if "mult_band" in curves:
            ax.fill_between(grid, curves["mult_band"][0], curves["mult_band"][1], color="#9467bd", alpha=0.12, lw=0)
    for r in s["rung_multipliers"]:
        c = r.get("variant_compute")
        if c is None:
            continue
        lo, hi = r["interval"]
        if r["estimate"] is not None:
            yerr = [[r["estimate"] - lo if lo is not None else 0], [hi - r["estimate"] if hi is not None else 0]]
            ax.errorbar([c], [r["estimate"]], yerr=yerr, fmt="o", color="black", ms=5, capsize=3)
        elif "at_least" in r:
            ax.plot([c], [r["at_least"]], marker="^", color="black", ls="none")
        elif "at_most" in r:
            ax.plot([c], [r["at_most"]], marker="v", color="black", ls="none")
    ax.plot([], [], "o", color="black", label="per rung, no fit (^: at least, v: at most)")
    for c, _ in curves["targets"]:
        ax.axvline(c, color="0.6", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    _plain_log_axis(ax.yaxis)
    ax.set_xlabel("training compute (FLOPs)")
    ax.set_ylabel("compute multiplier (baseline compute to match the variant)")
    ax.set_title(f"{decision}: compute multiplier, {comparison.confidence:.0%} bands", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_residuals(comparison: Comparison, metric: str, decision: str, path: Path) -> None:
    plt = pyplot()
    ladder = comparison.ladder
    fig, ax = plt.subplots(figsize=(7, 4), constrained_layout=True)
    ax.axhline(0.0, color="black", lw=1)
    for i, arm in enumerate(ARMS):
        color = COLORS[arm]
        if comparison.shared.ok:
            c, loss = _runs_by_arm(ladder, arm)
            ax.scatter(c, loss - comparison.shared.predict(c, i), s=12, color=color, alpha=0.4)
            c, loss = _means_by_arm(ladder, arm)
            ax.plot(c, loss - comparison.shared.predict(c, i), "o-", color=color, lw=0.8, label=f"{arm} (mean)")
    if not comparison.shared.ok:
        ax.text(0.5, 0.5, f"shared fit failed:\n{comparison.shared.reason}", ha="center", transform=ax.transAxes)
    else:
        ax.legend(fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("training compute (FLOPs)")
    ax.set_ylabel(f"{metric}: observed - shared fit")
    ax.set_title(f"{decision}: residuals (dots: seeds)", fontsize=9)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_stability(rows: list[dict], column: str, decision: str, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), constrained_layout=True)
    for arm in ARMS:
        runs = [r for r in rows if r["arm"] == arm and not math.isnan(r.get(column, float("nan")))]
        if not runs:
            continue
        ax.scatter([r["train_flops"] for r in runs], [r[column] for r in runs], s=12, color=COLORS[arm], alpha=0.4)
        by_rung: dict[str, list[dict]] = {}
        for r in runs:
            by_rung.setdefault(r["rung"], []).append(r)
        points = sorted(
            (np.mean([r["train_flops"] for r in g]), np.mean([r[column] for r in g])) for g in by_rung.values()
        )
        ax.plot(*zip(*points), "o-", color=COLORS[arm], label=f"{arm} (mean over seeds)")
    ax.set_xscale("log")
    ax.set_xlabel("training compute (FLOPs)")
    ax.set_ylabel(column)
    ax.set_title(f"{decision}: {column} against compute", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=130)
    plt.close(fig)


# -- the tool --------------------------------------------------------------------------------------------
def report(
    source: str,
    out: Optional[str] = None,
    targets: tuple[float, ...] = (),
    confidence: float = 0.9,
    n_boot: int = 1000,
    metric: str = "val_bpb",
    decision: Optional[str] = None,
    tokens_per_param: Optional[float] = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Read, check, fit and write; the paths written. Every check runs before anything is written."""
    path = ladder_csv(source)
    decision, rows = read_rows(path, decision, tokens_per_param)
    out_dir = Path(out) if out is not None else path.parent
    if out_dir.exists() and not out_dir.is_dir():
        raise ToolError(f"--out {out_dir}: is a file, not a folder")
    ladder = build_ladder(rows, metric)
    comparison = scaling_fit.compare(ladder, confidence, n_boot, targets, seed)
    cells = cell_stats(rows, ladder, metric)
    stability = [m for m in STABILITY if any(not math.isnan(r.get(m, float("nan"))) for r in rows)]
    figures = [*FIGURES, *[f"stability_{m}.png" for m in stability]]

    out_dir.mkdir(parents=True, exist_ok=True)
    plot_loss(comparison, metric, decision, out_dir / FIGURES[0])
    plot_multiplier(comparison, decision, out_dir / FIGURES[1])
    plot_residuals(comparison, metric, decision, out_dir / FIGURES[2])
    for m in stability:
        plot_stability(rows, m, decision, out_dir / f"stability_{m}.png")
    summary = {
        "decision": decision,
        "metric": metric,
        "source": str(path),
        "tokens_per_param": tokens_per_param,
        "rungs": list(ladder.rungs),
        "cells": cells,
        **comparison.summary(),
        "figures": figures,
    }
    (out_dir / "fits.json").write_text(json.dumps(_json_safe(summary), indent=1, allow_nan=False) + "\n")
    (out_dir / "table.md").write_text(markdown_report(decision, metric, cells, comparison, figures))
    written = [out_dir / "fits.json", out_dir / "table.md", *[out_dir / f for f in figures]]
    return {"comparison": comparison, "written": [str(p) for p in written]}


def _json_safe(value: Any) -> Any:
    """JSON has no NaN or infinity: a non-finite number becomes null (its reason sits beside it)."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


@reports_errors("analysis.ladder_report")
def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="analysis.ladder_report", description=__doc__.splitlines()[0])
    p.add_argument("ladder", help=f"a ladder folder (holding {LADDER_FILE}) or the CSV itself")
    p.add_argument(
        "--target-flops",
        type=finite_float(0.0, above=True),
        action="append",
        default=[],
        help="extrapolate to this training compute too (repeatable; K3: 6 x active params x tokens)",
    )
    p.add_argument(
        "--confidence",
        type=finite_float(0.5, 0.999),
        default=0.9,
        help="interval level (default 0.9)",
    )
    p.add_argument(
        "--bootstrap",
        type=int_at_least(1),
        default=1000,
        help="bootstrap replicates (default 1000; at least 5 beyond each end of an interval: 100 at 90%%, 1000 at "
        "99%%, and 1000 for the 99%% rollout check and A/A null, without which no fitted verdict is called)",
    )
    p.add_argument("--out", type=new_output_path, default=None, help="output folder (default: the ladder's folder)")
    p.add_argument("--metric", choices=METRICS, default="val_bpb", help="the column fitted (default val_bpb)")
    p.add_argument("--decision", default=None, help="the decision to report, where the table holds several")
    p.add_argument(
        "--tokens-per-param",
        type=finite_float(0.0, above=True),
        default=None,
        help="the token multiple to report, where the table holds several",
    )
    p.add_argument("--seed", type=int_at_least(0), default=0, help="the bootstrap's random seed (default 0)")
    args = p.parse_args(argv)
    need = scaling_fit.min_replicates(args.confidence)
    if args.bootstrap < need:
        raise ToolError(
            f"--bootstrap {args.bootstrap} is too few for a {args.confidence:.0%} interval (--confidence "
            f"{args.confidence:g}): at least {need}, {scaling_fit.TAIL_REPLICATES} beyond each end"
        )
    result = report(
        args.ladder,
        args.out,
        tuple(args.target_flops),
        args.confidence,
        args.bootstrap,
        args.metric,
        args.decision,
        args.tokens_per_param,
        args.seed,
    )
    k = result["comparison"].k
    verdict = _verdict_text(k.summary())
    headline = f"k = {k.estimate:.4g} [{_g(k.lower)}, {_g(k.upper)}]: {verdict}" if k.status == "ok" else k.reason
    print(headline)
    print("wrote " + ", ".join(result["written"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
