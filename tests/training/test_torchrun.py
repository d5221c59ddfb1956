"""``torchrun`` starting two ranks of one run: both train in the one folder rank 0 picked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import FAST, REPO


def test_torchrun_two_cpu_ranks_write_one_run(tmp_path):
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    overrides = [
        *FAST,
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.precision=32-true",
        "trainer.max_steps=4",
        "logger=csv",
        f"output_root={tmp_path}",
    ]
    env = {k: v for k, v in os.environ.items() if k != "K3_RUN_DIR"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node=2", str(REPO / "train.py"), *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dirs = [p for p in tmp_path.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(run_dirs) == 1, run_dirs
    summary = json.loads((run_dirs[0] / "summary.json").read_text())
    assert summary["steps"] == 4
    assert not any((tmp_path / ".launches").iterdir())  # rank 0 removed its record at exit
