"""A local compute multiplier: the variant at one size, read off the baseline's measured curve around it,
without a scaling law and without extrapolation.

The baseline trains at three compute points about ``spread`` (1.3x) apart that bracket the variant's
compute, every cell with the same 3-4 seeds (a seed sees the same batches in both arms, so cells are
paired by it). The multiplier is the compute at which the baseline's curve (its seed means at the three
points, interpolated piecewise-linearly in log compute against log loss) reaches the variant's mean loss,
over the variant's compute: above 1 the variant needs less compute. Where the variant's loss lies outside
the bracket there is no number, only a bound (at least the bracket's top over the variant's compute, or at
most its bottom).

The interval is a paired bootstrap: one draw of seed indices serves every cell, the seeds' deviations
from their cell mean scaled by ``sqrt(n / (n - 1))`` (so a resampled mean has the unbiased variance), the
multiplier read off each replicate, and the percentile interval widened about its median by ``t_df / z``
with ``df = n - 1`` (few seeds estimate the spread from few degrees of freedom; ``scaling_fit.t_widening``).
A replicate outside the bracket counts as +inf or -inf where its bound settles the side of 1, as
undetermined otherwise; more than 10% undetermined fails the interval.

``python -m analysis.local_multiplier LOCAL_DIR_OR_CSV [--confidence 0.9] [--bootstrap 2000]`` reads
``local.csv`` (the ladder table's columns, ``analysis/ladder_report.py``: three baseline rungs, one
variant rung) and writes ``local.json`` and ``local.md`` beside it (or into ``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from analysis.ladder_report import ladder_csv, read_rows
from analysis.scaling_fit import (
    BASELINE_BETTER,
    MAX_FAILED_REPLICATES,
    NO_DIFFERENCE,
    VARIANT_BETTER,
    Ladder,
    Run,
    interval,
    min_replicates,
    seed_order,
    t_widening,
)
from runtime.cli import ToolError, finite_float, int_at_least, new_output_path, reports_errors

LOCAL_FILE = "local.csv"


@dataclass
class LocalMultiplier:
    """The local multiplier, its interval and verdict, or why there is none (``estimate`` None)."""

    estimate: Optional[float]
    lower: Optional[float] = None
    upper: Optional[float] = None
    verdict: Optional[str] = None
    reason: str = ""
    seeds: tuple = ()
    bracket: tuple = ()  # the baseline's compute at its three points, over the variant's compute
    replicates: int = 0
    undetermined: int = 0
    t_widening: float = 1.0
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        def finite(v):
            return float(v) if v is not None and math.isfinite(v) else None

        out = {
            "estimate": finite(self.estimate),
            "interval": [finite(self.lower), finite(self.upper)],
            "verdict": self.verdict,
            "seeds": [str(s) for s in self.seeds],
            "bracket": [float(b) for b in self.bracket],
            "replicates": self.replicates,
            "undetermined_replicates": self.undetermined,
            "t_widening": self.t_widening,
        }
        if self.reason:
            out["reason"] = self.reason
        out.update(self.extra)
        return out


def _cells(ladder: Ladder) -> tuple[list, Any, tuple]:
    """The baseline's cells in compute order, the variant's one cell and the seeds they share; a
    ``ValueError`` names what keeps the ladder from being a local comparison."""
    base = [ladder.cell("baseline", r) for r in ladder.rungs if ladder.cell("baseline", r) is not None]
    variants = [ladder.cell("variant", r) for r in ladder.rungs if ladder.cell("variant", r) is not None]
    if len(base) != 3 or len(variants) != 1:
        raise ValueError(
            f"a local comparison has the baseline at 3 compute points and the variant at 1; got {len(base)} and "
            f"{len(variants)}"
        )
    base = sorted(base, key=lambda c: c.compute)
    variant = variants[0]
    seeds = tuple(map(str, variant.seeds))
    for cell in base:
        if tuple(map(str, cell.seeds)) != seeds:
            raise ValueError(
                f"every cell needs the same seeds (paired); the variant has {', '.join(seeds)}, a baseline cell "
                f"{', '.join(map(str, cell.seeds))}"
            )
    if len(seeds) < 2:
        raise ValueError("a local comparison needs at least 2 seeds per cell for its interval")
    if not base[0].compute <= variant.compute <= base[2].compute:
        raise ValueError("the baseline's three compute points must bracket the variant's compute")
    return base, variant, seeds


def _log_multipliers(log_base: np.ndarray, log_variant: np.ndarray, log_compute: np.ndarray, log_c: float):
    """Per replicate (rows of ``log_base`` [R, 3], ``log_variant`` [R]): the log multiplier, and where it
    is outside the bracket +inf (the variant below the baseline's lowest loss) or -inf (above its highest);
    NaN where the baseline's loss does not fall with compute."""
    R = len(log_variant)
    out = np.full(R, np.nan)
    monotone = (log_base[:, 0] > log_base[:, 1]) & (log_base[:, 1] > log_base[:, 2])
    beyond = monotone & (log_variant < log_base[:, 2])
    below = monotone & (log_variant > log_base[:, 0])
    inside = monotone & ~beyond & ~below
    j = np.where(log_variant >= log_base[:, 1], 0, 1)  # the segment the variant's loss falls on
    rows = np.arange(R)
    hi, lo = log_base[rows, j], log_base[rows, j + 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        frac = (hi - log_variant) / (hi - lo)
    log_needed = log_compute[j] + frac * (log_compute[j + 1] - log_compute[j])
    out[inside] = log_needed[inside] - log_c
    out[beyond] = np.inf
    out[below] = -np.inf
    return out


def local_multiplier(ladder: Ladder, confidence: float = 0.9, n_boot: int = 2000, seed: int = 0) -> LocalMultiplier:
    """The variant's local multiplier against the baseline's three bracketing points, with its interval."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if n_boot < min_replicates(confidence):
        raise ValueError(
            f"a {confidence:.0%} interval needs at least {min_replicates(confidence)} bootstrap replicates, "
            f"got {n_boot}"
        )
    base, variant, seeds = _cells(ladder)
    n = len(seeds)
    log_compute = np.log([c.compute for c in base])
    log_c = math.log(variant.compute)
    bracket = tuple(float(c.compute / variant.compute) for c in base)
    losses = np.stack([c.losses for c in base], axis=1)  # [seeds, 3]
    v = variant.losses  # [seeds]
    widen = t_widening(n - 1, confidence)
    result = LocalMultiplier(None, seeds=seeds, bracket=bracket, t_widening=widen)
    point = _log_multipliers(np.log(losses.mean(0))[None], np.log([v.mean()]), log_compute, log_c)[0]
    result.extra["gap_at_variant_compute"] = _gap(losses.mean(0), v.mean(), log_compute, log_c)

    rng = np.random.default_rng(seed)
    draws = rng.integers(0, n, (n_boot, n))  # [replicates, seeds]: one draw of seeds serves every cell
    scale = math.sqrt(n / (n - 1))
    base_means = losses.mean(0) + scale * (losses[draws] - losses.mean(0)).mean(1)  # [replicates, 3]
    variant_means = v.mean() + scale * (v[draws] - v.mean()).mean(1)  # [replicates]
    if np.any(base_means <= 0) or np.any(variant_means <= 0):
        raise ValueError("losses must be positive")
    values = _log_multipliers(np.log(base_means), np.log(variant_means), log_compute, log_c)
    # a replicate outside the bracket settles its side of 1 only where the bracket's end is on that side
    values[np.isposinf(values) & (bracket[2] < 1.0)] = np.nan
    values[np.isneginf(values) & (bracket[0] > 1.0)] = np.nan
    undetermined = int(np.sum(np.isnan(values)))
    result.replicates, result.undetermined = n_boot - undetermined, undetermined

    if math.isnan(point):
        result.reason = "the baseline's mean loss does not fall across its three points"
        return result
    if math.isinf(point):
        bound = bracket[2] if point > 0 else bracket[0]
        side = "below the baseline's lowest" if point > 0 else "above the baseline's highest"
        result.reason = f"the variant's loss is {side} mean loss in the bracket"
        result.extra["at_least" if point > 0 else "at_most"] = bound
    else:
        result.estimate = math.exp(point)
    if undetermined > MAX_FAILED_REPLICATES * n_boot:
        result.reason = (result.reason + "; " if result.reason else "") + (
            f"{undetermined} of {n_boot} replicates undetermined (outside the bracket on the wrong side, or the "
            "baseline not falling)"
        )
        return result
    lo, hi = interval(values, confidence, widen)
    result.lower, result.upper = _exp(lo), _exp(hi)
    if result.lower > 1.0:
        result.verdict = VARIANT_BETTER
    elif result.upper < 1.0:
        result.verdict = BASELINE_BETTER
    else:
        result.verdict = NO_DIFFERENCE
    return result


def _exp(v: float) -> float:
    if v == math.inf or v > 700:
        return math.inf
    return 0.0 if v == -math.inf else math.exp(v)


def _gap(base_means: np.ndarray, variant_mean: float, log_compute: np.ndarray, log_c: float) -> float:
    """The baseline's loss at the variant's compute (interpolated in log-log) minus the variant's."""
    log_base = float(np.interp(log_c, log_compute, np.log(base_means)))
    return float(math.exp(log_base) - variant_mean)


# -- the tool --------------------------------------------------------------------------------------------
def read_local(source: str, metric: str = "val_bpb") -> tuple[str, Ladder]:
    """The decision and the local comparison's runs from a local table (the ladder table's columns)."""
    path = Path(source)
    if path.is_dir():
        path = path / LOCAL_FILE
    decision, rows = read_rows(ladder_csv(str(path)), minimum_rungs={"baseline": 3, "variant": 1}, one_multiple=False)
    return decision, Ladder(Run(r["arm"], r["rung"], r["seed"], r["train_flops"], r[metric]) for r in rows)


def markdown(decision: str, metric: str, result: LocalMultiplier, ladder: Ladder, confidence: float) -> str:
    s = result.summary()
    lines = [
        f"# Local multiplier: {decision}\n",
        f"The variant at one size against the baseline at three compute points around it (x{s['bracket'][0]:.3g}, "
        f"x{s['bracket'][1]:.3g}, x{s['bracket'][2]:.3g} the variant's compute), {len(s['seeds'])} paired seeds, "
        f"final `{metric}`; no law fitted, nothing extrapolated.\n",
        "| cell | compute | seeds | mean | sd |",
        "|---|---|---|---|---|",
    ]
    for (arm, rung), cell in sorted(ladder.cells.items(), key=lambda kv: (kv[0][0], kv[1].compute)):
        sd = f"{cell.spread:.4f}" if len(cell.losses) > 1 else "—"
        seeds = ", ".join(str(x) for x in sorted(cell.seeds, key=seed_order))
        lines.append(f"| {arm} {rung} | {cell.compute:.3g} | {seeds} | {cell.mean:.4f} | {sd} |")
    lo, hi = s["interval"]
    value = f"{s['estimate']:.4g}" if s["estimate"] is not None else "—"
    if "at_least" in s:
        value += f" (at least {s['at_least']:.3g})"
    if "at_most" in s:
        value += f" (at most {s['at_most']:.3g})"
    band = f"[{lo:.4g}, {hi:.4g}]" if lo is not None and hi is not None else ("[—, inf]" if lo is None else "—")
    if lo is not None and hi is None:
        band = f"[{lo:.4g}, inf]"
    verdict = s["verdict"] or f"no verdict ({s.get('reason', '')})"
    lines += [
        "",
        f"Multiplier {value} {band} at {confidence:.0%} ({s['replicates']} replicates, widened "
        f"x{s['t_widening']:.3g} for {len(s['seeds']) - 1} seed degrees of freedom): **{verdict}**.",
        f"Gap at the variant's compute (baseline - variant): {s['gap_at_variant_compute']:+.4f}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    @reports_errors("analysis.local_multiplier", ValueError)
    def run(argv):
        p = argparse.ArgumentParser(prog="analysis.local_multiplier", description=__doc__.splitlines()[0])
        p.add_argument("table", help=f"a local comparison's folder (holding {LOCAL_FILE}) or the CSV itself")
        p.add_argument("--confidence", type=finite_float(0.5, 0.999), default=0.9, help="interval level (0.9)")
        p.add_argument("--bootstrap", type=int_at_least(1), default=2000, help="bootstrap replicates (2000)")
        p.add_argument("--metric", choices=("val_bpb", "val_loss"), default="val_bpb", help="the column compared")
        p.add_argument("--out", type=new_output_path, default=None, help="output folder (default: the table's)")
        p.add_argument("--seed", type=int_at_least(0), default=0, help="the bootstrap's random seed")
        args = p.parse_args(argv)
        if args.bootstrap < min_replicates(args.confidence):
            raise ToolError(
                f"--bootstrap {args.bootstrap} is too few for a {args.confidence:.0%} interval (--confidence "
                f"{args.confidence:g}): at least {min_replicates(args.confidence)}"
            )
        decision, ladder = read_local(args.table, args.metric)
        result = local_multiplier(ladder, args.confidence, args.bootstrap, args.seed)
        source = Path(args.table)
        out = Path(args.out) if args.out else (source if source.is_dir() else source.parent)
        out.mkdir(parents=True, exist_ok=True)
        summary = {"decision": decision, "metric": args.metric, "confidence": args.confidence, **result.summary()}
        (out / "local.json").write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n")
        (out / "local.md").write_text(markdown(decision, args.metric, result, ladder, args.confidence))
        print(f"local multiplier: {summary['estimate']} {summary['interval']}: {result.verdict or result.reason}")
        return 0

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
