"""A job's place in a Hydra multirun: its W&B group and tags, and the sweep folder's run index.

Every job of ``python train.py -m ...`` is its own run (``sweeps.run`` launches one multirun per study
point into one sweep folder). Jobs of one sweep share a W&B group (the sweep folder's name, unless
``logger.group`` is set) and carry the options the sweep varies as ``key=value`` tags, so W&B's group-by
and parallel-coordinates views work as launched; the varied values are config fields already.
``<sweep dir>/index.jsonl`` gets one line per finished or failed job: job number, run folder, the job's
overrides and varied values, status and final metrics (``analysis`` reads it).

Two facts reach a job through its environment, since a job may run in another process (a SLURM node):
which keys the sweep varies (``K3_SWEEP_VARIED``, a JSON list, set by ``train.py -m`` before Hydra starts
the jobs) and which study point the multirun is (``K3_SWEEP_POINT``, set by ``sweeps.run``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from runtime.json_records import read_json_lines

INDEX_FILE = "index.jsonl"
VARIED_ENV = "K3_SWEEP_VARIED"
POINT_ENV = "K3_SWEEP_POINT"


def publish_varied_keys(keys: list[str]) -> None:
    """Tell this process's jobs (and the processes they start) which keys the sweep varies."""
    os.environ[VARIED_ENV] = json.dumps(keys)


def point_env(point: str) -> dict[str, str]:
    """Environment entries that tell a multirun which study point it runs."""
    return {POINT_ENV: point}


def split_override(override: str) -> tuple[str, str]:
    """``+a.b=v`` / ``~a.b=v`` / ``a.b=v`` -> (``a.b``, ``v``)."""
    key, _, value = override.partition("=")
    return key.lstrip("+~"), value


@dataclass
class SweepJob:
    sweep_dir: str
    job_num: int
    overrides: list[str]
    varied: dict[str, str] = field(default_factory=dict)

    @property
    def group(self) -> str:
        return "sweep-" + os.path.basename(os.path.normpath(self.sweep_dir))

    def tags(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.varied.items()]

    def record(self, run_dir: str, status: str, summary: Optional[dict[str, Any]]) -> None:
        """Append this job's line to the sweep's index (one short write: safe for parallel launchers)."""
        line = {
            "job": self.job_num,
            "run_dir": os.path.abspath(run_dir),
            "status": status,
            "overrides": self.overrides,
            "varied": self.varied,
        }
        if summary is not None:
            line.update(
                {
                    k: summary.get(k)
                    for k in ("name", "steps", "train_tokens", "tokens_per_s", "params", "active_params", "val")
                }
            )
        os.makedirs(self.sweep_dir, exist_ok=True)
        with open(os.path.join(self.sweep_dir, INDEX_FILE), "a") as f:
            f.write(json.dumps(line) + "\n")


def current_job() -> Optional[SweepJob]:
    """The running Hydra job's sweep info; None outside a multirun."""
    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return None
    overrides = list(hc.overrides.task)
    values = dict(split_override(o) for o in overrides)
    point = os.environ.get(POINT_ENV)
    varied = {"point": point} if point else {}
    varied.update({k: values[k] for k in json.loads(os.environ.get(VARIED_ENV, "[]")) if k in values})
    return SweepJob(hc.sweep.dir, int(hc.job.num), overrides, varied)


def read_index(sweep_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(sweep_dir, INDEX_FILE)
    if not os.path.exists(path):
        return []
    return read_json_lines(path)  # a torn last line (a job killed while writing) is skipped
