"""A run killed with SIGKILL while W&B lags behind, then resumed with ckpt_path=last: its W&B history, read
back with wandb's own reader from the offline segments ``wandb sync`` uploads as one run, holds every
logged step exactly once, in order, equal to metrics.jsonl."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest

from runtime.jsonl_logger import read_metrics
from runtime.metric_ledger import record_key
from runtime.wandb_offline import read_run, segments, wandb_cli
from tests.helpers import FAST, kill_after_microbatch, only_run_dir, run_train

LAG = "+callbacks.lag={_target_:tests.runtime.wandb_lag.LaggingWandbWriter,rows:5}"


@pytest.mark.slow
def test_killed_run_with_a_lagging_wandb_writer_resumes_without_holes_or_doubles(tmp_path):
    common = [
        *FAST,
        "trainer.max_steps=12",
        "trainer.checkpoint_every_n_steps=4",
        "trainer.val_check_interval=3",
        "logger=wandb",
        f"output_root={tmp_path}",
    ]
    env = {"WANDB_MODE": "offline"}
    killed = run_train(*common, LAG, kill_after_microbatch(9), env=env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    run_dir = only_run_dir(tmp_path)
    run_id = json.loads((run_dir / "run.json").read_text())["wandb_id"]
    before = read_run(segments(run_dir / "wandb", run_id))
    logged_before = read_metrics(str(run_dir / "metrics.jsonl"))
    # W&B fell behind: the killed process's last rows never reached it (steps up to 9 were logged)
    assert len(before.history) <= len(logged_before) - 5, (before.history, logged_before)
    assert max(r["step"] for r in logged_before) == 9

    resumed = run_train(*common, "ckpt_path=last", env=env)  # the checkpoint at step 8
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    parts = segments(run_dir / "wandb", run_id)
    assert len(parts) == 2
    dry = subprocess.run([wandb_cli(), "sync", "--dry-run", *map(str, parts)], capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr

    wandb_rows = read_run(parts).history
    logged = read_metrics(str(run_dir / "metrics.jsonl"))
    keys = [record_key(r["step"], r) for r in logged]
    assert len(keys) == len(set(keys))  # metrics.jsonl itself: each step's record once
    steps = [r["step"] for r in logged]
    assert steps == sorted(steps) and set(steps) >= set(range(12)) and max(steps) == 12
    assert wandb_rows == logged  # every row once, in order, the same values
    assert read_run(parts).rows == len(logged)  # and W&B's own row numbering continues across the segments
