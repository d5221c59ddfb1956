"""A composition's steady-state training speed, measured by throwaway runs of ``train.py``.

Used by the ladder's ``--dry-run`` (to size rungs from measured rates) and by the benchmarks that compare
how a run fares beside other processes. The first steps (compilation, recompiles, allocator warm-up) are
left out of the rate; they and everything else outside the steps (start-up, validation, writing) are the
run's overhead.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from runtime.cpu_threads import threads_per_job
from runtime.json_records import read_json_lines

REPO = Path(__file__).resolve().parent.parent
WARM_STEPS = 2  # steps left out of the steady-state rate: compilation and its recompiles land here


@dataclass(frozen=True)
class Rate:
    """Steady-state training tokens/s per run, and the seconds a run spends outside its steady steps."""

    tokens_per_s: float
    overhead_s: float
    cpu_threads: Optional[dict] = None  # the first run's summary record of its CPU threads (what it chose)

    def seconds(self, tokens: float) -> float:
        return self.overhead_s + tokens / self.tokens_per_s


def steady_rate(step_rates: list[float], throughput: bool) -> float:
    """One rate from per-step tokens/s of equal-sized steps: the median step, or with ``throughput`` the
    tokens over the time (their harmonic mean)."""
    return statistics.harmonic_mean(step_rates) if throughput else statistics.median(step_rates)


def probe_rate(
    overrides: list[str],
    steps: int,
    copies: int = 1,
    env: Optional[dict[str, str]] = None,
    warm: int = WARM_STEPS,
    throughput: bool = False,
) -> Rate:
    """``copies`` runs of ``train.py`` at once (each with its share of the cores unless ``env`` sets
    ``OMP_NUM_THREADS``), ``warm + steps`` steps each. The rate is the median of the logged per-step
    tokens/s after the warm steps, over all copies (a typical step: what sizing a run needs), or with
    ``throughput`` their tokens over their time (the harmonic mean: on a busy machine step times jump
    between the other processes' phases, and the median would pick one phase); the overhead is the rest
    of a run's wall time. Raises RuntimeError with the last line a failing run printed."""
    base = dict(os.environ if env is None else env)
    env = {**base, **threads_per_job(copies, base)}
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        started = time.perf_counter()
        for copy in range(copies):
            argv = [
                sys.executable,
                str(REPO / "train.py"),
                *overrides,
                f"trainer.max_steps={warm + steps}",
                "trainer.max_time_minutes=null",
                "trainer.log_every_n_steps=1",
                "logger=csv",
                "trainer.enable_progress_bar=false",
                f"output_root={tmp}",
                f"name=rate{copy}",
            ]
            procs.append(
                subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            )
        rates, walls, trained, threads = [], [], 0, None
        for copy, proc in enumerate(procs):
            _, err = proc.communicate()
            walls.append(time.perf_counter() - started)
            if proc.returncode != 0:
                raise RuntimeError((err.strip().splitlines() or ["(no output)"])[-1])
            rows = read_json_lines(Path(tmp) / f"rate{copy}" / "metrics.jsonl")
            rates += [r["perf/tokens_per_s"] for r in rows if "perf/tokens_per_s" in r and r["step"] >= warm]
            summary = json.loads((Path(tmp) / f"rate{copy}" / "summary.json").read_text())
            trained = summary["train_tokens"]
            if copy == 0:
                threads = summary.get("cpu_threads")
        if not rates:
            raise RuntimeError("no per-step tokens/s was logged")
        rate = steady_rate(rates, throughput)
        return Rate(rate, max(0.0, statistics.median(walls) - trained / rate), threads)
