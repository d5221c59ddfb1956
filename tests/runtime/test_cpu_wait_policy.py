"""The OpenMP wait policy chosen at start-up: passive on a busy machine, a brief spin on an idle one, the
user's setting kept, inherited by child processes, and never chosen once torch is loaded."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import runtime.cpu_wait_policy as cpu_wait_policy
from runtime.cpu_wait_policy import (
    BRIEF_SPINS,
    BUSY_CORES,
    CHOICE,
    choose_at_startup,
    cpu_times,
    other_busy_cores,
    usable_cpus,
)
from runtime.jsonl_logger import read_metrics
from tests.helpers import REPO, run_train

NOT_LOADED: set[str] = set()  # the modules of a process that has not imported torch yet


def test_a_busy_machine_with_a_core_left_gets_passive_waiting_and_says_why(monkeypatch):
    monkeypatch.setattr(cpu_wait_policy, "usable_cpus", lambda: {0, 1})
    env: dict[str, str] = {}
    reason = choose_at_startup(env, measure=lambda: 1.0, imported=NOT_LOADED)
    assert env["OMP_WAIT_POLICY"] == "passive" and "GOMP_SPINCOUNT" not in env and env[CHOICE] == reason
    assert reason == "OMP_WAIT_POLICY=passive (1.0 of 2 cores busy with other processes at start-up)"


def test_a_machine_whose_every_core_is_taken_gets_a_brief_spin(monkeypatch):
    monkeypatch.setattr(cpu_wait_policy, "usable_cpus", lambda: {0, 1})
    env: dict[str, str] = {}
    reason = choose_at_startup(env, measure=lambda: 1.9, imported=NOT_LOADED)
    assert env["GOMP_SPINCOUNT"] == "1000" and "OMP_WAIT_POLICY" not in env
    assert reason.endswith("(1.9 of 2 cores busy with other processes at start-up: every core taken)")


def test_an_idle_or_unknown_machine_gets_a_brief_spin():
    env: dict[str, str] = {}
    reason = choose_at_startup(env, measure=lambda: BUSY_CORES / 5, imported=NOT_LOADED)
    assert "OMP_WAIT_POLICY" not in env and env["GOMP_SPINCOUNT"] == str(BRIEF_SPINS) == "1000"
    assert reason.startswith("GOMP_SPINCOUNT=1000: spin briefly, then sleep (0.1 of") and env[CHOICE] == reason
    unknown: dict[str, str] = {}
    assert "load is unknown" in choose_at_startup(unknown, measure=lambda: None, imported=NOT_LOADED)
    assert unknown["GOMP_SPINCOUNT"] == "1000"


def test_what_the_user_set_or_a_parent_chose_is_kept_without_measuring():
    def fail() -> float:
        raise AssertionError("measured although nothing was to be chosen")

    env = {"GOMP_SPINCOUNT": "1000"}
    assert choose_at_startup(env, measure=fail, imported=NOT_LOADED) == "GOMP_SPINCOUNT=1000 (set by the environment)"
    assert "OMP_WAIT_POLICY" not in env
    inherited = {CHOICE: "chosen by the parent"}
    assert choose_at_startup(inherited, measure=fail, imported=NOT_LOADED) == "chosen by the parent"
    assert choose_at_startup({"OMP_NUM_THREADS": "1"}, measure=fail, imported=NOT_LOADED).startswith("one thread")


def test_too_late_once_torch_is_loaded():
    env: dict[str, str] = {}
    assert choose_at_startup(env, measure=lambda: 2.0, imported={"torch"}) is None and env == {}


def test_the_measurement_sees_a_busy_process_and_not_itself():
    idle = other_busy_cores(0.3)
    assert idle is not None and idle >= 0.0
    if idle > len(usable_cpus()) - 0.8:  # other work already fills the cores: one more loop cannot show
        pytest.skip(f"{idle:.1f} of {len(usable_cpus())} cores busy before the test: no free core to see a spinner on")
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy = other_busy_cores(0.5)
    finally:
        spinner.kill()
        spinner.wait()
    # one busy loop is one core's worth (less whatever the sampler's own neighbours took)
    assert busy is not None and busy >= idle + 0.6, (idle, busy)


def test_train_py_chooses_before_torch_loads_and_its_children_inherit(tmp_path):
    """``train.py``'s first lines choose; the environment then holds the choice for the ranks it starts."""
    env = {k: v for k, v in os.environ.items() if k not in (CHOICE, "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["OMP_NUM_THREADS"] = "2"
    probe = (
        "import runpy, sys, os; sys.argv = ['train.py', '--help'];\n"
        "try:\n    runpy.run_path('train.py', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "print('CHOICE=' + os.environ.get('K3_CPU_WAIT_POLICY', ''))"
    )
    done = subprocess.run([sys.executable, "-c", probe], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    line = [x for x in done.stdout.splitlines() if x.startswith("CHOICE=")]
    assert line and ("passive" in line[0] or "spin briefly" in line[0]), done.stdout[-2000:] + done.stderr[-2000:]


@pytest.mark.slow
def test_the_wait_policy_never_changes_a_result(tmp_path):
    """Two threads waiting passively or spinning train the same losses to the bit (two runs of their own: the
    policy is fixed when a process loads torch)."""
    losses = {}
    for policy in ("passive", "active"):
        run = run_train(
            "model=tiny",
            "trainer.max_steps=6",
            "trainer.max_time_minutes=null",
            "trainer.log_every_n_steps=1",
            "trainer.val_check_interval=1000",
            "trainer.enable_progress_bar=false",
            "logger=csv",
            f"output_root={tmp_path / policy}",
            "name=run",
            env={"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": policy},
        )
        assert run.returncode == 0, run.stderr[-3000:]
        records = read_metrics(str(tmp_path / policy / "run" / "metrics.jsonl"))
        losses[policy] = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses["passive"]) == 6 and losses["passive"] == losses["active"]


def test_only_the_analysis_tools_that_run_a_model_sample_the_load():
    from analysis import runs_a_model

    assert runs_a_model(["python", "-m", "analysis.evaluate", "runs/x"])
    assert runs_a_model(["python3.11", "-X", "utf8", "-m", "analysis.generate", "runs/x", "--prompt", "def"])
    assert not runs_a_model(["python", "-m", "analysis.compare", "runs/"])  # reports: no sample, no 0.25 s
    assert not runs_a_model(["python", "-m", "pytest", "-m", "analysis.evaluate"])  # -m of pytest's, not Python's
    assert not runs_a_model(["python", "-m"])


def test_only_the_cores_this_process_may_use_are_counted():
    """/proc/stat's per-CPU lines (user nice system idle iowait ...): a process pinned to CPUs 0 and 1
    counts their busy time only, not CPU 2's, nor the all-CPU summary line."""
    stat = "cpu  600 0 0 300 0\ncpu0 100 0 0 100 0\ncpu1 150 0 50 0 0\ncpu2 300 0 0 200 0\nintr 12345\n"
    assert cpu_times(stat, {0, 1}) == (300.0, 400.0)
    assert cpu_times(stat, {2}) == (300.0, 500.0)
    assert cpu_times(stat, {7}) is None and cpu_times("", {0}) is None
    assert cpu_wait_policy.usable_cpus() == set(os.sched_getaffinity(0))
