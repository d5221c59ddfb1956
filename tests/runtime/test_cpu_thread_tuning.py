"""The thread tuner's decisions and schedule on synthetic step times: nothing here is timed."""

from __future__ import annotations

import pytest

from runtime.cpu_thread_tuning import ThreadTuner, TuningPlan, candidate_threads, choose_threads, probe_order
from runtime.cpu_wait_policy import describe_wait_policy


def test_candidates_are_every_small_count_then_powers_of_two_and_the_cores():
    assert candidate_threads(1) == [1]
    assert candidate_threads(2) == [2, 1]
    assert candidate_threads(4) == [4, 3, 2, 1]
    assert candidate_threads(12) == [12, 8, 4, 3, 2, 1]
    assert candidate_threads(64) == [64, 32, 16, 8, 4, 3, 2, 1]


def test_choose_takes_the_lowest_median_and_keeps_the_current_count_within_the_margin():
    # medians: 2 threads 0.10 s, 1 thread 0.08 s; one outlier step does not decide
    timings = {2: [0.10, 0.10, 0.50], 1: [0.08, 0.30, 0.08]}
    assert choose_threads(timings, current=2, margin=0.05) == 1
    assert choose_threads(timings, current=1, margin=0.05) == 1
    close = {2: [0.100, 0.100, 0.100], 1: [0.097, 0.097, 0.097]}  # 3% faster: not worth a switch
    assert choose_threads(close, current=2, margin=0.05) == 2
    assert choose_threads(close, current=2, margin=0.0) == 1
    tie = {4: [0.1], 2: [0.1], 1: [0.2]}
    assert choose_threads(tie, current=1, margin=0.0) == 2  # a tie goes to fewer threads
    assert choose_threads({2: [0.1], 1: []}, current=1, margin=0.05) == 2  # an untimed count is no candidate
    with pytest.raises(ValueError):
        choose_threads({2: []}, current=2, margin=0.05)


def drive(tuner: ThreadTuner, seconds_for, steps: int) -> list[int]:
    """The thread count of each step when a step on n threads takes ``seconds_for(step, n)``."""
    used = []
    for step in range(steps):
        used.append(tuner.threads)
        tuner.record(seconds_for(step, tuner.threads))
    return used


PLAN = TuningPlan(warm_steps=2, settle_steps=1, probe_steps=3, hold_steps=20, drift=1.5, drift_window=8, margin=0.05)


def test_schedule_warm_probe_the_counts_interleaved_then_hold_the_fastest():
    applied = []
    tuner = ThreadTuner(2, PLAN, applied.append)
    used = drive(tuner, lambda step, n: {2: 0.2, 1: 0.1}[n], 40)
    # 2 warm steps on 2 threads; 3 rounds over both counts, each round the last reversed; keep 1
    assert used[:2] == [2, 2]
    assert used[2:8] == [2, 1, 1, 2, 2, 1]
    assert set(used[8:28]) == {1}  # held for hold_steps
    assert tuner.decisions[0].threads == 1 and tuner.decisions[0].step == 8
    assert tuner.decisions[0].seconds == {2: 0.2, 1: 0.1}
    assert tuner.decisions[0].reason == "start"
    # the periodic probe starts on the kept count (no switch)
    assert used[28:34] == [1, 2, 2, 1, 1, 2]
    assert applied[:4] == [1, 2, 1, 2]  # set only on a change
    assert tuner.steps_by_threads[1] + tuner.steps_by_threads[2] == 40


def test_probe_order_interleaves_every_count_alike():
    assert probe_order([2, 1], current=2, rounds=4) == [2, 1, 1, 2, 2, 1, 1, 2]
    order = probe_order([2, 1], current=1, rounds=4)
    after_switch = [b for a, b in zip(order, order[1:]) if a != b]
    assert after_switch.count(1) == after_switch.count(2) == 2  # two counts: as many steps after a switch
    assert probe_order([4, 3, 2, 1], current=2, rounds=2) == [2, 4, 3, 1, 1, 3, 4, 2]
    order = probe_order([8, 4, 3, 2, 1], current=1, rounds=4)
    assert all(order.count(n) == 4 for n in (8, 4, 3, 2, 1)) and order[0] == 1


