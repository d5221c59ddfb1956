"""Branching a WSD cooldown from another run's stable phase (init_from / init_step): the branch equals a
run trained at its length from the start, and resumes exactly after a kill."""

from __future__ import annotations

import json
import signal

import pytest

from components.registry import ConfigError
from runtime.jsonl_logger import read_metrics
from tests.helpers import compose_root, kill_after_microbatch, losses_by_step, only_run_dir, run_train

# WSD with half of each run decaying: a 24-step run is stable through step 12, a 12-step run decays
# from step 6, so the 24-step run's checkpoint at step 6 is where a 12-step cooldown branches
COMMON = [
    "model=tiny",
    "data=corpus",
    "data.seq_len=32",
    "data.batch_size=4",
    "data.val_tokens=256",
    "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1",
    "trainer.compile=false",
    "trainer.max_time_minutes=null",
    "trainer.val_check_interval=100",
    "schedule=wsd",
    "schedule.decay_fraction=0.5",
    "optimizer.warmup_steps=2",
    "trainer.checkpoint_every_n_steps=3",
    "logger=csv",
]
# runs compared bit for bit train on one thread (CPU kernels split their sums by thread), the killed
# run in its own process as well
THREADS = 1
ENV = {"OMP_NUM_THREADS": str(THREADS)}


@pytest.fixture(scope="module")
def stable_and_straight(trained_run, tmp_path_factory):
    stable = trained_run(*COMMON, "trainer.max_steps=24", threads=THREADS)
    straight = trained_run(*COMMON, "trainer.max_steps=12", threads=THREADS)
    return tmp_path_factory.mktemp("branch"), stable.run_dir, straight.run_dir


def test_a_cooldown_branched_from_the_stable_phase_equals_the_run_of_that_length(stable_and_straight, train_run):
    root, stable, straight = stable_and_straight
    branch = train_run(
        *COMMON,
        "trainer.max_steps=12",
        f"init_from={stable}",
        "init_step=6",
        f"output_root={root / 'branch'}",
        threads=THREADS,
    )
    assert f"branching from {stable / 'checkpoints' / 'step=6.ckpt'}" in branch.stdout
    branch_dir = only_run_dir(root / "branch")
    assert branch_dir != stable  # its own folder
    reference, losses = losses_by_step(straight), losses_by_step(branch_dir)
    assert sorted(losses) == list(range(6, 12))  # steps 7..12, trained in the branch
    assert all(losses[s] == reference[s] for s in losses), (losses, reference)
    final = json.loads((branch_dir / "summary.json").read_text())["val"]["loss"]
    assert final == json.loads((straight / "summary.json").read_text())["val"]["loss"]
    # the stable run itself had not started decaying there: its learning rate at step 7 is the peak
    lrs = {r["step"]: r["train/lr"] for r in read_metrics(str(stable / "metrics.jsonl")) if "train/lr" in r}
    assert lrs[7] == lrs[11] == max(lrs.values())


@pytest.mark.slow
def test_a_killed_branch_resumes_exactly(stable_and_straight, tmp_path, train_run):
    root, stable, straight = stable_and_straight
    args = [*COMMON, "trainer.max_steps=12", f"init_from={stable}", "init_step=6", f"output_root={tmp_path}"]
    killed = run_train(*args, kill_after_microbatch(10), env=ENV)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = train_run(*args, "ckpt_path=last", threads=THREADS)
    run_dir = only_run_dir(tmp_path)
    assert f"resuming from {run_dir / 'checkpoints'}" in resumed.stdout  # its own checkpoint, not the stable run's
    reference, losses = losses_by_step(straight), losses_by_step(run_dir)
    assert all(losses[s] == reference[s] for s in range(9, 12))


def test_branch_options_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="init_step: needs init_from"):
        compose_root("init_step=3")
    with pytest.raises(
        ConfigError, match="init_from: .* neither a checkpoint, a run folder .* nor a folder of exported weights"
    ):
        compose_root(f"init_from={tmp_path}")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step=3.ckpt").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"init_step: .* has no checkpoint at step 5; it has steps \[3\]"):
        compose_root(f"init_from={tmp_path}", "init_step=5")
    with pytest.raises(ConfigError, match="init_step: init_from=.* is a run folder: name the step"):
        compose_root(f"init_from={tmp_path}")
