"""Associative recall beside the loss, for decisions about the sequence mixer: both arms at every rung
trained on multi-query associative recall (Zoology's MQAR, ``components/data/mqar.py``), accuracy per
test segment against the decoding state each model holds for a sequence of that segment's length;
``python -m sweeps.run ladder DECISION --recall``.

A loss ladder says how much compute a mixer saves; it does not say what a fixed-size recurrent state
cannot hold. The preset's ``recall:`` section:

* ``rungs``: the shapes trained (default the preset's own, so the points sit beside the ladder's);
* ``overrides``: the task, applied after the preset's overrides (``data=mqar``, its vocabulary, sequence
  length and segments; the rest of the preset -- precision, logger -- still applies);
* ``steps``, ``batch_size`` and ``warmup_fraction`` (of the steps; default the preset's);
* ``lrs``: every arm, rung and seed trains at each rate, and the best by mean accuracy over the test
  segments stands for the point, as Zoology reports each architecture at its best rate (a best rate at
  the sweep's edge is named in the table);
* ``seeds`` (default ``[0]``).

Runs get a runs folder of their own. The folder ``<output-root>/ladders/<DECISION>-<PRESET>-recall/``
gets ``recall.csv`` and ``recall.md`` (one row per arm, rung and seed at its best rate: the decoding
state per token and fixed, the accuracy of every segment, and the arm's bits per byte at that rung from
the ladder table of the same decision and preset, ``<DECISION>-<PRESET>/ladder.csv``, where that ladder
has run), ``recall_state.png`` (accuracy against state size, one panel per segment: its length and
number of pairs) and, where the rungs differ in width, ``recall_width.png``.
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

from sweeps.ladder_plan import (
    ARMS,
    LadderError,
    LadderRun,
    Preset,
    account,
    arm_overrides,
    arm_slug,
    check_keys,
    load_decision,
    run_overrides,
    run_seed,
    runs_folder,
)
from sweeps.ladder_rungs import Rung
from sweeps.run_state import hold_runs_folder, keep_curves, train_unfinished

KEYS = ("rungs", "overrides", "steps", "batch_size", "warmup_fraction", "lrs", "seeds")
REQUIRED = ("overrides", "steps", "batch_size", "lrs")


def _number(where: str, key: str, value: Any, kind: type, low: float) -> Any:
    """``value`` as ``kind`` (int or float), at least ``low`` (above 0 when ``low`` is 0 and kind float)."""
    try:
        number = kind(value)
    except (TypeError, ValueError):
        number = None
    if number is None or number < low or (kind is float and low == 0 and number <= 0):
        bound = f"at least {low}" if kind is int else "positive"
        raise LadderError(f"{where}.{key}: must be a {bound} {kind.__name__}, got {value!r}")
    return number


def _distinct(where: str, key: str, values: list[Any]) -> list[Any]:
    if len(set(values)) < len(values):
        raise LadderError(f"{where}.{key}: {values} repeats a value (two runs would share one folder)")
    return values


def recall_preset(preset: Preset) -> Preset:
    """The preset of the study: its rungs and seeds, the task's overrides after the preset's (after its
    accounting overrides too, so a GPU preset counts the task's tokens), no branches or rate sweep (its
    rates are ``recall.lrs``). Its ``recall`` holds the section checked and in plain numbers: the runs
    folder's hash takes it (``runs_folder(..., study=...)``)."""
    spec = preset.recall
    where = f"preset {preset.name}: recall"
    if not spec:
        raise LadderError(f"preset {preset.name} has no recall: section (keys: {', '.join(KEYS)})")
    check_keys(where, spec, KEYS, REQUIRED)
    rungs = list(preset.rungs)
    if "rungs" in spec:
        try:
            rungs = [Rung(int(d), int(n)) for d, n in spec["rungs"]]
        except (TypeError, ValueError):
            raise LadderError(f"{where}.rungs: a list of [d_model, n_layers] pairs, got {spec['rungs']!r}") from None
    for rung in rungs:
        try:
            rung.check()
        except ValueError as err:
            raise LadderError(f"{where}.rungs: {err}") from None
    _distinct(where, "rungs", rungs)
    overrides = spec["overrides"]
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise LadderError(f"{where}.overrides: a list of train.py overrides (data=mqar and its settings)")
    if "data=mqar" not in overrides:
        raise LadderError(f"{where}.overrides: must choose the recall task (data=mqar)")
    lrs = spec["lrs"]
    if not isinstance(lrs, list) or not lrs:
        raise LadderError(f"{where}.lrs: a non-empty list of positive learning rates, got {lrs!r}")
    lrs = _distinct(where, "lrs", sorted(float(f"{_number(where, 'lrs', x, float, 0):.6g}") for x in lrs))
    seeds = spec.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds:
        raise LadderError(f"{where}.seeds: a non-empty list of seeds, got {seeds!r}")
    seeds = _distinct(where, "seeds", [_number(where, "seeds", x, int, 0) for x in seeds])
    warmup = spec.get("warmup_fraction", preset.warmup_fraction)
    try:
        warmup = float(warmup)
    except (TypeError, ValueError):
        warmup = -1.0
    if not 0 <= warmup < 1:
        raise LadderError(f"{where}.warmup_fraction: must lie in [0, 1), got {spec.get('warmup_fraction')!r}")
    checked = {
        "overrides": list(overrides),
        "steps": _number(where, "steps", spec["steps"], int, 1),
        "batch_size": _number(where, "batch_size", spec["batch_size"], int, 1),
        "warmup_fraction": warmup,
        "lrs": lrs,
    }
    return replace(
        preset,
        name=f"{preset.name}-recall",
        rungs=rungs,
        overrides=[*preset.overrides, *overrides],
        accounting_overrides=[*preset.accounting_overrides, *overrides] if preset.accounting_overrides else [],
        branch_multiples=[],
        seeds=seeds,
        lr_factors=[1.0],
        lr_sweep_rungs=1,
        lr_check_factors=[],
        min_steps=None,
        recall=checked,
    )


