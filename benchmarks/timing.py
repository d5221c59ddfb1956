"""Interleaved wall-clock timing shared by the benchmark scripts.

Candidates run one call each per round, in an order rotated every round, so clock, thermal and
background-load drift hits all of them alike; report medians over the rounds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping


def time_interleaved(
    fns: Mapping[str, Callable[[], object]],
    repeats: int | Mapping[str, int],
    warmup: int = 1,
    sync: Callable[[], object] | None = None,
    settle: int = 0,
) -> dict[str, list[float]]:
    """Seconds per call for each fn, measured in interleaved rounds.

    ``repeats`` is the number of rounds, or a per-name number of timed calls (a slow candidate
    can take part in only the first few rounds while the others run in all of them). Each fn
    gets ``warmup`` untimed calls first. ``sync`` (e.g. ``torch.cuda.synchronize``) runs before
    every clock read. ``settle``: untimed calls of the same fn right before each timed one. Whole
    training steps of different models in one process rearrange the heap for one another: the
    step after another model's reuses none of its own freed blocks and faults in fresh pages (a
    0.2 s step measured 0.7-1.2 s that way on a 2-core VM); one settling call measures each in the
    steady state it has when it trains alone, as a run does.
    """
    names = list(fns)
    counts = {n: repeats for n in names} if isinstance(repeats, int) else {n: int(repeats[n]) for n in names}
    sync = sync or (lambda: None)
    for _ in range(warmup):
        for n in names:
            if counts[n] > 0:
                fns[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(max(counts.values(), default=0)):
        for i in range(len(names)):
            n = names[(i + r) % len(names)]
            if len(times[n]) >= counts[n]:
                continue
            for _ in range(settle):
                fns[n]()
            sync()
            t0 = time.perf_counter()
            fns[n]()
            sync()
            times[n].append(time.perf_counter() - t0)
    return times


def medians(times: Mapping[str, list[float]]) -> dict[str, float]:
    """Median seconds per name (NaN where nothing was timed)."""
    return {n: statistics.median(ts) if ts else float("nan") for n, ts in times.items()}
