"""A whole (tiny) scaling ladder through train.py: every phase runs, ladder.csv holds one row per compute
point, and a ladder killed mid-run resumes with the same command and ends with the same table."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sweeps import ladder

REPO = Path(__file__).resolve().parents[2]

TINY_PRESET = """
rungs: [[16, 4], [32, 4]]
tokens_per_param: 0.3
branch_multiples: [0.15]
seeds: [0, 1]
lr: {base: 3.0e-3, factors: [0.5, 1.0], sweep_rungs: 2}
warmup_fraction: 0.1
decay_fraction: 0.2
overrides: [data=corpus, data.seq_len=64, data.batch_size=4, data.val_tokens=2048, trainer.precision=32-true,
  trainer.compile=false, logger=csv, trainer.enable_progress_bar=false]
"""


def _command(preset: Path, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "sweeps.run", "ladder", "block_attnres", "--preset", str(preset),
        "--jobs", "2", "--output-root", str(out),
    ]  # fmt: skip


def _table(out: Path) -> list[dict[str, str]]:
    with open(out / "ladders" / "block_attnres-tiny" / "ladder.csv") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        row.pop("run_dir")
    return sorted(rows, key=lambda r: (r["arm"], r["rung"], r["seed"]))


@pytest.mark.slow
@pytest.mark.timeout(5400)  # two whole ladders of 24 train.py runs each
def test_a_killed_ladder_resumes_to_the_same_table(tmp_path):
    preset = tmp_path / "tiny.yaml"
    preset.write_text(TINY_PRESET)
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO)}

    whole = tmp_path / "whole"
    done = subprocess.run(_command(preset, whole), cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    table = _table(whole)
    # 2 arms x 2 rungs x 2 seeds, each a stable point and a branch point
    assert len(table) == 16
    assert {r["rung"] for r in table} == {"d16x4", "d32x4", "d16x4@tpp0.15", "d32x4@tpp0.15"}
    assert all(float(r["val_bpb"]) > 0 and float(r["train_flops"]) > 0 for r in table)
    lr_file = whole / "ladders" / "block_attnres-tiny" / "learning_rates.json"
    assert lr_file.exists()

    cut = tmp_path / "cut"
    # runs are named by what they train, in the preset's shared runs folder
    victim = ladder.runs_folder(cut, ladder.load_preset(str(preset)), []) / "k3_small-d32x4-s1" / "checkpoints"
    proc = subprocess.Popen(
        _command(preset, cut), cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 1500
    while not (victim.is_dir() and any(victim.glob("step=*.ckpt"))):
        assert proc.poll() is None, "the ladder ended before the run it was to be killed in"
        assert time.monotonic() < deadline
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every run it started
    proc.wait()
    assert not (cut / "ladders" / "block_attnres-tiny" / "ladder.csv").exists()

    again = subprocess.run(_command(preset, cut), cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "finished)" in again.stdout  # the runs done before the kill were not rerun
    assert _table(cut) == table
    for multiple in ("0.3", "0.15"):  # the report per token multiple, the same after the interruption
        for out in (whole, cut):
            assert (out / "ladders" / "block_attnres-tiny" / f"tpp{multiple}" / "table.md").exists()
        fits = [
            json.loads((o / "ladders" / "block_attnres-tiny" / f"tpp{multiple}" / "fits.json").read_text())
            for o in (whole, cut)
        ]
        for f in fits:
            f.pop("source")  # the table's path
        assert fits[0] == fits[1]
