"""A pool of ``train.py`` processes: the runs of a study or a ladder, up to ``jobs`` at once.

Each command is one ``train.py`` argv (a study point's multirun, or one ladder run); concurrent runs get
their share of the cores (``runtime.cpu_threads``) and the study point's name in their environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from runtime.cpu_threads import threads_per_job
from runtime.sweep_job import point_env

REPO = Path(__file__).resolve().parent.parent


def repo_env() -> dict[str, str]:
    """This environment with the repository first on PYTHONPATH, for the train.py processes of a study."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def run_points(cmds: list[tuple[str, list[str]]], output_root: Path, env: dict[str, str], jobs: int = 1) -> list[str]:
    """Run every point's ``train.py`` command, up to ``jobs`` at once; returns the points that failed. A
    configuration error (exit 2) stops launching further points: they would fail alike."""
    pending, running, failed = list(cmds), [], []
    config_error = False
    env = {**env, **threads_per_job(jobs, env)}
    while pending or running:
        while pending and len(running) < max(1, jobs) and not config_error:
            point, cmd = pending.pop(0)
            argv = [sys.executable, str(REPO / "train.py"), *cmd, f"output_root={output_root}"]
            running.append((point, subprocess.Popen(argv, cwd=REPO, env={**env, **point_env(point)})))
        if not running:
            if pending:
                print(
                    f"error: not started after a configuration error: {', '.join(p for p, _ in pending)}",
                    file=sys.stderr,
                )
                failed += [p for p, _ in pending]
            break
        done = next((item for item in running if item[1].poll() is not None), None)
        if done is None:
            time.sleep(0.2)
            continue
        running.remove(done)
        if done[1].returncode != 0:
            failed.append(done[0])
            config_error = config_error or done[1].returncode == 2
    return failed
