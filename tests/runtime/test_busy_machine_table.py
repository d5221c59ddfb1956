"""benchmarks/busy_machine.py's arithmetic and table on made-up rates: nothing is timed."""

from __future__ import annotations

import pytest

from benchmarks.busy_machine import BEFORE, TUNED, Load, fair_share, format_table, loads, share_rows, verdicts


def test_fair_share_is_the_runs_threads_slice_of_the_cores():
    assert fair_share(2, 0) == 1.0
    assert fair_share(2, 1) == pytest.approx(2 / 3)  # one Python loop beside a 2-thread run
    assert fair_share(2, 2) == pytest.approx(1 / 2)  # two Python loops, or one 2-thread PyTorch loop
    assert fair_share(2, 4) == pytest.approx(1 / 3)  # two PyTorch loops
    assert Load("python", 2).competitor_threads(2) == 2
    assert Load("matmul", 2).competitor_threads(8) == 16
    assert [x.label for x in loads(2)] == ["alone", "1 x python", "1 x matmul", "2 x python", "2 x matmul"]


def test_rows_divide_by_the_fixed_run_alone_times_the_fair_share_and_the_verdicts_follow():
    alone, python1, matmul1 = Load("idle", 0), Load("python", 1), Load("matmul", 1)
    rates = {
        (alone, BEFORE): 10_000.0,
        (alone, TUNED): 9_600.0,  # 0.96 of the fixed run: kept
        (python1, BEFORE): 3_300.0,
        (python1, TUNED): 6_000.0,  # fair 2/3 -> 6,667 tokens/s; 0.90 of it
        (matmul1, BEFORE): 3_000.0,
        (matmul1, TUNED): 3_500.0,  # fair 1/2 -> 5,000 tokens/s; 0.70 of it: short
    }
    rows = {(r.load.label, r.setup): r for r in share_rows(rates, cores=2)}
    assert rows[("1 x python", TUNED)].fair == pytest.approx(2 / 3)
    assert rows[("1 x python", TUNED)].of_fair == pytest.approx(0.9)
    assert rows[("1 x python", BEFORE)].of_fair == pytest.approx(3_300 / (10_000 * 2 / 3))
    assert rows[("1 x matmul", TUNED)].vs_before == pytest.approx(3_500 / 3_000)
    assert rows[("alone", TUNED)].vs_before == pytest.approx(0.96)
    said = verdicts(list(rows.values()))
    assert said == [
        "ok: alone, auto keeps 0.96 of the fixed run's speed (>= 0.95)",
        "ok: beside 1 x python, auto holds 0.90 of its fair share (>= 0.8)",
        "FAIL: beside 1 x matmul, auto holds 0.70 of its fair share (>= 0.8)",
    ]
    table = format_table(list(rows.values())).splitlines()
    assert table[0] == "| machine | threads | tokens/s | fair share | of fair share | vs fixed |"
    assert "| 1 x python | auto | 6,000 | 0.67 | 0.90 | 1.82x |" in table
    assert len(table) == 2 + len(rates)


def test_each_line_says_what_a_tuned_run_chose_and_nothing_for_a_fixed_one():
    from benchmarks.busy_machine import chosen
    from runtime.rate_probe import Rate

    tuned = Rate(10_000.0, 5.0, {"mode": "auto", "steps_by_threads": {"1": 4, "2": 31}})
    assert chosen(tuned) == "  (steps by thread count 1: 4, 2: 31)"
    assert chosen(Rate(10_000.0, 5.0, {"mode": "fixed", "threads": 2})) == ""
    assert chosen(Rate(10_000.0, 5.0)) == ""  # a run that wrote no record


def test_the_warm_steps_cover_the_tuners_first_probe_on_any_core_count():
    from benchmarks.busy_machine import warm_steps

    assert warm_steps(2) == 2 + 4 * 2 + 1  # 2 candidates: 2 warm, 8 probe steps, the kept count's first step
    assert warm_steps(4) == 2 + 4 * 4 + 1
    assert warm_steps(1) == 2 + 4 + 1


def test_throughput_is_tokens_over_time_not_the_typical_step():
    from runtime.rate_probe import steady_rate

    # three steps of 1,000 tokens: 0.1 s, 0.1 s and one slow 0.8 s step
    rates = [10_000.0, 10_000.0, 1_250.0]
    assert steady_rate(rates, throughput=False) == 10_000.0  # the median step ignores the slow one
    assert steady_rate(rates, throughput=True) == pytest.approx(3_000 / 1.0)  # 3,000 tokens in 1.0 s
