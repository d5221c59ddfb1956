"""The CPU thread count a run keeps, chosen by timing its own steps under each candidate, again and again.

On a machine that other processes share, the best number of PyTorch threads depends on a load the run
cannot see: alone, every core; beside one busy process, often fewer threads than cores, because a thread
that waits at a barrier for a sibling the scheduler has put aside wastes the whole step. The tuner
measures instead of guessing: after a few warm steps it runs a few steps at each candidate count,
interleaved (the other processes' load comes and goes; every count must meet the same phases of it), keeps
the fastest, and probes again after a while, or at once when the kept count's step time drifts (the load
changed). A switch must not change results: the callback tunes only compositions checked to train the
same bits on any count, with compiled kernels pinned to the starting count (runtime/callbacks/thread_tuner.py;
tests/runtime/test_thread_tuner.py switches a run mid-way and compares it with one that keeps its count).

``choose_threads`` is the decision alone (a pure function of timings); ``ThreadTuner`` the schedule around
it, fed one step time at a time; ``runtime/callbacks/thread_tuner.py`` feeds it a training run's steps and
``cpu_thread_tuner`` any other loop (evaluation, the harness).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch


@dataclass(frozen=True)
class TuningPlan:
    """How often and how long the tuner measures."""

    warm_steps: int = 2  # left untimed at the start: allocator warm-up, compilation
    settle_steps: int = 1  # left out of the drift window after the kept count is set: the new team starts
    probe_steps: int = 4  # timed steps per candidate, interleaved with the others'; their median is its time
    hold_steps: int = 200  # steps on the kept count before it is questioned again
    drift: float = 1.5  # the kept count's recent median this many times slower (or faster): probe at once
    drift_window: int = 8  # steps in that recent median: a busy machine's step times jump from step to step
    margin: float = 0.05  # another count must be this much faster to replace the one in use


def candidate_threads(cores: int) -> list[int]:
    """Thread counts worth trying on ``cores`` cores, most first: every count up to 4, then powers of two
    and ``cores`` itself (a 64-core machine probes 7 counts, not 64)."""
    counts = {c for c in range(1, min(cores, 4) + 1)}
    power = 8
    while power < cores:
        counts.add(power)
        power *= 2
    counts.add(max(1, cores))
    return sorted(counts, reverse=True)


def probe_order(candidates: Sequence[int], current: int, rounds: int) -> list[int]:
    """The thread count of each step of a probe: ``rounds`` rounds over every candidate, the count in use
    first, each round the previous one reversed (2 1 | 1 2 | 2 1 ...). On a busy machine the step time
    follows the other processes' phases; interleaved, every count sees the same phases. With two counts
    and an even number of rounds (the default plan's 4) each count's steps follow a switch equally often;
    with more counts the middle ones always follow a switch (libgomp keeps its thread pool, so a switch
    costs no thread start)."""
    first = [current] + [n for n in candidates if n != current]
    return [n for r in range(rounds) for n in (first if r % 2 == 0 else first[::-1])]


def choose_threads(seconds: Mapping[int, Sequence[float]], current: int, margin: float) -> int:
    """The thread count to keep, from timed steps per count (seconds per unit of work): the one with the
    lowest median, unless ``current`` is within ``margin`` of it (a switch must pay for itself; timing
    noise alone does not flip the choice). Ties go to fewer threads (fewer cores taken from others)."""
    medians = {n: statistics.median(times) for n, times in seconds.items() if times}
    if not medians:
        raise ValueError("no timed steps to choose a thread count from")
    best = min(medians, key=lambda n: (medians[n], n))
    if current in medians and medians[current] <= medians[best] * (1 + margin):
        return current
    return best


@dataclass
class Decision:
    step: int
    threads: int
    seconds: dict[int, float]  # median seconds per unit of work, by thread count
    reason: str  # start, periodic or drift

    def describe(self) -> str:
        timings = ", ".join(f"{n}: {s * 1e3:.1f} ms" for n, s in sorted(self.seconds.items()))
        return f"cpu threads: {self.threads} at step {self.step} ({self.reason} probe; per step {timings})"

    def record(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "threads": self.threads,
            "reason": self.reason,
            "seconds_per_step": {str(n): round(s, 6) for n, s in sorted(self.seconds.items())},
        }


class ThreadTuner:
    """Step by step: ``threads`` is the count for the next step; ``record(seconds)`` after each step
    (seconds per unit of work when steps differ in size) returns the count for the one after, and sets it
    through ``apply`` when it changes."""

    KEPT_DECISIONS = 20  # the summary keeps the newest decisions; a long run probes hundreds of times

    def __init__(self, cores: int, plan: TuningPlan = TuningPlan(), apply: Optional[Callable[[int], None]] = None):
        self.plan = plan
        self.candidates = candidate_threads(cores)
        self.apply = apply or _set_torch_threads
        self.ceiling = max(self.candidates)  # the count the tuner started on: never more
        self.threads = self.ceiling
        self.step = 0
        self.decisions: list[Decision] = []
        self.probes = 0  # probes started
        self.decided = 0  # probes finished with a decision
        self.steps_by_threads: dict[int, int] = {}
        self._phase = "warm"
        self._left = plan.warm_steps  # steps left in this phase
        self._queue: list[int] = []  # the counts of the probe's steps still to come
        self._timings: dict[int, list[float]] = {}
        self._recent: deque[float] = deque(maxlen=max(1, plan.drift_window))
        self._reference = 0.0
        self._settling = 0
        self._probing_from = self.threads
        self._reason = "start"

    @property
    def active(self) -> bool:
        return len(self.candidates) > 1

    def record(self, seconds: float) -> int:
        self.steps_by_threads[self.threads] = self.steps_by_threads.get(self.threads, 0) + 1
        self.step += 1
        if not self.active:
            return self.threads
        if self._phase == "warm":
            self._left -= 1
            if self._left <= 0:
                self._start_probe()
        elif self._phase == "probe":
            self._timings[self.threads].append(seconds)
            self._next_probe_step()
        else:
            self._hold(seconds)
        return self.threads

    def _hold(self, seconds: float) -> None:
        if self._settling > 0:
            self._settling -= 1
            return
        self._left -= 1
        self._recent.append(seconds)
        if self._left <= 0:
            self._reason = "periodic"
            self._start_probe()
        elif len(self._recent) == self._recent.maxlen:
            ratio = statistics.median(self._recent) / self._reference
            if ratio > self.plan.drift or ratio < 1 / self.plan.drift:
                self._reason = "drift"
                self._start_probe()

    def _start_probe(self) -> None:
        self._probing_from = self.threads  # kept unless another count is faster by the margin
        self._queue = probe_order(self.candidates, self.threads, max(1, self.plan.probe_steps))
        self._timings = {n: [] for n in self.candidates}
        self._phase = "probe"
        self.probes += 1
        self._switch(self._queue.pop(0), settle=False)  # the count in use: no switch

    def _next_probe_step(self) -> None:
        if self._queue:
            self._switch(self._queue.pop(0), settle=False)
            return
        kept = choose_threads(self._timings, self._probing_from, self.plan.margin)
        medians = {n: statistics.median(t) for n, t in self._timings.items()}
        self.decisions.append(Decision(self.step, kept, medians, self._reason))
        self.decided += 1
        self.decisions = self.decisions[-self.KEPT_DECISIONS :]
        self._reference = medians[kept]
        self._recent.clear()
        self._phase = "hold"
        self._left = self.plan.hold_steps
        self._switch(kept, settle=True)

    def _switch(self, threads: int, settle: bool) -> None:
        changed = threads != self.threads
        self.threads = threads
        self._settling = self.plan.settle_steps if (settle and changed) else 0
        if changed:
            self.apply(threads)

    def summary(self) -> dict[str, Any]:
        """What the tuner chose and measured: the summary's ``cpu_threads`` record."""
        return {
            "threads": self.threads,
            "candidates": self.candidates,
            "probes": self.probes,
            "steps_by_threads": {str(n): s for n, s in sorted(self.steps_by_threads.items())},
            "decisions": [d.record() for d in self.decisions],
        }


def _set_torch_threads(threads: int) -> None:

    torch.set_num_threads(threads)


class LoopThreadTuner:
    """A ``ThreadTuner`` around any loop of similar steps (evaluation batches, harness requests):
    ``with tuner.timed_step(work=tokens): ...`` times the body and sets the count for the next one;
    ``restore()`` puts back the count the process had. Disabled, it times and changes nothing."""

    def __init__(self, plan: TuningPlan = TuningPlan(), enabled: bool = True):

        self._initial = torch.get_num_threads()
        self.tuner: Optional[ThreadTuner] = ThreadTuner(self._initial, plan) if enabled else None

    @contextlib.contextmanager
    def timed_step(self, work: float = 1.0) -> Iterator[None]:
        started = time.perf_counter()
        yield
        if self.tuner is not None:
            self.tuner.record((time.perf_counter() - started) / max(work, 1e-12))

    def restore(self) -> None:
        if self.tuner is not None:
            _set_torch_threads(self._initial)


# components whose training steps give the same bits on any thread count, checked by switching the count
# mid-run (tests/runtime/test_thread_tuner.py); K3-style compositions (KDA, MLA, the latent MoE, MTP) are
# not: experiment=k3_tiny switched between 1 and 2 threads drifts at step 4 (5.5229349 against 5.5229359)
THREAD_INVARIANT = {"mixer": {"gqa"}, "ffn": {"dense"}, "residual": {"plain"}, "balancer": {"none"}}


def thread_invariant(root: Any) -> bool:
    """Whether the composition is built only of components known to train the same on any thread count."""
    for group, names in THREAD_INVARIANT.items():
        if getattr(getattr(root, group), "name", None) not in names:
            return False
    return not root.mixers and not root.ffns and not root.model.mtp_depth


def cpu_thread_tuner(
    device: Any = "cpu", invariant: bool = True, plan: TuningPlan = TuningPlan(hold_steps=100)
) -> LoopThreadTuner:
    """A tuner for an eager evaluation loop on ``device``: tuning this process's threads (up to its count
    now) on a CPU, inert on a GPU or when the model is not ``invariant`` (pass
    ``thread_invariant(root)``: other compositions' sums depend on the count)."""

    return LoopThreadTuner(plan, enabled=invariant and torch.device(device).type == "cpu")