def plan_recall(
    decision: str, study: Preset, extra: list[str], arms_overrides: dict[str, list[str]]
) -> list[LadderRun]:
    """Every (arm, rung, seed, rate) run: ``recall.steps`` steps of ``recall.batch_size`` examples, the
    warmup a share of the steps, the run seed the ladder's (seed, rung) seed, so both arms see the same
    examples in the same order at a rung."""
    spec = study.recall
    steps, rows = spec["steps"], spec["batch_size"]
    warmup = max(1, round(spec["warmup_fraction"] * steps))
    slugs = {arm: arm_slug(arms_overrides[arm]) for arm in ARMS}
    if slugs["baseline"] == slugs["variant"]:  # an A/A study: the same runs twice would be one set
        slugs = {arm: f"{slugs[arm]}-{arm}" for arm in ARMS}
    runs = []
    for arm in ARMS:
        for rung in study.rungs:
            size = account(arm_overrides(arms_overrides[arm], rung, study, extra, accounting=True))
            size = replace(size, tokens_per_step=rows * size.seq_len * size.accumulate)
            for seed in study.seeds:
                for lr in spec["lrs"]:
                    runs.append(
                        LadderRun(
                            f"{slugs[arm]}-{rung.name}-mqar-s{seed}-lr{lr:g}",
                            "recall",
                            arm,
                            rung,
                            seed,
                            tokens_per_param=steps * size.tokens_per_step / size.active_params,
                            steps=steps,
                            warmup=warmup,
                            size=size,
                            run_seed=run_seed(seed, rung),
                            batch_rows=rows,
                            lr=lr,
                        )
                    )
    return runs


def _as_run(run: LadderRun, summary: dict[str, Any], label: str) -> SimpleNamespace:
    """A finished run as ``analysis.recall`` reads one: its summary, its arm as the line, its rate tuned."""
    varied = {"point": label, "optimizer.lr": f"{run.lr:g}", "seed": run.seed}
    return SimpleNamespace(summary=summary, varied=varied, label=f"{label} {run.rung.name} s{run.seed}", ladder=run)


def ladder_bpb(table: Path) -> dict[tuple[str, str], float]:
    """Each (arm, rung)'s mean validation bits per byte over seeds in a ladder table, at its main token
    budget (rows whose rung carries no ``@tpp`` branch suffix); empty when the ladder has not run."""
    if not table.is_file():
        return {}
    values: dict[tuple[str, str], list[float]] = {}
    with open(table, newline="") as f:
        for row in csv.DictReader(f):
            try:
                bpb = float(row["val_bpb"])
            except (KeyError, ValueError):
                continue
            if math.isfinite(bpb) and "@" not in row.get("rung", "@"):
                values.setdefault((row["arm"], row["rung"]), []).append(bpb)
    return {key: sum(v) / len(v) for key, v in values.items()}


