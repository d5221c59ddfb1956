"""The state of a preset's runs folder, shared by the ladder, the local comparison and the rate-sensitivity
study: which runs finished, the lock that keeps two of them from training into one folder at once, and
the copies of their training curves a study keeps in its own folder."""

from __future__ import annotations

import csv
import fcntl
import glob
import json
from pathlib import Path
from typing import Any, Callable, Optional

from runtime.json_records import read_json_lines
from sweeps.ladder_plan import LadderError, LadderRun
from sweeps.run_pool import repo_env, run_points


def finished_summary(runs_dir: Path, name: str) -> Optional[dict[str, Any]]:
    """The summary of ``name``'s finished run (all its planned steps), if there is one."""
    for folder in [runs_dir / name, *sorted(runs_dir.glob(f"{glob.escape(name)}-[0-9]*"))]:
        path = folder / "summary.json"
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if summary.get("steps") and summary.get("steps") == summary.get("planned_steps"):
            return summary
    return None


def train_unfinished(
    runs: list[LadderRun], command: Callable[[LadderRun], list[str]], runs_dir: Path, jobs: int
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Train every run of ``runs`` not finished in ``runs_dir`` (``command(run)``: its train.py overrides),
    up to ``jobs`` at once. Returns the summaries of all finished runs and the names of the runs that
    failed; what a failure means (an error, or a rate that diverged) is the caller's to say."""
    todo = [r for r in runs if finished_summary(runs_dir, r.name) is None]
    failed: list[str] = []
    if todo:
        print(f"{len(todo)} to run ({len(runs) - len(todo)} finished): {', '.join(r.name for r in todo)}")
        failed = run_points([(r.name, command(r)) for r in todo], runs_dir, repo_env(), jobs)
    summaries = {r.name: s for r in runs if (s := finished_summary(runs_dir, r.name)) is not None}
    return summaries, failed


def hold_runs_folder(runs_dir: Path):
    """An exclusive lock on a preset's runs folder while a study trains in it (use it as a context): two
    ladders sharing an arm would otherwise train the same run into the same folder at once."""
    handle = open(runs_dir / ".lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise LadderError(
            f"another ladder is training in {runs_dir} (its runs are shared by every decision at this preset); "
            "run ladders of one preset one after another, or give this one its own --output-root"
        ) from None
    return handle


def keep_curves(folder: Path, runs: list[LadderRun], summaries: dict[str, dict[str, Any]]) -> int:
    """Copy every finished run's training curve (``metrics.jsonl``: step, tokens, train/loss, train/lr)
    into ``folder/curves/<run>.csv``, so the ladder folder keeps them beside its table; returns how many."""
    out = folder / "curves"
    out.mkdir(exist_ok=True)
    kept = 0
    for run in runs:
        path = Path((summaries.get(run.name) or {}).get("run_dir", "")) / "metrics.jsonl"
        if not path.is_file():
            continue
        records = [r for r in read_json_lines(path) if isinstance(r, dict) and "train/loss" in r]
        with open(out / f"{run.name}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["step", "tokens", "train_loss", "lr"])
            for r in records:
                step = int(r.get("step", 0))
                writer.writerow([step, step * run.size.tokens_per_step, r["train/loss"], r.get("train/lr", "")])
        kept += 1
    return kept
