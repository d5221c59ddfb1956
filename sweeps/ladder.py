"""A scaling ladder: one K3 decision's two arms trained at several sizes with compute-proportional budgets.

``python -m sweeps.run ladder DECISION [--preset cpu|cpu_depth|gpu] [--jobs N] [--dry-run] [--local |
--rate-sensitivity | --recall] [overrides...]``

A decision is ``sweeps/ladders/<DECISION>.yaml`` (``baseline`` and ``variant``: override lists, e.g.
``experiment=k3_small_plain_residual`` against ``experiment=k3_small``); a preset is
``sweeps/ladders/presets/<PRESET>.yaml`` (the rungs, tokens per parameter, seeds, learning-rate sweep,
data and trainer). Rung sizes follow one rule that keeps K3's shape (``sweeps/ladder_rungs.py``); the
runs, their budgets and the choice of learning rates are planned in ``sweeps/ladder_plan.py``, and this
module carries the plan out: it starts the runs (``sweeps/run_pool.py``), keeps track of the finished
ones, holds the runs folder's lock and writes the table.

The ladder runs in three phases, each as many runs at once as ``--jobs`` allows:

1. learning rates: each arm at the ``lr.sweep_rungs`` smallest rungs, seed ``seeds[0]``, at every
   ``lr.factors`` x ``lr.base``, on the smallest token budget. The best rate per arm and rung is fitted
   as a power of the active parameters and applied to every rung of that arm (equal tuning for both
   arms); a best rate at the edge of its sweep is flagged (``lr_edge`` in ``ladder.csv``).
2. stable runs: each arm x rung x seed, warmup-stable-decay to ``tokens_per_param`` tokens per active
   parameter, checkpointed where the branches start;
3. cooldown branches: for each of ``branch_multiples`` (fewer tokens per parameter), a branch from the
   stable run's checkpoint at the step its own decay begins (``init_from``), decaying to its budget: a
   second compute point per rung for a tenth of the stable run's cost or so.

Every run has a fixed name, so the same command after an interruption skips finished runs and resumes
the others from their last checkpoint (``ckpt_path=last``). The ladder folder
``<output-root>/ladders/<DECISION>-<PRESET>/`` ends with ``ladder.csv`` (one row per compute point)
and, per token multiple, the fits and figures of ``python -m analysis.ladder_report`` in ``tpp<M>/``.
``--dry-run`` prints every run with its parameters, tokens and FLOPs and the estimated time: on a CPU
preset from a few measured steps per rung (``--measure-steps``), on a GPU preset in GPU-hours at the
preset's peak and MFU.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import yaml

from components.base import ConfigError
from runtime.json_records import read_json_lines
from runtime.rate_probe import Rate, probe_rate
from sweeps.ladder_plan import (
    ARMS,
    PRESETS,
    LadderError,
    LadderRun,
    Preset,
    _names,
    check_learning_rates,
    choose_learning_rates,
    decision_names,
    load_decision,
    load_preset,
    local_preset,
    lr_rule_text,
    plan,
    plan_local,
    print_plan,
    run_overrides,
    runs_folder,
)
from sweeps.ladder_rungs import Rung
from sweeps.rate_sensitivity import plan_sensitivity, run_sensitivity, sensitivity_preset
from sweeps.recall_study import plan_recall, recall_preset, run_recall
from sweeps.run_state import hold_runs_folder, keep_curves, train_unfinished

LOCAL_FILE = "local.csv"  # a local comparison's table (analysis/local_multiplier.py reads it)

REPO = Path(__file__).resolve().parent.parent


# -- state ---------------------------------------------------------------------------------------------
def ladder_rows(
    decision: str,
    runs: list[LadderRun],
    summaries: dict[str, dict[str, Any]],
    edges: dict[str, dict[str, str]],
    rule: str = "",
    checks: Optional[dict[str, dict[str, Any]]] = None,
    by_budget: bool = False,
) -> list[dict[str, Any]]:
    """One ``ladder.csv`` row per finished stable or branch run: a compute point of one arm. A branch's
    rung is ``<rung>@tpp<M>`` (every run's, with ``by_budget``: a local comparison's points are budgets)."""
    rows = []
    for run in runs:
        if run.phase in ("lr", "lr_check") or run.name not in summaries:
            continue
        s = summaries[run.name]
        compute = s.get("compute") or {}
        params = compute.get("params") or {}
        budget = run.phase == "branch" or by_budget
        rows.append(
            {
                "decision": decision,
                "arm": run.arm,
                "rung": f"{run.rung.name}@tpp{run.tokens_per_param:g}" if budget else run.rung.name,
                "seed": run.seed,
                "tokens_per_param": run.tokens_per_param,
                "non_embedding_params": params.get("non_embedding", run.size.non_embedding_params),
                "active_params": params.get("active", run.size.active_params),
                "train_tokens": s.get("train_tokens", run.tokens),
                "train_flops": compute.get("train_flops", run.flops),
                "val_bpb": s["val"].get("bpb", float("nan")),
                "val_loss": s["val"]["loss"],
                "lr": run.lr,
                "lr_edge": edges.get(run.arm, {}).get(run.rung.name, ""),
                "run_dir": s.get("run_dir", ""),
                **stability_metrics(s.get("run_dir", "")),
                "run_seed": run.run_seed,
                "batch_rows": run.batch_rows if run.batch_rows is not None else "",
                "tokens_per_step": run.size.tokens_per_step,
                "steps": run.steps,
                "warmup_steps": run.warmup,
                "lr_rule": rule,
                "lr_check": (checks or {}).get(run.arm, {}).get("flag", ""),
            }
        )
    return rows


# the balancers' mean MaxVio as a run logs it (runtime/lit_module.py logs balancer metrics as balance/<key>)
MAXVIO_KEY = "balance/maxvio/mean"
SPIKE_FACTOR = 3.0  # a logged gradient norm above this many times the run's median counts as a spike


def stability_metrics(run_dir: str) -> dict[str, Any]:
    """The stability columns of a run's row, from its ``metrics.jsonl``: ``maxvio`` (the last logged
    mean MaxVio over routed layers; empty without routed layers), ``grad_norm_spikes`` (logged
    gradient norms after the first tenth of the run above ``SPIKE_FACTOR`` x the run's median) and
    ``max_activation`` (the largest GLU intermediate at the last validation, ``act/glu_max``)."""
    path = Path(run_dir) / "metrics.jsonl"
    records = read_json_lines(path) if path.is_file() else []
    maxvio = [r[MAXVIO_KEY] for r in records if isinstance(r.get(MAXVIO_KEY), (int, float))]
    activation = [r["act/glu_max"] for r in records if isinstance(r.get("act/glu_max"), (int, float))]
    norms = [
        (r.get("step", 0), r["train/grad_norm"]) for r in records if isinstance(r.get("train/grad_norm"), (int, float))
    ]
    spikes: Any = ""
    if norms:
        last = max(step for step, _ in norms)
        kept = [n for step, n in norms if step >= last / 10]
        median = sorted(kept)[len(kept) // 2]
        spikes = sum(n > SPIKE_FACTOR * median for n in kept)
    return {
        "maxvio": maxvio[-1] if maxvio else "",
        "grad_norm_spikes": spikes,
        "max_activation": activation[-1] if activation else "",
    }


# how each run was trained, beside the report's columns (which it ignores)
RUN_COLUMNS = ("run_seed", "batch_rows", "tokens_per_step", "steps", "warmup_steps", "lr_rule", "lr_check")


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    from analysis.ladder_report import REQUIRED, STABILITY  # start-up time: scipy, only when the table is written

    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*REQUIRED, "tokens_per_param", "lr_edge", *STABILITY, *RUN_COLUMNS])
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


# -- measuring and printing ----------------------------------------------------------------------------
def measure_rate(overrides: list[str], steps: int, jobs: int = 1) -> Rate:
    """A rung's rate with ``jobs`` copies training at once, as the ladder will run them."""
    try:
        return probe_rate(overrides, steps, copies=jobs)
    except RuntimeError as err:
        raise LadderError(f"measuring the rate failed: {err}") from None


# -- running -------------------------------------------------------------------------------------------
def _launch(
    runs: list[LadderRun], arms: dict[str, list[str]], preset: Preset, extra: list[str], runs_dir: Path, jobs: int
) -> dict[str, dict[str, Any]]:
    """Run every unfinished run (up to ``jobs`` at once); returns the summaries of all finished ones. Any
    failure stops the ladder: its points are all needed."""
    summaries, failed = train_unfinished(
        runs, lambda r: run_overrides(r, arms[r.arm], preset, extra, runs_dir), runs_dir, jobs
    )
    if failed:
        raise LadderError(f"runs failed: {', '.join(failed)} (rerun the same command to retry them)")
    for r in runs:
        if r.name not in summaries:
            raise LadderError(f"run {r.name} ended without finishing its steps (see {runs_dir / r.name})")
    return summaries


def _trained_settings(folder: Path) -> Optional[dict[str, Optional[float]]]:
    """The learning rate, warmup steps and batch rows a run folder was trained with (its composed config):
    None without a readable config, a setting None where the config lacks it."""
    try:
        config = yaml.safe_load((folder / ".hydra" / "config.yaml").read_text())
        lr = float(config["optimizer"]["lr"])
    except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError):
        return None
    optimizer, data = config.get("optimizer") or {}, config.get("data") or {}
    return {"lr": lr, "warmup": optimizer.get("warmup_steps"), "batch": data.get("batch_size")}