def recall_rows(
    decision: str,
    runs: list[LadderRun],
    summaries: dict[str, dict[str, Any]],
    labels: dict[str, str],
    bpb: dict[tuple[str, str], float],
) -> tuple[list[str], list[list[Any]], list[Any]]:
    """The study's table (header, rows) and the best runs it rests on, one per (arm, rung, seed). A run
    without a summary (its rate diverged) loses to every finished one and is listed in ``lrs_failed``; a
    best rate is at an edge only among three or more (of two, one always is)."""
    from analysis import recall  # start-up time: matplotlib, only when the table is written

    found = [_as_run(r, summaries[r.name], labels[r.arm]) for r in runs if r.name in summaries]
    best = recall.best_runs(found)
    segs = recall.segments(best)
    rates: dict[tuple[str, Rung, int], list[LadderRun]] = {}
    for r in runs:
        rates.setdefault((r.arm, r.rung, r.seed), []).append(r)
    empty = [
        f"{arm} {rung.name} seed {seed}"
        for (arm, rung, seed), tried in rates.items()
        if not any(r.name in summaries for r in tried)
    ]
    if empty:
        raise LadderError(f"every rate failed for {', '.join(empty)}: give recall.lrs lower rates (see the runs)")
    header = ["decision", "arm", "rung", "seed", "lr", "lr_edge", "lrs_failed", "state_per_token", "state_fixed",
              *[f"accuracy/T{t}_P{p}" for t, p in segs], "ladder_val_bpb", "run_dir"]  # fmt: skip
    rows = []
    for b in best:
        run, state = b.ladder, b.summary.get("decode_state_numbers") or {}
        swept = sorted(r.lr for r in rates[(run.arm, run.rung, run.seed)])
        edge = "" if len(swept) < 3 else "low" if run.lr == swept[0] else "high" if run.lr == swept[-1] else ""
        failed = [f"{r.lr:g}" for r in rates[(run.arm, run.rung, run.seed)] if r.name not in summaries]
        rows.append(
            [
                decision,
                run.arm,
                run.rung.name,
                run.seed,
                f"{run.lr:g}",
                edge,
                " ".join(failed),
                state.get("per_token", ""),
                state.get("fixed", ""),
                *[recall.accuracy(b, s) for s in segs],
                bpb.get((run.arm, run.rung.name), ""),
                b.summary.get("run_dir", ""),
            ]
        )
    return header, rows, best


def run_recall(
    decision: str,
    preset: Preset,
    extra: list[str],
    output_root: Path,
    jobs: int,
    report: bool = True,
    ladder_table: Optional[Path] = None,
) -> Path:
    """Train the study's runs (those not finished yet) and write its table and figures; returns its folder.
    ``ladder_table``: the ladder whose loss goes beside the recall (default the decision's at ``preset``)."""
    from analysis import recall  # start-up time: matplotlib, only when the study runs
    from analysis.compare import markdown  # start-up time: matplotlib, only when the study runs

    loaded = load_decision(decision)
    arms = {arm: loaded[arm] for arm in ARMS}
    study = recall_preset(preset)
    runs = plan_recall(decision, study, extra, arms)
    folder = output_root / "ladders" / f"{decision}-{study.name}"
    runs_dir = runs_folder(output_root, study, extra, study=study.recall)
    runs_dir.mkdir(parents=True, exist_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    print(f"runs of preset {study.name}: {runs_dir}")
    with hold_runs_folder(runs_dir):  # released when training ends, not left to the garbage collector
        summaries, failed = train_unfinished(
            runs, lambda r: run_overrides(r, arms[r.arm], study, extra, runs_dir), runs_dir, jobs
        )
        if failed:  # a rate that diverges is a point that lost, as in Zoology's sweeps; recall_rows says so
            print(f"{len(failed)} runs failed (listed in lrs_failed): {', '.join(failed)}")
        labels = {arm: f"{arm}: {arm_slug(arms[arm])}" for arm in ARMS}
        ladder_table = ladder_table or output_root / "ladders" / f"{decision}-{preset.name}" / "ladder.csv"
        bpb = ladder_bpb(ladder_table)
        header, rows, best = recall_rows(decision, runs, summaries, labels, bpb)
        kept = keep_curves(folder, runs, summaries)
    tmp = folder / "recall.csv.tmp"
    with open(tmp, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    os.replace(tmp, folder / "recall.csv")  # a table interrupted while written never replaces a whole one
    shown = [i for i, h in enumerate(header) if h not in ("decision", "run_dir")]
    table = markdown([header[i] for i in shown], [[row[i] for i in shown] for row in rows])
    note = "" if bpb else f"\n(no ladder table at {ladder_table} yet: ladder_val_bpb is empty)\n"
    title = f"# {decision}: associative recall ({loaded.get('description', '')})"
    (folder / "recall.md").write_text(f"{title}\n\n{table}{note}")
    print(f"recall folder: {folder}\nrecall table: {folder / 'recall.csv'}\ncurves: {kept} runs")
    if report:
        recall.plot(best, folder, "state")
        if len({r.rung.d_model for r in runs}) > 1:
            recall.plot(best, folder, "width")
    return folder
