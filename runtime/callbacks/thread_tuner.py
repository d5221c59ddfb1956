"""A CPU run's thread count kept right for the load it meets (``trainer.cpu_threads=auto``).

Each training micro-batch is timed (from its start to its end: forward, backward and, at the end of an
accumulation, the optimizer step) and fed to ``runtime.cpu_thread_tuning.ThreadTuner``, which sets the
count for the next one. Each decision is printed; ``summary()`` is the run summary's ``cpu_threads``
record. A run's thread count at the start is its ceiling.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

import lightning as L
import torch

from runtime.cpu_thread_tuning import ThreadTuner, TuningPlan, thread_invariant
from runtime.cpu_wait_policy import describe_wait_policy


class CpuThreadTuner(L.Callback):
    """Tunes when ``enabled``; otherwise only reports the fixed count (``for_run`` decides which)."""

    def __init__(self, plan: TuningPlan = TuningPlan(), apply: Optional[Any] = None, enabled: bool = True):
        self.plan = plan
        self.enabled = enabled
        self.requested = "auto" if enabled else "fixed"  # trainer.cpu_threads, when made by for_run
        self.on_cpu = True  # the run trains on the CPU (for_run sets it)
        self.apply = apply  # tests force switches through it; None: torch.set_num_threads
        self.tuner: Optional[ThreadTuner] = None  # made at the start of training, on the count it starts with
        self._started = 0.0
        self._reported = 0  # decisions printed so far
        self._inductor_threads: Optional[int] = None  # torch.compile's CPU thread setting before the run

    @classmethod
    def for_run(cls, root: Any) -> "CpuThreadTuner":
        """Enabled for ``trainer.cpu_threads=auto`` on a one-process CPU run of a composition whose losses
        are known not to depend on the thread count. With several ranks each step waits for the slowest
        rank, so a rank's own step time says little about its threads."""
        t = root.trainer
        on_cpu = t.accelerator == "cpu" or (t.accelerator == "auto" and not torch.cuda.is_available())
        one_process = t.devices in (1, "auto") and t.num_nodes == 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1
        tuner = cls(enabled=t.cpu_threads == "auto" and on_cpu and one_process and thread_invariant(root))
        tuner.requested = t.cpu_threads
        tuner.on_cpu = on_cpu
        return tuner

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if not self.enabled:
            return
        # torch.compile's CPU kernels size their parallel reductions (a partial sum per thread) by the count
        # in use when they run; pinned to the starting count they split every sum the same way whatever
        # the tuner sets (eager kernels and matrix products split work, not sums, and follow the tuner)
        import torch._inductor.config as inductor  # start-up time: only runs that pin compiled kernels

        self._inductor_threads = inductor.cpp.threads
        inductor.cpp.threads = torch.get_num_threads()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.enabled and self._inductor_threads is not None:
            import torch._inductor.config as inductor  # start-up time: only runs that pin compiled kernels

            inductor.cpp.threads = self._inductor_threads
            self._inductor_threads = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not self.enabled:
            return
        self.tuner = ThreadTuner(torch.get_num_threads(), self.plan, self.apply)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.tuner is None:
            return
        self.tuner.record(time.perf_counter() - self._started)
        if self.tuner.decided > self._reported:
            self._reported = self.tuner.decided
            decision = self.tuner.decisions[-1]
            if trainer.is_global_zero:
                print(decision.describe(), flush=True)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        # validation runs on the run's starting count, as a fixed run's does: a graph compiled for it
        # while the tuner had fewer threads would be generated for that count and split its sums by it
        self._use(self.tuner.ceiling if self.tuner else None)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._use(self.tuner.threads if self.tuner else None)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._use(self.tuner.ceiling if self.tuner else None)  # the process as the run found it

    def _use(self, threads: Optional[int]) -> None:
        if self.tuner is not None and threads is not None and torch.get_num_threads() != threads:
            self.tuner.apply(threads)

    def summary(self) -> dict[str, Any]:
        """The run summary's ``cpu_threads`` record: the mode, the wait policy in effect and, from the
        tuner, the count it ended on, its probes and decisions, and how many micro-batches ran on each
        count."""
        record: dict[str, Any] = {
            "mode": "auto" if self.enabled else "fixed",
            "requested": self.requested,  # auto, fixed where the run cannot tune (GPU, ranks, composition)
            "wait_policy": describe_wait_policy(os.environ),
            "threads": torch.get_num_threads(),
        }
        if self.tuner is not None:
            record.update(self.tuner.summary())
        return record
