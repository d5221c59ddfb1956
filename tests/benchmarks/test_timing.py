"""Interleaved timing: the call order it promises (warmup, rotation, settling calls)."""

from __future__ import annotations

from benchmarks.timing import medians, time_interleaved


def _recording(calls: list[str], name: str):
    return lambda: calls.append(name)


def test_each_timed_call_follows_its_own_settling_calls():
    calls: list[str] = []
    fns = {n: _recording(calls, n) for n in ("a", "b")}
    times = time_interleaved(fns, 2, warmup=1, settle=1)
    # warmup a, b; round 0: (a a) (b b); round 1 rotated: (b b) (a a)
    assert calls == ["a", "b", "a", "a", "b", "b", "b", "b", "a", "a"]
    assert {n: len(t) for n, t in times.items()} == {"a": 2, "b": 2}


def test_without_settling_each_round_calls_each_once_rotated():
    calls: list[str] = []
    fns = {n: _recording(calls, n) for n in ("a", "b", "c")}
    times = time_interleaved(fns, {"a": 2, "b": 1, "c": 2}, warmup=0)
    assert calls == ["a", "b", "c", "c", "a"]  # b is timed in the first round only
    assert sorted(medians(times)) == ["a", "b", "c"]