def test_a_load_arriving_mid_probe_does_not_decide_it():
    """Other processes start in the middle of a probe: every step from then on is 3x slower. Probing each
    count in a block would time 1 thread only under the load and keep 2; interleaved, both counts see it."""
    plan = TuningPlan(warm_steps=2, probe_steps=4, hold_steps=100)
    tuner = ThreadTuner(2, plan, lambda n: None)
    drive(tuner, lambda step, n: {2: 0.2, 1: 0.1}[n] * (3 if step >= 6 else 1), 12)
    assert tuner.decisions[0].threads == 1, tuner.decisions[0].seconds


def test_a_load_change_starts_a_probe_before_the_hold_ends():
    tuner = ThreadTuner(2, PLAN, lambda n: None)
    # quiet: 2 threads fastest; from step 15 a competitor arrives and 2 threads become slow
    used = drive(tuner, lambda step, n: ({2: 0.1, 1: 0.18} if step < 15 else {2: 0.5, 1: 0.25})[n], 40)
    assert tuner.decisions[0].threads == 2
    assert tuner.decisions[1].reason == "drift" and tuner.decisions[1].threads == 1
    assert tuner.decisions[1].step < 2 + 6 + PLAN.hold_steps  # well before the periodic probe
    assert used[-1] == 1


def test_one_core_never_switches_and_the_summary_says_what_ran():
    tuner = ThreadTuner(1, PLAN, lambda n: pytest.fail("no switch on one core"))
    drive(tuner, lambda step, n: 0.1, 10)
    assert not tuner.active
    assert tuner.summary() == {
        "threads": 1,
        "candidates": [1],
        "probes": 0,
        "steps_by_threads": {"1": 10},
        "decisions": [],
    }


def test_summary_keeps_the_newest_decisions():
    plan = TuningPlan(warm_steps=0, settle_steps=0, probe_steps=1, hold_steps=1)
    tuner = ThreadTuner(2, plan, lambda n: None)
    drive(tuner, lambda step, n: 0.1 * n, 200)
    assert tuner.decided > ThreadTuner.KEPT_DECISIONS
    assert len(tuner.summary()["decisions"]) == ThreadTuner.KEPT_DECISIONS
    assert tuner.summary()["decisions"][-1]["threads"] == 1


def test_wait_policy_is_read_from_the_environment():
    assert describe_wait_policy({}) == "spin, then sleep (libgomp default)"
    assert describe_wait_policy({"OMP_WAIT_POLICY": "PASSIVE"}) == "OMP_WAIT_POLICY=passive"
    assert describe_wait_policy({"GOMP_SPINCOUNT": "10000"}) == "GOMP_SPINCOUNT=10000"


def test_an_unknown_mode_is_refused_naming_the_key():
    from components.registry import ConfigError
    from tests.helpers import compose_root

    assert compose_root().trainer.cpu_threads == "auto"  # it beats fixed beside busy processes and alone
    assert compose_root("trainer.cpu_threads=auto").trainer.cpu_threads == "auto"
    with pytest.raises(ConfigError, match=r"trainer\.cpu_threads: 'many' is not allowed; choose one of auto, fixed"):
        compose_root("trainer.cpu_threads=many")


def test_loop_tuner_switches_on_cpu_puts_the_count_back_and_stays_off_on_gpu():
    import torch

    from runtime.cpu_thread_tuning import cpu_thread_tuner

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        tuner = cpu_thread_tuner("cpu", plan=TuningPlan(warm_steps=0, settle_steps=0, probe_steps=1, hold_steps=1))
        used = []
        for _ in range(4):
            used.append(torch.get_num_threads())
            with tuner.timed_step(work=10):
                pass
        assert set(used) == {1, 2}  # it probed both counts on the process's threads
        tuner.restore()
        assert torch.get_num_threads() == 2
        off = cpu_thread_tuner("cuda")
        with off.timed_step():
            pass
        assert off.tuner is None and torch.get_num_threads() == 2
        assert cpu_thread_tuner("cpu", invariant=False).tuner is None
    finally:
        torch.set_num_threads(threads)