def _mismatch(run: LadderRun, trained: dict[str, Optional[float]]) -> Optional[str]:
    """How a folder's settings differ from the run's plan (the rate as run_overrides passes it), or None."""
    planned = float(f"{run.lr:.6g}")
    if not math.isclose(trained["lr"], planned, rel_tol=1e-5):
        return f"trained at lr {trained['lr']:.6g}, the ladder now chooses {planned:.6g}"
    if trained["warmup"] is not None and int(trained["warmup"]) != run.warmup:
        return f"trained with {trained['warmup']} warmup steps, the plan has {run.warmup}"
    if run.batch_rows is not None and trained["batch"] is not None and int(trained["batch"]) != run.batch_rows:
        return f"trained on batches of {trained['batch']} rows, the plan has {run.batch_rows}"
    return None


def set_aside_stale_runs(runs: list[LadderRun], runs_dir: Path) -> list[Path]:
    """Move aside the folders of stable and branch runs trained (or begun) under other settings than the
    plan's (another learning rate, warmup or batch), so they are trained again instead of being taken as
    finished or resumed: a changed rate rule, learning-rate runs that changed, or another decision sharing
    an arm (its baseline sets the shared arm's rate under the baseline rule) would otherwise leave other
    settings in the table. A folder moves to ``stale/<folder>-lr<rate>`` in the runs folder, never
    deleted; a stale folder whose settings are the plan's comes back (two decisions sharing an arm then
    take turns without retraining it). Returns the paths moved aside."""
    moved = []
    stale_dir = runs_dir / "stale"
    for run in runs:
        if run.phase == "lr" or run.lr is None:
            continue
        for folder in [runs_dir / run.name, *sorted(runs_dir.glob(f"{glob.escape(run.name)}-[0-9]*"))]:
            trained = _trained_settings(folder)
            why = trained and _mismatch(run, trained)
            if not why:
                continue
            target = stale_dir / f"{folder.name}-lr{trained['lr']:.6g}"
            n = 1
            while target.exists():
                n += 1
                target = stale_dir / f"{folder.name}-lr{trained['lr']:.6g}-{n}"
            stale_dir.mkdir(exist_ok=True)
            folder.rename(target)
            print(f"{folder.name}: {why}: moved to {target}")
            moved.append(target)
        if (runs_dir / run.name).exists() or not stale_dir.is_dir():
            continue
        for folder in sorted(stale_dir.glob(f"{glob.escape(run.name)}-lr*")):
            trained = _trained_settings(folder)
            rest = folder.name[len(run.name) :]
            if re.fullmatch(r"-lr[0-9.e+-]+(-[0-9]+)?", rest) and trained and not _mismatch(run, trained):
                folder.rename(runs_dir / run.name)
                print(f"{run.name}: trained under the plan's settings before: restored from {folder}")
                break
    return moved


