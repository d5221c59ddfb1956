"""An offline W&B run folder (``wandb/offline-run-*``) read back with wandb's own reader.

``wandb leet inspect --json`` prints the records of a run's ``.wandb`` transaction log one JSON object a
line; this module turns them into the run as W&B would show it after ``wandb sync``: name, group, job
type, tags, config, summary and history rows (``step`` = ``trainer/global_step``). A run resumed in
offline mode leaves one folder per segment (same run id); ``segments`` orders them as ``wandb sync``
uploads them, and ``read_run`` of several folders is the run they make together.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

STEP_KEY = "trainer/global_step"
_FOLDER = re.compile(r"^offline-run-(\d{8}_\d{6})-([A-Za-z0-9]+)$")


def wandb_cli() -> str:
    """The ``wandb`` command of this interpreter's environment."""
    beside = Path(sys.executable).with_name("wandb")
    return str(beside) if beside.exists() else "wandb"


def is_offline_run(path: Path) -> bool:
    return path.is_dir() and bool(_FOLDER.match(path.name)) and any(path.glob("*.wandb"))


def run_id_of(folder: Path) -> str:
    found = _FOLDER.match(folder.name)
    if not found:
        raise ValueError(f"{folder}: not an offline W&B run folder (offline-run-<time>-<id>)")
    return found.group(2)


def segments(wandb_dir: Path, run_id: Optional[str] = None) -> list[Path]:
    """The offline run folders in ``wandb_dir`` (of one run id, if given), oldest first."""
    found = [p for p in Path(wandb_dir).glob("offline-run-*") if is_offline_run(p)]
    if run_id is not None:
        found = [p for p in found if run_id_of(p) == run_id]
    return sorted(found, key=lambda p: _FOLDER.match(p.name).group(1))


def wait_for_a_new_segment_name(wandb_dir: Path, run_id: str) -> None:
    """Sleep into the next second when a segment of ``run_id`` was started in this one: an offline folder is
    named by the second its segment starts, so a second segment started within the same second (an
    evaluation right after a short run, a resume right after a failed start) would be written into the
    first one's folder. Every new offline segment of an existing run calls this first (runtime/loggers.py,
    analysis/evaluate.py)."""
    while True:
        now = time.strftime("%Y%m%d_%H%M%S", time.localtime())
        if not (Path(wandb_dir) / f"offline-run-{now}-{run_id}").exists():
            return
        time.sleep(1.0 - (time.time() % 1.0) + 0.01)


def read_records(folder: Path, timeout: float = 120) -> list[dict[str, Any]]:
    """The records of one offline run folder's ``.wandb`` log (a record torn by a killed writer is left out)."""
    result = subprocess.run(
        [wandb_cli(), "leet", "inspect", "--json", str(folder)], capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0 and not result.stdout:
        raise RuntimeError(f"{folder}: wandb leet inspect failed: {result.stderr.strip()[-500:]}")
    records = []
    for line in result.stdout.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def history_record(item: dict[str, Any]) -> Optional[dict[str, Any]]:
    """A W&B history row -> a ``metrics.jsonl`` record (``step`` first, W&B's own ``_`` keys left out)."""
    step = item.get(STEP_KEY)
    if step is None:
        return None
    metrics = {k: v for k, v in item.items() if not k.startswith("_") and k != STEP_KEY and isinstance(v, (int, float))}
    return {"step": int(step), **metrics} if metrics else None


def _merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


@dataclass
class OfflineRun:
    run_id: str
    folders: list[Path]
    name: str = ""
    group: str = ""
    job_type: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl-style records, in order
    rows: int = 0  # history rows W&B holds (its next ``_step``)
    exit_code: Optional[int] = None

    @property
    def finished(self) -> bool:
        return self.exit_code == 0


def read_run(folders: Iterable[Path]) -> OfflineRun:
    """The run one or more offline folders of the same run id make (segments in the order given)."""
    folders = [Path(f) for f in folders]
    run = OfflineRun(run_id_of(folders[0]), folders)
    for folder in folders:
        for record in read_records(folder):
            kind = record.get("type")
            body = record.get(kind) or {}
            if kind == "run":
                run.name = body.get("display_name", run.name)
                run.group = body.get("run_group", run.group)
                run.job_type = body.get("job_type", run.job_type)
                run.tags = list(body.get("tags", run.tags))
                _merge(run.config, (body.get("config") or {}).get("update", {}))
            elif kind == "config":
                _merge(run.config, body.get("update", {}))
            elif kind == "summary":
                run.summary.update(body.get("update", {}))
                for key in body.get("remove", []) or []:
                    run.summary.pop(key, None)
            elif kind == "history":
                run.rows += 1
                row = history_record(body.get("item", {}))
                if row is not None:
                    run.history.append(row)
            elif kind == "exit":
                run.exit_code = int(body.get("exit_code", 0) or 0)
    run.config.pop("_wandb", None)
    return run


def read_folder(path: Path) -> OfflineRun:
    """An ``offline-run-*`` folder, with the other segments of its run beside it (a resumed run), as one run."""
    path = Path(path)
    parts = segments(path.parent, run_id_of(path)) or [path]
    return read_run(parts)


def runs_in(wandb_dir: Path) -> list[OfflineRun]:
    """Every run recorded in a ``wandb`` folder (segments of one id together), oldest first."""
    by_id: dict[str, list[Path]] = {}
    for folder in segments(wandb_dir):
        by_id.setdefault(run_id_of(folder), []).append(folder)
    return [read_run(parts) for parts in by_id.values()]


def default_wandb_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "wandb")
