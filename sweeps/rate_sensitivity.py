"""A learning-rate sensitivity study of one decision: both arms at one rung over a wide sweep of rates, the
same rates for both, several seeds; ``python -m sweeps.run ladder DECISION --rate-sensitivity``.

The preset's ``sensitivity:`` section: ``rung`` (default the ladder's second), ``factors`` of ``lr.base``
(default 2^-3 to 2^4, a factor of two apart), ``seeds`` (default the preset's), ``tokens_per_param``
(default the smallest branch multiple) and ``tolerance`` (the basin's, in bits per byte; default 0.02).
Each run follows the ladder's rung rule (batch, warmup, run seeds: ``sweeps/ladder_plan.py``) at that
budget, at rate ``lr.base x factor``. A run that fails (a rate that diverges) is a diverged point, not
an error. The folder ``<output-root>/ladders/<DECISION>-<PRESET>-sensitivity/`` gets
``sensitivity.csv``, the curves, and ``python -m analysis.rate_sensitivity_report``'s report.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from sweeps.ladder_plan import (
    ARMS,
    LadderError,
    LadderRun,
    Preset,
    check_keys,
    load_decision,
    plan,
    run_overrides,
    runs_folder,
)
from sweeps.ladder_rungs import Rung
from sweeps.run_state import hold_runs_folder, keep_curves, train_unfinished

REPO = Path(__file__).resolve().parent.parent
DEFAULT_FACTORS = [2.0**e for e in range(-3, 5)]
KEYS = ("rung", "factors", "seeds", "tokens_per_param", "tolerance")
COLUMNS = ("decision", "arm", "seed", "lr", "lr_factor", "val_bpb", "val_loss", "train_tokens", "train_flops",
           "steps", "batch_rows", "run_seed", "run_dir")  # fmt: skip


def sensitivity_preset(preset: Preset) -> Preset:
    """The preset of the study: one rung, no branches, its seeds and budget; a runs folder of its own."""
    spec = preset.sensitivity
    check_keys("sensitivity", spec, KEYS)
    rung = Rung(*(int(v) for v in spec["rung"])) if "rung" in spec else preset.rungs[min(1, len(preset.rungs) - 1)]
    try:
        rung.check()
    except ValueError as err:
        raise LadderError(f"sensitivity.rung: {err}") from None
    factors = sorted(float(f) for f in spec.get("factors", DEFAULT_FACTORS))
    if len(factors) < 3:
        raise LadderError("sensitivity.factors: a sensitivity curve needs at least 3 rates")
    smallest = preset.branch_multiples[0] if preset.branch_multiples else preset.tokens_per_param
    return replace(
        preset,
        name=f"{preset.name}-sensitivity",
        rungs=[rung],
        tokens_per_param=float(spec.get("tokens_per_param", smallest)),
        branch_multiples=[],
        seeds=[int(s) for s in spec.get("seeds", preset.seeds)],
        lr_factors=factors,
        lr_sweep_rungs=1,
        lr_check_factors=[],
    )


def plan_sensitivity(decision: str, study: Preset, extra: list[str], arms: dict[str, list[str]]) -> list[LadderRun]:
    """Every (arm, factor, seed) run at the study's rung, each at ``lr.base x factor`` (the same rates in
    both arms), with the batch, warmup and run seed the ladder's rule gives that rung."""
    out = []
    for run in plan(decision, study, extra, arms):
        if run.phase != "stable":
            continue
        for f in study.lr_factors:
            name = f"{run.name}-lrx{f:g}"
            out.append(replace(run, name=name, lr_factor=f, lr=study.lr_base * f, checkpoint_every=None))
    return out


def rows(decision: str, runs: list[LadderRun], summaries: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run; a run without a finished summary (it failed or diverged) has an empty loss."""
    out = []
    for run in runs:
        s = summaries.get(run.name) or {}
        val = s.get("val") or {}
        out.append(
            {
                "decision": decision,
                "arm": run.arm,
                "seed": run.seed,
                "lr": f"{run.lr:.6g}",
                "lr_factor": run.lr_factor,
                "val_bpb": val.get("bpb", ""),
                "val_loss": val.get("loss", ""),
                "train_tokens": s.get("train_tokens", run.tokens),
                "train_flops": (s.get("compute") or {}).get("train_flops", run.flops),
                "steps": run.steps,
                "batch_rows": run.batch_rows if run.batch_rows is not None else "",
                "run_seed": run.run_seed,
                "run_dir": s.get("run_dir", ""),
            }
        )
    return out


def run_sensitivity(
    decision: str, preset: Preset, extra: list[str], output_root: Path, jobs: int, report: bool = True
) -> Path:
    arms = {arm: load_decision(decision)[arm] for arm in ARMS}
    study = sensitivity_preset(preset)
    runs = plan_sensitivity(decision, study, extra, arms)
    folder = output_root / "ladders" / f"{decision}-{study.name}"
    runs_dir = runs_folder(output_root, study, extra)
    runs_dir.mkdir(parents=True, exist_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    with hold_runs_folder(runs_dir):  # released when training ends, not left to the garbage collector
        summaries, failed = train_unfinished(
            runs, lambda r: run_overrides(r, arms[r.arm], study, extra, runs_dir), runs_dir, jobs
        )
    if failed and not summaries:
        raise LadderError(f"every run failed ({', '.join(failed)}): not divergence; see {runs_dir}")
    if failed:  # high rates are meant to fail; the table marks them diverged
        print(f"{len(failed)} runs failed (diverged points in the table): {', '.join(failed)}")
    table = folder / "sensitivity.csv"
    with open(table, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS))
        writer.writeheader()
        writer.writerows(rows(decision, runs, summaries))
    print(f"sensitivity table: {table}\ncurves: {keep_curves(folder, runs, summaries)} runs")
    if report:
        cmd = [sys.executable, "-m", "analysis.rate_sensitivity_report", str(table)]
        tolerance = study.sensitivity.get("tolerance")
        cmd += ["--tolerance", str(tolerance)] if tolerance is not None else []
        if subprocess.run(cmd, cwd=REPO).returncode != 0:
            raise LadderError(f"the report failed; rerun: python {' '.join(cmd[1:])}")
    return folder