def run_ladder(
    decision: str,
    preset: Preset,
    extra: list[str],
    output_root: Path,
    jobs: int,
    report: bool = True,
    local: bool = False,
) -> Path:
    """Train the ladder (with ``local``, the local comparison at the preset's ``local`` rung) and write its
    table, curves, learning rates and reports into its folder; returns the folder."""
    arms = {arm: load_decision(decision)[arm] for arm in ARMS}
    if local:
        preset = local_preset(preset)
        runs = plan_local(decision, preset, extra, arms)
    else:
        runs = plan(decision, preset, extra, arms)
    folder = output_root / "ladders" / f"{decision}-{preset.name}"
    runs_dir = runs_folder(output_root, preset, extra)
    runs_dir.mkdir(parents=True, exist_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    print(f"runs of preset {preset.name}: {runs_dir}")
    with hold_runs_folder(runs_dir):  # released when training ends, not left to the garbage collector
        lr_runs = [r for r in runs if r.phase == "lr"]
        summaries = _launch(lr_runs, arms, preset, extra, runs_dir, jobs)
        chosen = choose_learning_rates(runs, summaries, preset)
        for run in runs:
            if run.phase != "lr":
                run.lr = chosen[run.arm][0][run.rung.name] * (run.lr_factor if run.phase == "lr_check" else 1.0)
        set_aside_stale_runs(runs, runs_dir)
        stable = [r for r in runs if r.phase in ("lr_check", "stable")]
        summaries.update(_launch(stable, arms, preset, extra, runs_dir, jobs))
        checks = check_learning_rates(runs, summaries)
        rule = lr_rule_text(preset)
        record = {arm: {"lr": rates, "edge": edges, "check": checks.get(arm)} for arm, (rates, edges) in chosen.items()}
        (folder / "learning_rates.json").write_text(json.dumps({"rule": rule, **record}, indent=1))
        branches = [r for r in runs if r.phase == "branch"]
        for run in branches:
            run.init_from = summaries[run.branch_of]["run_dir"]
        summaries.update(_launch(branches, arms, preset, extra, runs_dir, jobs))
    edges = {arm: edge for arm, (_, edge) in chosen.items()}
    table = folder / (LOCAL_FILE if local else "ladder.csv")
    write_csv(table, ladder_rows(decision, runs, summaries, edges, rule, checks, by_budget=local))
    print(f"ladder folder: {folder}\nladder table: {table}\ncurves: {keep_curves(folder, runs, summaries)} runs")
    if report and local:
        cmd = [sys.executable, "-m", "analysis.local_multiplier", str(table)]
        if subprocess.run(cmd, cwd=REPO).returncode != 0:
            raise LadderError(f"the report failed; rerun: python {' '.join(cmd[1:])}")
    elif report:  # one fit per token multiple: each is one compute frontier (analysis/ladder_report.py)
        for multiple in [preset.tokens_per_param, *preset.branch_multiples]:
            out = folder / f"tpp{multiple:g}"
            cmd = [sys.executable, "-m", "analysis.ladder_report", str(table)]
            cmd += ["--tokens-per-param", f"{multiple:g}", "--out", str(out)]
            if subprocess.run(cmd, cwd=REPO).returncode != 0:
                raise LadderError(f"the report failed; rerun: python {' '.join(cmd[1:])}")
            print(f"report at {multiple:g} tokens per parameter: {out / 'table.md'}")
    return folder


def parse_rung(text: str) -> Rung:
    """``32x8`` or ``d32x8``: d_model 32 with 8 layers, checked against the rung rule."""
    match = re.fullmatch(r"d?(\d+)x(\d+)", text.strip())
    if not match:
        raise LadderError(f"--rung: expected D_MODELxN_LAYERS (e.g. 32x8), got {text!r}")
    rung = Rung(int(match.group(1)), int(match.group(2)))
    try:
        rung.check()
    except ValueError as err:
        raise LadderError(f"--rung: {err}") from None
    return rung


def at_rung(preset: Preset, rung: Rung, study: str) -> Preset:
    """The preset with ``study``'s rung replaced, named ``<preset>-<rung>`` so its folders stand apart."""
    name = f"{preset.name}-{rung.name}"
    if study == "--recall" and not preset.recall:  # the sensitivity section has defaults; this one has none
        raise LadderError(f"--rung: preset {preset.name} has no recall: section to move to {rung.name}")
    pair = [rung.d_model, rung.n_layers]
    if study == "--local":
        return replace(preset, name=name, local_rung=rung)
    if study == "--rate-sensitivity":
        return replace(preset, name=name, sensitivity={**preset.sensitivity, "rung": pair})
    return replace(preset, name=name, recall={**preset.recall, "rungs": [pair]})


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sweeps.run ladder", description=__doc__.splitlines()[0])
    p.add_argument("decision", help="one of: " + ", ".join(decision_names()))
    p.add_argument(
        "--preset", default="cpu", help="one of: " + ", ".join(_names(PRESETS)) + "; or the path of a preset YAML file"
    )
    p.add_argument("--jobs", type=int, default=1, help="runs at once (default 1)")
    p.add_argument("--dry-run", action="store_true", help="print every run, its FLOPs and estimated time")
    p.add_argument(
        "--measure-steps", type=int, default=8, help="dry-run: steady-state steps timed per rung (0: do not time)"
    )
    p.add_argument("--output-root", default="outputs", help="the ladder folder goes under <output-root>/ladders/")
    p.add_argument("--no-report", action="store_true", help="stop after ladder.csv (no fits or figures)")
    p.add_argument(
        "--local",
        action="store_true",
        help="a local comparison instead: the variant at one rung against the baseline at three compute points "
        "around it (the preset's local: section), read off without a law (analysis.local_multiplier)",
    )
    p.add_argument(
        "--rate-sensitivity",
        action="store_true",
        help="a learning-rate sensitivity study instead: both arms at one rung over a wide sweep of rates (the "
        "preset's sensitivity: section), the width of each arm's stable basin (analysis.rate_sensitivity_report)",
    )
    p.add_argument(
        "--recall",
        action="store_true",
        help="an associative-recall study instead, for mixer decisions: both arms at the preset's rungs trained "
        "on MQAR (the preset's recall: section), accuracy per test segment against decoding state size, beside "
        "the ladder's loss (sweeps/recall_study.py)",
    )
    p.add_argument(
        "--rung",
        default=None,
        help="with --local, --rate-sensitivity or --recall: the rung to study instead of the preset's (e.g. 32x8: "
        "d_model 32, 8 layers); its runs and folders are named <preset>-d32x8-local (-sensitivity, -recall)",
    )
    args, extra = p.parse_known_args(argv)
    try:
        if args.jobs < 1:
            raise LadderError(f"--jobs must be at least 1, got {args.jobs}")
        if args.measure_steps < 0:
            raise LadderError(f"--measure-steps must be 0 or more, got {args.measure_steps}")
        preset = load_preset(args.preset)
        decision = load_decision(args.decision)
        studies = [flag for flag, on in [("--local", args.local), ("--rate-sensitivity", args.rate_sensitivity),
                                         ("--recall", args.recall)] if on]  # fmt: skip
        if len(studies) > 1:
            raise LadderError(f"{' and '.join(studies)} are different studies: choose one")
        ladder_name = None
        if args.rung is not None:
            if not studies:
                raise LadderError("--rung goes with --local, --rate-sensitivity or --recall (a ladder runs every rung)")
            ladder_name = f"{args.decision}-{preset.name}"  # the recall study sets the ladder's loss beside it
            preset = at_rung(preset, parse_rung(args.rung), studies[0])
        if args.dry_run:
            arms = {arm: decision[arm] for arm in ARMS}
            if args.rate_sensitivity:
                preset = sensitivity_preset(preset)
                runs = plan_sensitivity(args.decision, preset, extra, arms)
            elif args.recall:
                preset = recall_preset(preset)
                runs = plan_recall(args.decision, preset, extra, arms)
            elif args.local:
                preset = local_preset(preset)
                runs = plan_local(args.decision, preset, extra, arms)
            else:
                runs = plan(args.decision, preset, extra, arms)
            rates: dict[str, Rate] = {}
            if preset.peak_flops is None and args.measure_steps:
                for rung in preset.rungs:
                    probe = replace(next(r for r in runs if r.rung == rung and r.arm == "variant"), lr=None)
                    overrides = run_overrides(probe, decision["variant"], preset, extra, Path("."))
                    overrides = [
                        o for o in overrides if not o.startswith(("name=", "ckpt_path=", "trainer.max_steps="))
                    ]
                    rates[rung.name] = measure_rate(overrides, args.measure_steps, args.jobs)
            print(f"ladder {args.decision} ({decision.get('description', '')}), preset {preset.name}")
            print_plan(runs, preset, rates, args.jobs)
            return 0
        output_root = Path(args.output_root).resolve()
        ladder_table = output_root / "ladders" / (ladder_name or f"{args.decision}-{preset.name}") / "ladder.csv"
        if args.rate_sensitivity:
            run_sensitivity(args.decision, preset, extra, output_root, args.jobs, not args.no_report)
            return 0
        if args.recall:
            run_recall(args.decision, preset, extra, output_root, args.jobs, not args.no_report, ladder_table)
            return 0
        run_ladder(args.decision, preset, extra, output_root, args.jobs, not args.no_report, args.local)
    except LadderError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        if isinstance(err, ConfigError):
            print(f"error: {err}", file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
